"""Shared, linear-time facts about a program: layout, comm matching and the step walk.

The compiler passes, the validator and the simulator all read a program through these helpers,
so the three agree by construction on what a program means.

[Note: the step model] (DESIGN.md, "Execution semantics") Each stage's program is cut into steps:
one per compute or update instruction, one per maximal run of consecutive comm instructions (a
comm group, posted together). A compute step is one event; a group has a *posted* event (when the
stage reaches it) and a *done* event (once every op's partner group has been posted: rendezvous).
`walk` visits the events in a topological order, giving each a time; a stage that can never
finish its program is waiting at a group whose partner is never posted: a deadlock, and following
"waits for" from stage to stage finds the cycle.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator, Sequence

import attrs

from schedcc.ir import Comm, Instruction, RecvActivation, RecvGrad, SendActivation, SendGrad
from schedcc.program import Program
from schedcc.schedule import Schedule

__all__ = ["Layout", "Steps", "Walk", "comm_route", "match_comm", "paused_gc", "walk"]


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for a compile or a validation.

    The passes allocate one small, acyclic object per instruction and hold them all; the cyclic
    collector would rescan the growing heap again and again (measured: up to 2x of compile time
    at 10^5 instructions). Reference counting still frees everything; the collector's state is
    restored on exit.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@attrs.frozen(slots=True)
class Layout:
    """Where each segment lives: `segment[s][c]`, `stage_of[k]`, `chunk_of[k]`."""

    segment: tuple[tuple[int, ...], ...]
    stage_of: tuple[int, ...]
    chunk_of: tuple[int, ...]

    @classmethod
    def of(cls, schedule: Schedule) -> Layout:
        table = schedule.segment_table()
        num_segments = schedule.num_segments
        stage_of = [0] * num_segments
        chunk_of = [0] * num_segments
        for s, row in enumerate(table):
            for c, k in enumerate(row):
                stage_of[k], chunk_of[k] = s, c
        return cls(tuple(map(tuple, table)), tuple(stage_of), tuple(chunk_of))

    @property
    def last(self) -> int:
        return len(self.stage_of) - 1


def comm_route(layout: Layout, stage: int, op: Comm) -> tuple[int, int, tuple] | None:
    """`(src, dst, payload)` for a comm op on `stage`, or None if it has nothing to move.

    The payload `("A", i, k)` is microbatch i's activation out of segment k (into k + 1), and
    `("G", i, k)` its gradient out of segment k (into k - 1); a send and a receive match when
    their routes are equal.
    """
    if op.chunk >= len(layout.segment[stage]):
        return None
    k = layout.segment[stage][op.chunk]
    stage_of, last = layout.stage_of, layout.last
    cls = type(op)
    if cls is SendActivation:
        if k < last and stage_of[k + 1] != stage:
            return stage, stage_of[k + 1], ("A", op.microbatch, k)
    elif cls is RecvActivation:
        if k > 0 and stage_of[k - 1] != stage:
            return stage_of[k - 1], stage, ("A", op.microbatch, k - 1)
    elif cls is SendGrad:
        if k > 0 and stage_of[k - 1] != stage:
            return stage, stage_of[k - 1], ("G", op.microbatch, k)
    elif cls is RecvGrad and k < last and stage_of[k + 1] != stage:
        return stage_of[k + 1], stage, ("G", op.microbatch, k + 1)
    return None


@attrs.frozen(slots=True)
class CommProblem:
    """One reason the sends and receives do not pair up; `kind` names it."""

    kind: str  # "nowhere", "unmatched", "order", "duplicate"
    stage: int
    position: int
    peer: int | None = None
    peer_position: int | None = None


def match_comm(program: Program, layout: Layout):
    """Pair every send with its receive, FIFO per (src, dst) channel.

    Returns `(partner, problems)`: `partner[s][pos]` is the `(stage, position)` of the matched
    op (None for non-comm or unmatched ops), and a list of `CommProblem`.
    """
    partner: list[list[tuple[int, int] | None]] = [[None] * len(ops) for ops in program.stages]
    # A channel (src, dst) holds its ops in program order as (payload, position); a payload is
    # an int that names the tensor (see `_route_table`).
    sends: dict[tuple[int, int], list[tuple[int, int]]] = {}
    recvs: dict[tuple[int, int], list[tuple[int, int]]] = {}
    problems: list[CommProblem] = []
    span = 2 * len(layout.stage_of)
    for s, ops in enumerate(program.stages):
        routes = _route_table(layout, s)
        for pos, op in enumerate(ops):
            if op.group != "comm":
                continue
            route = routes.get((type(op), op.chunk))  # type: ignore[attr-defined]
            if route is None:
                problems.append(CommProblem("nowhere", s, pos))
                continue
            channel, tensor = route
            side = sends if op.is_send else recvs  # type: ignore[attr-defined]
            queue = side.get(channel)
            if queue is None:
                side[channel] = queue = []
            queue.append((op.microbatch * span + tensor, pos))  # type: ignore[attr-defined]
    seen: set[int] = set()
    for channel in sorted(sends.keys() | recvs.keys()):
        src, dst = channel
        out, into = sends.get(channel, []), recvs.get(channel, [])
        for (payload, pos), (want, recv_pos) in zip(out, into):
            if payload != want or payload in seen:
                problems.append(_mismatch(channel, out, into, seen, payload, pos, want, recv_pos))
                break
            seen.add(payload)
            partner[src][pos] = (dst, recv_pos)
            partner[dst][recv_pos] = (src, pos)
        else:
            for _, pos in out[len(into) :]:
                problems.append(CommProblem("unmatched", src, pos, dst))
            for _, pos in into[len(out) :]:
                problems.append(CommProblem("unmatched", dst, pos, src))
    return partner, problems


def _route_table(layout: Layout, stage: int) -> dict[tuple[type, int], tuple[tuple[int, int], int]]:
    """`(op class, chunk) -> ((src, dst), tensor)` for every comm op that can run on `stage`.

    `tensor` is `2 * k` for the activation out of segment k and `2 * k + 1` for the gradient out
    of segment k; with microbatch i the payload is `i * 2 * num_segments + tensor` (what
    `comm_route` says, as one int).
    """
    table = {}
    for cls in (SendActivation, RecvActivation, SendGrad, RecvGrad):
        for chunk in range(len(layout.segment[stage])):
            route = comm_route(layout, stage, cls(0, chunk))
            if route is not None:
                src, dst, (kind, _, k) = route
                table[cls, chunk] = ((src, dst), 2 * k + (kind == "G"))
    return table


def _mismatch(channel, out, into, seen, payload, pos: int, want, recv_pos: int) -> CommProblem:
    """Why the FIFO pairing of a channel fails at a send and a receive: the most specific cause.

    A repeated tensor is a duplicate; a tensor the other side never mentions is unmatched; else
    both sides move the same tensors in different orders.
    """
    src, dst = channel
    if payload in seen:
        return CommProblem("duplicate", src, pos, dst, recv_pos)
    if want in seen:
        return CommProblem("duplicate", dst, recv_pos, src, pos)
    if payload not in {p for p, _ in into}:
        return CommProblem("unmatched", src, pos, dst)
    if want not in {p for p, _ in out}:
        return CommProblem("unmatched", dst, recv_pos, src)
    return CommProblem("order", src, pos, dst, recv_pos)


@attrs.frozen(slots=True)
class Steps:
    """Each stage's program cut into steps (see the note at the top of this module).

    `bounds[s][j]` is the `[start, end)` position range of step j on stage s; `is_group[s][j]`
    tells a comm group from a single compute or update instruction.
    """

    bounds: tuple[tuple[tuple[int, int], ...], ...]
    is_group: tuple[tuple[bool, ...], ...]
    step_at: tuple[tuple[int, ...], ...]  # step_at[s][pos]: the step that holds position pos

    @classmethod
    def of(cls, stages: Sequence[Sequence[Instruction]]) -> Steps:
        bounds, is_group, step_at = [], [], []
        for ops in stages:
            starts: list[int] = []
            groups: list[bool] = []
            at: list[int] = []
            previous = False  # was the op before a comm op?
            for pos, op in enumerate(ops):
                comm = op.group == "comm"
                if not (comm and previous):  # a new step starts here
                    starts.append(pos)
                    groups.append(comm)
                at.append(len(starts) - 1)
                previous = comm
            bounds.append(tuple(zip(starts, [*starts[1:], len(ops)])))
            is_group.append(tuple(groups))
            step_at.append(tuple(at))
        return cls(tuple(bounds), tuple(is_group), tuple(step_at))


@attrs.frozen(slots=True)
class Walk:
    """The result of `walk`: per stage and step, start and end times (posted and done, for a group).

    `stuck` maps each stage that cannot finish to `(step, peer stage, peer step)`: the group it
    waits at and the partner group that is never posted. Empty when the program completes.
    """

    start: tuple[tuple[float, ...], ...]
    end: tuple[tuple[float, ...], ...]
    stuck: dict[int, tuple[int, int, int]]

    def wait_for_cycle(self) -> list[int]:
        """The stages of one wait-for cycle (stage a waits for b, ..., which waits for a)."""
        if not self.stuck:
            return []
        stage = min(self.stuck)
        order: list[int] = []
        while stage not in order:
            order.append(stage)
            stage = self.stuck[stage][1]
        return order[order.index(stage) :]


def walk(
    steps: Steps,
    partner: Sequence[Sequence[tuple[int, int] | None]],
    duration: Callable[[int, int], float] | None = None,
) -> Walk:
    """Visit every step in a topological order of the step model, timing it.

    `duration(stage, step)` gives a compute's run time or a group's comm cost (0 if omitted).
    Linear in the number of instructions.
    """
    num_stages = len(steps.bounds)
    start = [[0.0] * len(b) for b in steps.bounds]
    end = [[0.0] * len(b) for b in steps.bounds]
    posted = [[False] * len(b) for b in steps.bounds]
    clock = [0.0] * num_stages
    cursor = [0] * num_stages
    waiting: dict[tuple[int, int], list[int]] = {}
    blocked: dict[int, tuple[int, int, int]] = {}
    pending = list(range(num_stages))
    queued = [True] * num_stages
    step_at = steps.step_at

    while pending:
        s = pending.pop()
        queued[s] = False
        blocked.pop(s, None)
        bounds, groups, partner_s = steps.bounds[s], steps.is_group[s], partner[s]
        start_s, end_s, posted_s = start[s], end[s], posted[s]
        now, j, n = clock[s], cursor[s], len(bounds)
        while j < n:
            if not groups[j]:
                start_s[j] = now
                if duration is not None:
                    now += duration(s, j)
                end_s[j] = now
                j += 1
                continue
            if not posted_s[j]:
                posted_s[j] = True
                start_s[j] = now
                for waiter in waiting.pop((s, j), ()):
                    if not queued[waiter]:
                        queued[waiter] = True
                        pending.append(waiter)
            ready = start_s[j]
            missing = None
            lo, hi = bounds[j]
            for pos in range(lo, hi):
                peer = partner_s[pos]
                if peer is None:  # unmatched: the validator reports it; never completes
                    missing = (s, j)
                    break
                ps = peer[0]
                pstep = step_at[ps][peer[1]]
                if not posted[ps][pstep]:
                    missing = (ps, pstep)
                    break
                if start[ps][pstep] > ready:
                    ready = start[ps][pstep]
            if missing is not None:
                waiting.setdefault(missing, []).append(s)
                blocked[s] = (j, *missing)
                break
            now = ready + duration(s, j) if duration is not None else ready
            end_s[j] = now
            j += 1
        clock[s], cursor[s] = now, j
    return Walk(
        tuple(map(tuple, start)),
        tuple(map(tuple, end)),
        {s: blocked[s] for s in sorted(blocked)},
    )
