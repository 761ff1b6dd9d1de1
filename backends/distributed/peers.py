"""Messages with one peer stage, for `Transfers`: each transport's way of sending a message and
its header only when it is needed ([Note: a header only when it changes]).

A `Side` is one direction of the exchange with a peer: its `Stream`, how many of its messages
this run has numbered, and the spec and meta of the recent ones (to find what the receiver knows
of a message before it comes). `ShmPeer`, `GlooPeer` and `NcclPeer` move one message at a time:
`send`, `post` (the receive's buffers, where the transport posts ahead) and `process` (the next
message in stream order, as a `Message`).

[Note: nothing to send] A message moves no bytes only when its receiver knows for certain what it
is (`NcclPeer`: [Note: certain shapes]). Over shared memory and gloo a basis is a guess that the
message's first record or buffer confirms; a basis without tensors leaves nothing to confirm it
with, so it counts as none (`Side.known` returns None) and the header always travels: a message
with no tensors (a boundary whose values take no gradient sends an empty gradient message) is
one header, never nothing. One rule, in `Side.known`, for every transport.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Mapping
from typing import Any

import torch

from schedcc.backends.distributed.links import DATA, SIDE, LinkIO
from schedcc.backends.distributed.shm import ShmLinks
from schedcc.backends.distributed.streams import Stream
from schedcc.backends.distributed.wire import (
    HEAD_WORDS,
    expecting,
    first_tensor,
    header,
    is_marker,
    marker,
    read_header,
)
from schedcc.backends.runtime.boundary import Message
from schedcc.backends.runtime.syncs import host_read
from schedcc.backends.runtime.values import Spec, TensorMeta, empty_tensors

__all__ = ["GlooPeer", "Known", "NcclPeer", "ShmPeer", "Side"]

#: What a receiver knows of a message before it comes: its basis's spec and meta, or None.
Known = tuple[Spec, tuple[TensorMeta, ...]] | None
_DATA_TAG, _SIDE_TAG = 0, 1


class Side:
    """One direction of the exchange with a peer (see the module docstring).

    `rule`, what is known of a message before it comes: "basis" (shared memory, gloo), its
    basis's spec and meta (`Stream.basis`), if that has tensors ([Note: nothing to send]);
    "certain" (NCCL, [Note: certain shapes]), what an earlier run's message of the same channel
    and input shapes was; "none" (NCCL with `dynamic_shapes`), nothing: every message sends its
    header.
    """

    __slots__ = (
        "certain",
        "history",
        "index",
        "keys",
        "processed",
        "ready",
        "rule",
        "seen",
        "stream",
    )

    def __init__(self, stream: Stream, *, rule: str = "basis"):
        self.stream = stream
        self.rule = rule
        self.index = {op: n for n, op in enumerate(stream.ops)}  # op -> place in a run
        self.history: dict[int, tuple[Spec, tuple[TensorMeta, ...]]] = {}
        self.processed = 0  # receiving: messages processed so far, over every run
        self.ready: dict[int, Message] = {}  # receiving: processed, not yet taken
        #: certain: (channel, input shapes) -> spec and meta, from the runs before this one
        self.seen: dict[Hashable, tuple[Spec, tuple[TensorMeta, ...]]] = {}
        #: certain: each message's (channel, input shapes) in this run
        self.keys: list[Hashable] = [None] * len(stream.ops)

    def begin(self, signatures: Mapping[int, Hashable] | None) -> None:
        """A run starts: its microbatches' input shapes (`signatures[i]`, or None: unknown)."""
        if self.rule == "certain":
            sig = signatures or {}
            self.keys = [
                (channel, sig.get(op.microbatch))  # type: ignore[attr-defined]
                for op, channel in zip(self.stream.ops, self.stream.channels)
            ]

    def number(self, op: Any, run: int) -> int:
        """The number of `op`'s message in run `run`, counted over every run."""
        return run * len(self.stream.ops) + self.index[op]

    def known(self, number: int) -> Known:
        """What the receiver knows of message `number` before it comes, or None (a header)."""
        if self.rule == "certain":
            return self.seen.get(self.keys[number % len(self.stream.ops)])
        if self.rule == "none":
            return None
        basis = self.stream.basis(number)
        if basis is None:
            return None
        known = self.history[basis]
        return known if known[1] else None  # see [Note: nothing to send]

    def record(self, number: int, message: Message) -> None:
        self.history[number] = (message.spec, message.meta)

    def finish(self, run: int) -> None:
        """Run `run` ended: remember its messages' shapes (certain) and drop what no basis can
        be any more (a basis is at most a run back)."""
        size = len(self.stream.ops)
        if self.rule == "certain":
            for n in range(size):
                got = self.history.get(run * size + n)
                if got is not None:
                    self.seen[self.keys[n]] = got
        for old in [n for n in self.history if n < run * size]:
            del self.history[old]


