"""The distributed `Engine`'s point-to-point: where each send and receive is posted and waited.

Three paths, chosen per peer:

- NCCL: each comm group is one `batch_isend_irecv`, posted at its place in the program and waited
  whole (the execution semantics the validator proves deadlock-free);
- gloo: each op is posted and waited where it helps most (see [Note: eager point-to-point] in
  `backends.distributed.eager`: relaxations that cannot add a hang);
- gloo between stages on the same machine: the same places, through shared memory rather than
  gloo (see [Note: same-host point-to-point] in `backends.distributed.shm`).

[Note: sends complete lazily] Where the backend returns a handle per op (gloo), sends are waited
only at the end of the run (their tensors are kept alive until then), as
torch.distributed.pipelining does. This only relaxes the rendezvous model the validator proves
deadlock-free (a send never holds its stage back), so it cannot introduce a hang; it keeps a stage
from idling while its peer has not yet reached the matching receive. Under NCCL a batch is one
coalesced handle, waited whole. NCCL orders its operations on a stream, where an early receive could
hold back a later send, so there each comm group stays one `batch_isend_irecv`, posted at its
place.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from schedcc.backends.distributed.eager import EagerPlan, Transfer
from schedcc.backends.distributed.groups import CommGroup
from schedcc.backends.distributed.shapes import Shapes
from schedcc.backends.distributed.shm import ShmLinks
from schedcc.backends.runtime.stage import StageRuntime
from schedcc.errors import RankFailure
from schedcc.ir import Instruction

__all__ = ["Transfers", "first_line"]


class Transfers:
    """Moves one stage's tensors to and from its peers, step by step of its program.

    The engine calls `before(i)`, runs step `i` (calling `exchange(step)` for a comm group), then
    `after(i)`; `finish(times)` ends a run. `shapes` must hold every transferred tensor's shape
    and dtype (the engine's shape pass fills it) before the first run, and `connect()` must have
    been called on every rank of the pipeline process group `pp_group`.
    """

    def __init__(
        self,
        steps: Sequence[Instruction | CommGroup],
        runtime: StageRuntime,
        *,
        pp_group,
        global_peer: Mapping[int, int],
        device: torch.device,
        timeout: timedelta,
        shared_memory: bool,
    ):
        self.steps = steps
        self.runtime = runtime
        self.pp_group = pp_group
        self.stage = dist.get_rank(pp_group)
        self.rank = dist.get_rank()
        self.global_peer = global_peer
        self.device = device
        self.timeout = timeout
        self.shapes: Shapes = {}
        self._peers = {peer for step in steps if type(step) is CommGroup for peer in step.peers}
        # see [Note: eager point-to-point]
        eager = dist.get_backend(pp_group) == "gloo"
        self.eager = EagerPlan(steps) if eager else None
        #: Per step, the receives to post over gloo first (the shared-memory ones need none).
        self._to_post = self.eager.post_before if self.eager else []
        self._shared_memory = eager and shared_memory and device.type == "cpu"  # CPU tensors
        self._links: ShmLinks | None = None
        #: The peer stages this stage exchanges with through shared memory (after `connect`).
        self.shm_peers: frozenset[int] = frozenset()
        self._recv_number, self._recvs_per_run = _number_receives(steps)
        self._runs = 0
        self._posted: dict[Instruction, tuple[torch.Tensor, object]] = {}
        self._sending: list[tuple[object, torch.Tensor, CommGroup]] = []
        self._spans: dict[int, tuple[float, float]] = {}

    def connect(self) -> None:
        """Link this stage with its same-host peers (collective over the pipeline process
        group)."""
        if self.eager is None:  # NCCL: every pair stays on batch_isend_irecv
            return
        try:
            self._links = ShmLinks.connect(
                self.pp_group,
                self._peers,
                timeout=self.timeout.total_seconds(),
                enabled=self._shared_memory,
            )
        except (RuntimeError, OSError) as exc:
            raise RankFailure(
                f"rank {self.rank} (stage {self.stage}) could not link with its peers on this "
                f"machine: {first_line(exc)}"
            ) from exc
        self.shm_peers = shm = self._links.peers
        self._to_post = [[t for t in ts if t[1] not in shm] for ts in self.eager.post_before]

    def describe(self) -> str:
        """How this stage's tensors travel; see `Engine.point_to_point`."""
        if not self._peers:
            return "none"
        if self.eager is None:
            return dist.get_backend(self.pp_group)
        if self.shm_peers == self._peers:
            return "shared memory"
        return "shared memory + gloo" if self.shm_peers else "gloo"

    # -- one run --------------------------------------------------------------------------------

    def before(self, index: int) -> None:
        """Gloo: post the receives due before step `index`, then wait the ones it consumes."""
        eager = self.eager
        if eager is None:
            return
        clock = time.perf_counter
        shm = self.shm_peers
        for op, peer, key, group in self._to_post[index]:
            shape, dtype = self.shapes[key]
            buffer = torch.empty(shape, dtype=dtype, device=self.device)
            try:
                work = self.pp_group.recv([buffer], peer, 0)
            except RuntimeError as exc:
                raise self._failure(group, exc) from exc
            self._posted[op] = (buffer, work)
        for op, peer, key, group in eager.wait_before[index]:
            start = clock()
            try:
                if peer in shm:
                    number = self._runs * self._recvs_per_run[peer] + self._recv_number[op]
                    buffer = self._links.recv(peer, number, *self.shapes[key])  # type: ignore[union-attr]
                else:
                    buffer, work = self._posted.pop(op)
                    work.wait(self.timeout)
            except (RuntimeError, OSError) as exc:
                raise self._failure(group, exc) from exc
            self.runtime.incoming(op, buffer)
            self._span(group, start, clock())

    def exchange(self, step: CommGroup) -> None:
        """NCCL: the comm group as one `batch_isend_irecv` (a coalesced batch, waited whole)."""
        if self.eager is not None:
            return  # gloo: the comm group's ops are posted by `before` and `after`
        ops, received = [], []
        for op, is_send, peer, key in step.items:
            if is_send:
                tensor = self._outgoing(op, key)
                ops.append(dist.P2POp(dist.isend, tensor, self.global_peer[peer], self.pp_group))
            else:
                shape, dtype = self.shapes[key]
                buffer = torch.empty(shape, dtype=dtype, device=self.device)
                ops.append(dist.P2POp(dist.irecv, buffer, self.global_peer[peer], self.pp_group))
                received.append((op, buffer))
        try:
            works = dist.batch_isend_irecv(ops)
            if len(works) != len(ops):  # coalesced (NCCL): one handle for the whole group
                for work in works:
                    work.wait(self.timeout)
            else:
                for work, p2p in zip(works, ops):
                    if p2p.op is dist.isend:  # see [Note: sends complete lazily]
                        self._sending.append((work, p2p.tensor, step))
                    else:
                        work.wait(self.timeout)
        except RuntimeError as exc:
            raise RankFailure(self._message(step, exc)) from exc
        for op, buffer in received:
            self.runtime.incoming(op, buffer)

    def after(self, index: int) -> None:
        """Gloo: post the sends whose tensors step `index` computed."""
        if self.eager is not None:
            for send in self.eager.sends_after[index]:
                self._send(send)

    def finish(self, times: list[tuple[float, float]], clock0: float) -> None:
        """End a run: wait the sends still out; under gloo each comm group's `times` entry
        becomes the span of its waits (seconds since `clock0`)."""
        for index, (start, end) in self._spans.items():
            times[index] = (start - clock0, end - clock0)
        self._spans.clear()
        self._posted.clear()
        sending, self._sending = self._sending, []
        for work, _tensor, step in sending:
            try:
                work.wait(self.timeout)
            except RuntimeError as exc:
                raise RankFailure(self._message(step, exc)) from exc
        self._runs += 1

    # -- helpers --------------------------------------------------------------------------------

    def _send(self, send: Transfer) -> None:
        op, peer, key, group = send
        start = time.perf_counter()
        tensor = self._outgoing(op, key)
        try:
            if peer in self.shm_peers:
                self._links.send(peer, tensor)  # type: ignore[union-attr]  # copied: done
            else:
                work = self.pp_group.send([tensor], peer, 0)
                self._sending.append((work, tensor, self.steps[group]))  # see [Note: sends ...]
        except (RuntimeError, OSError) as exc:
            raise self._failure(group, exc) from exc
        if not self.steps[group].recvs:  # a group with receives spans their waits
            self._span(group, start, time.perf_counter())

    def _span(self, group: int, start: float, end: float) -> None:
        """A comm group's measured time: from its first wait (or send) to its last one's end."""
        spans = self._spans
        if group in spans:
            first, last = spans[group]
            spans[group] = (min(first, start), max(last, end))
        else:
            spans[group] = (start, end)

    def _outgoing(self, op: Instruction, key: tuple[str, int]) -> torch.Tensor:
        tensor = self.runtime.outgoing(op)
        expected = self.shapes[key][0]
        if tensor.shape != expected:
            raise ValueError(
                f"{op} sends shape {tuple(tensor.shape)} but the first batch's was {expected}; "
                "the distributed backend learns shapes once: keep every batch the same size"
            )
        return tensor

    def _failure(self, group: int, exc: BaseException) -> RankFailure:
        return RankFailure(self._message(self.steps[group], exc))  # type: ignore[arg-type]

    def _message(self, step: CommGroup, exc: BaseException) -> str:
        ops = " ".join(str(op) for op, *_ in step.items)
        peers = ", ".join(f"rank {self.global_peer[s]} (stage {s})" for s in step.peers)
        return (
            f"rank {self.rank} (stage {self.stage}) failed waiting at comm group [{ops}] on "
            f"{peers}: {first_line(exc)}"
        )


def _number_receives(steps) -> tuple[dict[Instruction, int], dict[int, int]]:
    """Each receive's place among this stage's receives from its peer, in program order; and
    how many there are per peer in one run."""
    number: dict[Instruction, int] = {}
    count: dict[int, int] = {}
    for step in steps:
        if type(step) is CommGroup:
            for op, peer, _ in step.recvs:
                number[op] = count.get(peer, 0)
                count[peer] = number[op] + 1
    return number, count


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, without gloo's generic advice."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    text = text.splitlines()[0]
    return text.split(". This is typically", 1)[0]
