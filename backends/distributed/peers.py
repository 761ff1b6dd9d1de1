"""Messages with one peer stage, for `Transfers`: each transport's way of sending a message and
its header only when it changed ([Note: a header only when it changes]).

A `Side` is one direction of the exchange with a peer: its `Stream`, how many of its messages
this run has numbered, and the spec and meta of the recent ones (to find a message's basis).
`ShmPeer` and `GlooPeer` move one message at a time: `send` (with or without its header),
`post` (gloo: the receive's buffers, shaped like the basis) and `process` (the next message in
stream order, as a `Message`). Under NCCL, `exchange_nccl` moves a whole comm group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

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
from schedcc.backends.runtime.values import Spec, TensorMeta, empty_tensors

__all__ = ["GlooPeer", "Known", "ShmPeer", "Side", "exchange_nccl"]

#: What a receiver knows of a message before it comes: its basis's spec and meta, or None.
Known = tuple[Spec, tuple[TensorMeta, ...]] | None
_DATA_TAG, _SIDE_TAG = 0, 1


class Side:
    """One direction of the exchange with a peer (see the module docstring)."""

    __slots__ = ("history", "index", "processed", "ready", "stream")

    def __init__(self, stream: Stream):
        self.stream = stream
        self.index = {op: n for n, op in enumerate(stream.ops)}  # op -> place in a run
        self.history: dict[int, tuple[Spec, tuple[TensorMeta, ...]]] = {}
        self.processed = 0  # receiving: messages processed so far, over every run
        self.ready: dict[int, Message] = {}  # receiving: processed, not yet taken

    def number(self, op: Any, run: int) -> int:
        """The number of `op`'s message in run `run`, counted over every run."""
        return run * len(self.stream.ops) + self.index[op]

    def known(self, number: int) -> Known:
        """The spec and meta of message `number`'s basis, or None (no basis)."""
        basis = self.stream.basis(number)
        return None if basis is None else self.history[basis]

    def record(self, number: int, message: Message) -> None:
        self.history[number] = (message.spec, message.meta)

    def forget_before(self, number: int) -> None:
        """Drop the spec and meta of messages before `number` (no basis can be one of them)."""
        for old in [n for n in self.history if n < number]:
            del self.history[old]


def changed(message: Message, known: Known) -> bool:
    """Whether `message` needs its header: no basis, or another spec or meta than the basis's."""
    return known is None or (message.spec, message.meta) != known


class ShmPeer:
    """A peer on this machine: records in order on a shared-memory link (`ShmLinks`); a header
    is a record of its own, told apart from a tensor by its kind."""

    def __init__(self, links: ShmLinks, peer: int):
        self._links = links
        self._peer = peer
        self._record = 0  # the record number where the next message to process starts

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
        first = known[1][0] if known is not None and known[1] else None
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


class GlooPeer:
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
        if known is not None and known[1] and not changed(message, known):
            for tensor in message.tensors:
                works.append(self._send(tensor, _DATA_TAG))
            return works
        words = header(number, message)
        if known is not None and known[1]:  # the receive expects the basis's tensors
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
        if known is not None and known[1]:
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
            work.wait(timeout)
        first = posted[0][0]
        if known is not None and known[1]:
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
            self._group.recv([tensor], self._peer, _SIDE_TAG).wait(timeout)
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
            self._group.recv([head], self._peer, _SIDE_TAG).wait(timeout)
        length = int(head[0].item())
        if not 0 < length < 1 << 24:
            raise ValueError("what came is not a message header")
        if length + 1 <= HEAD_WORDS:
            return head[1 : 1 + length].cpu()
        rest = torch.empty(length + 1 - HEAD_WORDS, dtype=torch.int64, device=self._device)
        self._group.recv([rest], self._peer, _SIDE_TAG).wait(timeout)
        return torch.cat([head[1:], rest]).cpu()

    def _dummy(self, meta: TensorMeta) -> torch.Tensor:
        key = (meta.shape, meta.dtype)
        if key not in self._dummies:
            self._dummies[key] = torch.zeros(meta.shape, dtype=meta.dtype, device=self._device)
        return self._dummies[key]


def exchange_nccl(
    items: Sequence[tuple[int, int, Message | None, Known]],
    pp_group,
    device: torch.device,
    timeout,
) -> dict[int, Message]:
    """One comm group as `batch_isend_irecv` rounds: each message sends a control word (0, or
    the length of its header) with tensors shaped like its basis (its own, or dummies if it
    changed); a second round moves the headers of changed messages and a third their tensors.

    `items`: `(global peer rank, number, message to send or None to receive, known)`, in the
    group's order. Returns the received messages by number.

    Raises:
        ValueError: a received message disagrees with what this side expects.
    """
    rounds: list[list] = [[], [], []]
    sends, recvs = [], []
    for peer, number, message, known in items:
        shaped = [] if known is None else list(known[1])
        if message is not None:
            words = header(number, message).to(device) if changed(message, known) else None
            control = torch.tensor([0 if words is None else words.numel()], device=device)
            tensors = message.tensors if words is None else [_zeros(m, device) for m in shaped]
            rounds[0] += _ops(dist.isend, [control, *tensors], peer, pp_group)
            sends.append((peer, message, words))
        else:
            control = torch.empty(1, dtype=torch.int64, device=device)
            buffers = empty_tensors(shaped, device=device)
            rounds[0] += _ops(dist.irecv, [control, *buffers], peer, pp_group)
            recvs.append((peer, number, known, control, buffers))
    _run_round(rounds[0], timeout)
    lengths = torch.cat([r[3] for r in recvs]).tolist() if recvs else []
    for peer, message, words in sends:
        if words is not None:
            rounds[1] += _ops(dist.isend, [words], peer, pp_group)
            rounds[2] += _ops(dist.isend, message.tensors, peer, pp_group)
    headers = [torch.empty(n, dtype=torch.int64, device=device) if n else None for n in lengths]
    for (peer, *_), words in zip(recvs, headers):
        if words is not None:
            rounds[1] += _ops(dist.irecv, [words], peer, pp_group)
    _run_round(rounds[1], timeout)
    out = {}
    for (peer, number, known, _, buffers), words in zip(recvs, headers):
        if words is None and known is None:
            raise ValueError(f"message {number} came without the header it needs")
        if words is None:
            out[number] = Message(buffers, *known)  # type: ignore[misc]
            continue
        spec, meta = read_header(words.cpu(), number)
        tensors = empty_tensors(meta, device=device)
        rounds[2] += _ops(dist.irecv, tensors, peer, pp_group)
        out[number] = Message(tensors, spec, meta)
    _run_round(rounds[2], timeout)
    return out


def _ops(op, tensors: Sequence[torch.Tensor], peer: int, pp_group) -> list:
    return [dist.P2POp(op, tensor, peer, pp_group) for tensor in tensors]


def _run_round(ops: list, timeout) -> None:
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait(timeout)


def _zeros(meta: TensorMeta, device: torch.device) -> torch.Tensor:
    return torch.zeros(meta.shape, dtype=meta.dtype, device=device)