def changed(message: Message, known: Known) -> bool:
    """Whether `message` needs its header: nothing known, or another spec or meta."""
    return known is None or (message.spec, message.meta) != known


class ShmPeer:
    """A peer on this machine: records in order on a shared-memory link (`ShmLinks`); a header
    is a record of its own, told apart from a tensor by its kind."""

    def __init__(self, links: ShmLinks, peer: int):
        self._links = links
        self._peer = peer
        self._record = 0  # the record number where the next message to process starts

    @property
    def waited(self) -> float:
        """Seconds this stage has waited for its same-host peers' records ([Note: a receive's
        take] in `schedcc.costs`)."""
        return self._links.waited

    def send(self, number: int, message: Message, known: Known) -> None:
        links, peer = self._links, self._peer
        if changed(message, known):
            links.send_header(peer, header(number, message))
        for tensor in message.tensors:
            links.send(peer, tensor)

    def process(self, number: int, known: Known) -> Message:
        """Message `number`, the next one of the stream.

        Raises:
            ValueError: it disagrees with what this side expects (a missing or wrong header, a
                tensor of another size).
        """
        links, peer = self._links, self._peer
        first = known[1][0] if known is not None else None
        want = None if first is None else (first.shape, first.dtype)  # read at once if it is
        words = links.recv_header(peer, self._record, want)
        if words is not None:
            self._record += 1
            spec, meta = read_header(words, number)
        elif known is None:
            raise ValueError(f"message {number} came without the header it needs")
        else:
            spec, meta = known
        tensors = [links.recv(peer, self._record + j, m.shape, m.dtype) for j, m in enumerate(meta)]
        self._record += len(meta)
        return Message(tensors, spec, meta)


class _Waits:
    """A peer over process-group works: the seconds its receives have waited for them, in all
    (`waited`, [Note: a receive's take])."""

    waited = 0.0

    def _wait(self, work, timeout) -> None:
        start = time.perf_counter()
        try:
            work.wait(timeout)
        finally:
            self.waited += time.perf_counter() - start


