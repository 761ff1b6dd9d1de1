"""The distributed `Engine`'s point-to-point: where each send and receive is posted and waited.

Every path posts and waits each op where it helps most (see [Note: eager point-to-point] in
`backends.distributed.eager`: relaxations of the validator's model that cannot add a hang):

- shared memory between stages on the same machine ([Note: same-host point-to-point] in
  `backends.distributed.shm`), gloo send/recv otherwise, or gloo broadcasts in two-rank groups;
- NCCL: the same places, on a two-rank process group per direction and lane ([Note: one link per
  direction] in `backends.distributed.links`), with tensors of the shapes both sides know
  ([Note: certain shapes] in `backends.distributed.peers`).

[Note: sends complete lazily] Sends are waited only at the end of the run (their tensors are kept
alive until then), as torch.distributed.pipelining does. This only relaxes the rendezvous model
the validator proves deadlock-free (a send never holds its stage back), so it cannot introduce a
hang; it keeps a stage from idling while its peer has not yet reached the matching receive.
Under NCCL a send's link is its own, so a send that waits for its receiver holds back only later
sends on that link, which the receiver takes in the same order.

[Note: a message cut short] gloo leaves a receive whose message was cut short by the sender's end
(the process exited partway through the message) waiting for its whole timeout: its buffer is no
longer among the pending ones it tells of the closed socket (gloo's tcp `Pair::signalException`).
So a stage that fails mid-run lets the sends it has posted finish before it ends, for at most
`FLUSH_S` seconds: a message partway through its bytes arrives whole, and its receiver then meets
the closed socket at its next wait, within moments, rather than after the timeout. A send whose
receive was never posted times out in that wait (gloo then closes the pair, which its peer sees at
once). A torch gloo send reports no progress short of its wait (`is_completed()` stays False until
then), so the wait is all there is: a stage that fails because a peer stopped may spend up to
`FLUSH_S` on its sends to it, and the run ends within the timeout plus those seconds. A rank
killed partway through a send still leaves its receiver to its timeout. NCCL's sends are not
waited: their receivers are not gloo's, and a host wait on NCCL that times out may end the process
before it has said why.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Hashable, Mapping, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from schedcc.backends.distributed.eager import EagerPlan, Transfer
from schedcc.backends.distributed.groups import CommGroup
from schedcc.backends.distributed.links import LinkIO
from schedcc.backends.distributed.peers import GlooPeer, NcclPeer, ShmPeer, Side
from schedcc.backends.distributed.shm import ShmLinks
from schedcc.backends.distributed.streams import GLOO, NCCL, SHM, receive_streams, send_streams
from schedcc.backends.runtime.boundary import Message
from schedcc.backends.runtime.stage import StageRuntime
from schedcc.errors import RankFailure
from schedcc.ir import Instruction
from schedcc.program import Program
from schedcc.semantics import Layout

__all__ = ["FLUSH_S", "Transfers", "first_line"]

#: The most seconds a failing stage waits for its posted sends to finish ([Note: a message cut
#: short]).
FLUSH_S = 2.0


class Transfers:
    """Moves one stage's messages to and from its peers, unit by unit of its program.

    The engine calls `begin(signatures)` before a run, `before(i)`, runs compute unit `i`, then
    `after(i)`; `finish(times)` ends a run. Comm groups are not run where they stand: each op is
    posted and waited around the computes ([Note: eager point-to-point]), on every transport.
    `connect()` must have been called on every rank of the pipeline process group `pp_group`
    before the first run. Each message's spec and meta travel in a header only when the receiver
    cannot know them ([Note: a header only when it changes] in `backends.distributed.streams`).

    `p2p`: "shm" (shared memory between same-host stages, gloo send/recv otherwise), "gloo",
    "broadcast" (gloo, through `pairs`) or "nccl" (per-direction links, `links`, NCCL's own or
    its semantics emulated on gloo; `dynamic_shapes`: every message sends its header, for
    boundaries whose shapes the inputs' shapes do not decide).
    """

    def __init__(
        self,
        units: Sequence[Instruction | CommGroup],
        runtime: StageRuntime,
        *,
        program: Program,
        pp_group,
        global_peer: Mapping[int, int],
        device: torch.device,
        timeout: timedelta,
        p2p: str,
        pairs=None,
        links: LinkIO | None = None,
        dynamic_shapes: bool = False,
    ):
        self.units = units
        self.runtime = runtime
        self.program = program
        self.pp_group = pp_group
        self.stage = dist.get_rank(pp_group)
        self.rank = dist.get_rank()
        self.global_peer = global_peer
        self.device = device
        self.timeout = timeout
        self.p2p = p2p
        self.dynamic_shapes = dynamic_shapes
        self._peers = {peer for unit in units if type(unit) is CommGroup for peer in unit.peers}
        # see [Note: eager point-to-point]
        self.eager = EagerPlan(units, program.tensors, self.stage)
        #: Per unit, the receives to post first (the shared-memory ones need none).
        self._to_post = self.eager.post_before
        self._shared_memory = p2p == "shm" and device.type == "cpu"  # CPU tensors
        #: `BroadcastPairs` in place of gloo's send/recv ([Note: broadcast pairs]), or None
        self._pairs = pairs
        #: the NCCL links' io ([Note: one link per direction]), or None
        self._links_io = links
        self._links: ShmLinks | None = None
        #: The peer stages this stage exchanges with through shared memory (after `connect`).
        self.shm_peers: frozenset[int] = frozenset()
        self._io: dict[int, ShmPeer | GlooPeer | NcclPeer] = {}
        self._out: dict[int, Side] = {}
        self._in: dict[int, Side] = {}
        self._runs = 0
        self._sending: list[tuple[object, torch.Tensor, CommGroup]] = []
        self._spans: dict[int, tuple[float, float]] = {}
        self._taken: dict[int, float] = {}  # per comm group, its receives' takes this run

    def connect(self, *, linked: Transfers | None = None) -> None:
        """Link this stage with its same-host peers (collective over the pipeline process
        group), or use the links of `linked` (connected, same stage, runs never interleaved:
        the forward-only program's transfers share the training program's), and number the
        messages of every stream."""
        if linked is not None:
            self._links, self.shm_peers = linked._links, linked.shm_peers
            self._io = {peer: linked._io[peer] for peer in self._peers}
        elif self._links_io is not None:
            io = self._links_io
            self._io = {peer: NcclPeer(io, peer, self.device) for peer in self._peers}
        else:
            try:
                self._links = ShmLinks.connect(
                    self.pp_group,
                    self._peers,
                    timeout=self.timeout.total_seconds(),
                    enabled=self._shared_memory,
                )
            except (RuntimeError, OSError) as exc:
                raise RankFailure(
                    f"rank {self.rank} (stage {self.stage}) could not link with its peers on "
                    f"this machine: {first_line(exc)}"
                ) from exc
            self.shm_peers = self._links.peers
            for peer in self._peers:
                shm = ShmPeer(self._links, peer) if peer in self.shm_peers else None
                group = self.pp_group if self._pairs is None else self._pairs
                self._io[peer] = shm or GlooPeer(group, peer, self.device)
        shm = self.shm_peers
        self._to_post = [[t for t in ts if t[1] not in shm] for ts in self.eager.post_before]
        kinds = {
            peer: NCCL if self.p2p == "nccl" else SHM if peer in shm else GLOO
            for peer in self._peers
        }
        layout = Layout.of(self.program.schedule)
        sends = send_streams(self.program, layout, self.stage, kinds)
        receives = receive_streams(self.program, layout, self.stage, kinds)
        rule = "basis" if self.p2p != "nccl" else "none" if self.dynamic_shapes else "certain"
        self._out = {peer: Side(s, rule=rule) for peer, s in sends.items()}
        self._in = {peer: Side(s, rule=rule) for peer, s in receives.items()}

    def describe(self) -> str:
        """How this stage's tensors travel; see `Engine.point_to_point`."""
        if not self._peers:
            return "none"
        if self.p2p == "nccl":
            return "nccl" if dist.get_backend(self.pp_group) == "nccl" else "nccl (emulated)"
        if self.shm_peers == self._peers:
            return "shared memory"
        if self._pairs is not None:
            return "broadcast"
        return "shared memory + gloo" if self.shm_peers else "gloo"

    def reason_left(self) -> str | None:
        """Why a peer linked by shared memory failed, if it said so before it closed."""
        return self._links.reason_left() if self._links is not None else None

    def abort(self, reason: str) -> None:
        """This stage failed mid-run: tell the peers linked by shared memory why (they raise
        it at once), and close the links; let the messages it has begun sending over gloo
        finish, for at most `FLUSH_S` seconds ([Note: a message cut short]); the others learn
        it when this process ends."""
        if self._links is not None:
            self._links.abort(reason)
        sending, self._sending = self._sending, []
        deadline = time.monotonic() + min(FLUSH_S, self.timeout.total_seconds())
        for work, tensor, _unit in sending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if tensor.is_cuda:  # NCCL's: the host never waits on it ([Note: failures])
                continue
            with contextlib.suppress(RuntimeError):  # a peer gone, or a receive never posted
                work.wait(timedelta(seconds=left))

    # -- one run --------------------------------------------------------------------------------

    def begin(self, signatures: Mapping[int, Hashable] | None = None) -> None:
        """A run starts; `signatures[i]`: the spec and meta of microbatch i's inputs, which
        the NCCL path keys what it knows of a message by ([Note: certain shapes])."""
        for side in (*self._out.values(), *self._in.values()):
            side.begin(signatures)

    def before(self, index: int) -> None:
        """Post the receives due before unit `index`, then wait the ones it consumes."""
        eager = self.eager
        clock = time.perf_counter
        for op, peer, _, group in self._to_post[index]:
            side = self._in[peer]
            number = side.number(op, self._runs)
            try:
                self._io[peer].post(number, side.known(number))  # type: ignore[union-attr]
            except RuntimeError as exc:
                raise self._failure(group, exc) from exc
        for op, peer, _, group in eager.wait_before[index]:
            io = self._io[peer]
            start, waited = clock(), io.waited
            self.runtime.incoming(op, self._take(op, peer, group))
            end = clock()
            self._span(group, start, end)
            # the stage's own time in it: [Note: a receive's take] in `schedcc.costs`
            taken = max(end - start - (io.waited - waited), 0.0)
            self._taken[group] = self._taken.get(group, 0.0) + taken

    def after(self, index: int) -> None:
        """Post the sends whose tensors unit `index` computed."""
        for send in self.eager.sends_after[index]:
            self._send(send)

    def finish(self, times: list[tuple[float, float]], own: list[float], clock0: float) -> None:
        """End a run: wait the sends still out; each comm group's `times` entry becomes the
        span of its waits (seconds since `clock0`), and its `own` entry the seconds its
        receives took of it once their messages had come ([Note: a receive's take])."""
        for index, (start, end) in self._spans.items():
            times[index] = (start - clock0, end - clock0)
        for index, seconds in self._taken.items():
            own[index] = seconds
        self._spans.clear()
        self._taken.clear()
        sending, self._sending = self._sending, []
        for work, _tensor, unit in sending:
            try:
                work.wait(self.timeout)
            except RuntimeError as exc:
                raise RankFailure(self._message(unit, exc)) from exc
        for side in (*self._out.values(), *self._in.values()):
            side.finish(self._runs)
        self._runs += 1

    # -- helpers --------------------------------------------------------------------------------

    def _take(self, op: Instruction, peer: int, group: int) -> Message:
        """The message `op` receives from `peer`, processing the stream in order up to it."""
        side, io = self._in[peer], self._io[peer]
        number = side.number(op, self._runs)
        while side.processed <= number:
            n = side.processed
            try:
                if type(io) is ShmPeer:
                    message = io.process(n, side.known(n))
                else:
                    message = io.process(n, side.known(n), self.timeout)
            except ValueError as exc:
                raise self._disagree(side.stream.ops[n % len(side.stream.ops)], peer, exc) from exc
            except (RuntimeError, OSError) as exc:
                raise self._failure(group, exc) from exc
            side.record(n, message)
            side.ready[n] = message
            side.processed += 1
        return side.ready.pop(number)

    def _send(self, send: Transfer) -> None:
        op, peer, _, group = send
        start = time.perf_counter()
        message = self.runtime.outgoing(op)
        side = self._out[peer]
        number = side.number(op, self._runs)
        known = side.known(number)
        side.record(number, message)
        io = self._io[peer]
        try:
            if type(io) is ShmPeer:
                io.send(number, message, known)  # copied: done
            else:
                for work, tensor in io.send(number, message, known):
                    self._sending.append((work, tensor, self.units[group]))  # see [Note: sends]
        except ValueError as exc:
            raise self._disagree(op, peer, exc) from exc
        except (RuntimeError, OSError) as exc:
            raise self._failure(group, exc) from exc
        if not self.units[group].recvs:  # a group with receives spans their waits
            self._span(group, start, time.perf_counter())

    def _span(self, group: int, start: float, end: float) -> None:
        """A comm group's measured time: from its first wait (or send) to its last one's end."""
        spans = self._spans
        if group in spans:
            first, last = spans[group]
            spans[group] = (min(first, start), max(last, end))
        else:
            spans[group] = (start, end)

    def _disagree(self, op: Instruction, peer: int, exc: BaseException) -> RankFailure:
        return RankFailure(
            f"rank {self.rank} (stage {self.stage}) failed at {op}: the message from rank "
            f"{self.global_peer[peer]} (stage {peer}) disagrees with what this stage expects: "
            f"{first_line(exc)}"
        )

    def _failure(self, group: int, exc: BaseException) -> RankFailure:
        return RankFailure(self._message(self.units[group], exc))  # type: ignore[arg-type]

    def _message(self, unit: CommGroup, exc: BaseException) -> str:
        ops = " ".join(str(op) for op, *_ in unit.items)
        peers = ", ".join(f"rank {self.global_peer[s]} (stage {s})" for s in unit.peers)
        return (
            f"rank {self.rank} (stage {self.stage}) failed waiting at comm group [{ops}] on "
            f"{peers}: {first_line(exc)}"
        )


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, without gloo's source location and generic
    advice (`[.../pair.cc:537] Read error ...: Connection reset by peer. This is typically ...`).
    """
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    text = re.sub(r"^\[[^\]\s]+:\d+\] ", "", text.splitlines()[0])
    return text.split(". This is typically", 1)[0]