class GlooPeer(_Waits):
    """A peer over gloo point-to-point: the receives of a message are posted ahead, shaped like
    its basis ([Note: telling a header from data over gloo] in `backends.distributed.wire`)."""

    def __init__(self, pp_group, peer: int, device: torch.device):
        self._group = pp_group
        self._peer = peer
        self._device = device
        self._posted: dict[int, list[tuple[torch.Tensor, Any]]] = {}
        self._dummies: dict[tuple, torch.Tensor] = {}

    def send(self, number: int, message: Message, known: Known) -> list[tuple[Any, torch.Tensor]]:
        """Post the sends of message `number`; the `(work, tensor)` pairs to keep until done."""
        works: list[tuple[Any, torch.Tensor]] = []
        if known is not None and not changed(message, known):
            for tensor in message.tensors:
                works.append(self._send(tensor, _DATA_TAG))
            return works
        words = header(number, message)
        if known is not None:  # the receive expects the basis's tensors
            expected = known[1]
            works.append(self._send(marker(expected[0], self._device), _DATA_TAG))
            for meta in expected[1:]:
                works.append(self._send(self._dummy(meta), _DATA_TAG))
            works.extend(self._send_header(words, first=None))
        else:  # the receive expects a header
            works.extend(self._send_header(words, first=_DATA_TAG))
        for tensor in message.tensors:
            works.append(self._send(tensor, _SIDE_TAG))
        return works

    def post(self, number: int, known: Known) -> None:
        """Post the receives of message `number`, expecting its basis's tensors (or a header)."""
        if known is not None:
            metas = known[1]
            buffers = [expecting(metas[0], self._device)]
            buffers += empty_tensors(metas[1:], device=self._device)
        else:
            buffers = [torch.empty(HEAD_WORDS, dtype=torch.int64, device=self._device)]
        self._posted[number] = [(b, self._group.recv([b], self._peer, _DATA_TAG)) for b in buffers]

    def process(self, number: int, known: Known, timeout) -> Message:
        """Message `number` (its receives posted), the next one of the stream.

        Raises:
            ValueError: it disagrees with what this side expects.
        """
        posted = self._posted.pop(number)
        for _, work in posted:
            self._wait(work, timeout)
        first = posted[0][0]
        if known is not None:
            if not is_marker(first):
                spec, meta = known
                tensors = [first_tensor(first, meta[0])] + [b for b, _ in posted[1:]]
                return Message(tensors, spec, meta)
            words = self._recv_header(None, timeout)
        else:
            words = self._recv_header(first, timeout)
        spec, meta = read_header(words, number)
        tensors = empty_tensors(meta, device=self._device)
        for tensor in tensors:
            self._wait(self._group.recv([tensor], self._peer, _SIDE_TAG), timeout)
        return Message(tensors, spec, meta)

    # -- helpers --------------------------------------------------------------------------------

    def _send(self, tensor: torch.Tensor, tag: int) -> tuple[Any, torch.Tensor]:
        return self._group.send([tensor], self._peer, tag), tensor

    def _send_header(self, words: torch.Tensor, first: int | None) -> list:
        """`[length, words...]` in a first part of at most `HEAD_WORDS` (on tag `first`, or the
        side tag) and the rest on the side tag."""
        full = torch.cat([torch.tensor([words.numel()], dtype=torch.int64), words])
        full = full.to(self._device)
        sent = [self._send(full[:HEAD_WORDS], _SIDE_TAG if first is None else first)]
        if full.numel() > HEAD_WORDS:
            sent.append(self._send(full[HEAD_WORDS:], _SIDE_TAG))
        return sent

    def _recv_header(self, head: torch.Tensor | None, timeout) -> torch.Tensor:
        """The header words: from `head` (already received) or the side tag, and the rest."""
        if head is None:
            head = torch.empty(HEAD_WORDS, dtype=torch.int64, device=self._device)
            self._wait(self._group.recv([head], self._peer, _SIDE_TAG), timeout)
        length = int(head[0].item())
        if not 0 < length < 1 << 24:
            raise ValueError("what came is not a message header")
        if length + 1 <= HEAD_WORDS:
            return head[1 : 1 + length].cpu()
        rest = torch.empty(length + 1 - HEAD_WORDS, dtype=torch.int64, device=self._device)
        self._wait(self._group.recv([rest], self._peer, _SIDE_TAG), timeout)
        return torch.cat([head[1:], rest]).cpu()

    def _dummy(self, meta: TensorMeta) -> torch.Tensor:
        key = (meta.shape, meta.dtype)
        if key not in self._dummies:
            self._dummies[key] = torch.zeros(meta.shape, dtype=meta.dtype, device=self._device)
        return self._dummies[key]


class NcclPeer(_Waits):
    """A peer over per-direction links ([Note: one link per direction] in
    `backends.distributed.links`): tensors of the sizes both sides know, never more or less.

    [Note: certain shapes] NCCL receives into buffers of exactly the sent size, and reading
    anything on the host stops the CPU from running ahead of the GPU ([Note: host syncs]). So a
    receiver posts a message's tensors only where it knows their shapes *for certain*: an earlier
    run sent a message on the same channel for a microbatch whose inputs had the same spec and
    meta (every stage checks every batch, so every stage knows them: `Side.begin`); the sender
    checks that its message is shaped so and sends nothing else. Elsewhere (the first run, new
    input shapes) the message sends its header, `[length, words...]` padded to `HEAD_WORDS`, on
    the DATA lane where the receive is posted ahead, the rest of a long header and the tensors on
    the SIDE lane, which the receiver posts once it has read the header (one host read). Tensors
    with no elements move nothing (both sides know their shapes). A boundary whose shapes do not
    follow from the inputs' (values decide them) is refused by the sender, naming the message.
    """

    def __init__(self, io: LinkIO, peer: int, device: torch.device):
        self._io = io
        self._peer = peer
        self._device = device
        self._posted: dict[int, list[tuple[torch.Tensor, Any]]] = {}

    def send(self, number: int, message: Message, known: Known) -> list[tuple[Any, torch.Tensor]]:
        """Post the sends of message `number`; the `(work, tensor)` pairs to keep until done.

        Raises:
            ValueError: the message is not shaped as the receiver knows it must be.
        """
        if known is not None:
            if changed(message, known):
                raise ValueError(
                    f"message {number} is shaped otherwise than an earlier one of its channel "
                    "for inputs of the same shapes; under p2p='nccl' a boundary's shapes must "
                    "follow from the inputs' shapes"
                )
            return [self._send(t, DATA) for t in message.tensors if t.numel()]
        words = header(number, message)
        full = torch.zeros(max(HEAD_WORDS, words.numel() + 1), dtype=torch.int64)
        full[0] = words.numel()
        full[1 : 1 + words.numel()] = words
        full = full.to(self._device)
        sent = [self._send(full[:HEAD_WORDS], DATA)]
        if full.numel() > HEAD_WORDS:
            sent.append(self._send(full[HEAD_WORDS:], SIDE))
        return sent + [self._send(t, SIDE) for t in message.tensors if t.numel()]

    def post(self, number: int, known: Known) -> None:
        """Post the receives of message `number` on the DATA lane: its tensors, or a header."""
        if known is not None:
            buffers = empty_tensors(known[1], device=self._device)
        else:
            buffers = [torch.empty(HEAD_WORDS, dtype=torch.int64, device=self._device)]
        self._posted[number] = [(b, self._recv(b, DATA)) for b in buffers]

    def process(self, number: int, known: Known, timeout) -> Message:
        """Message `number` (its receives posted), the next one of the stream.

        Raises:
            ValueError: it disagrees with what this side expects.
        """
        posted = self._posted.pop(number)
        for _, work in posted:
            if work is not None:
                self._wait(work, timeout)
        if known is not None:
            return Message([b for b, _ in posted], *known)
        head = host_read(posted[0][0])  # see [Note: host syncs]
        length = head[0]
        if not 0 < length < 1 << 24:
            raise ValueError("what came is not a message header")
        words = head[1 : 1 + length]
        if length + 1 > HEAD_WORDS:
            rest = torch.empty(length + 1 - HEAD_WORDS, dtype=torch.int64, device=self._device)
            self._wait(self._recv(rest, SIDE), timeout)
            words += host_read(rest)
        spec, meta = read_header(torch.tensor(words, dtype=torch.int64), number)
        tensors = empty_tensors(meta, device=self._device)
        works = [self._recv(t, SIDE) for t in tensors]
        for work in works:
            if work is not None:
                self._wait(work, timeout)
        return Message(tensors, spec, meta)

    def _send(self, tensor: torch.Tensor, lane: int) -> tuple[Any, torch.Tensor]:
        return self._io.send(tensor, self._peer, lane), tensor

    def _recv(self, tensor: torch.Tensor, lane: int):
        """The receive's work, or None for a tensor with no elements (nothing moves)."""
        return self._io.recv(tensor, self._peer, lane) if tensor.numel() else None
