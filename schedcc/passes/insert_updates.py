"""insert_updates: data-parallel gradient reduction, the optimizer step and ZeRO-1's gather.

Per stage and batch: `ReduceGrads(c)` right after the last weight-gradient compute of chunk c
(and the comm group that follows it, so the pipeline's own send is not delayed), letting the
reduction of early chunks overlap the drain; `OptimizerStep()` once every chunk is reduced; under
ZeRO-1 and ZeRO-2 a `GatherParams(c)` per chunk after the step. `zero=2` and `zero=3`
reduce-scatter after every weight-gradient compute instead; ZeRO-3 gathers with the `Unshard`
that `insert_sharding` places before the chunk's next compute. Reductions are only inserted
where there is something to reduce: `data_parallel > 1` or ZeRO.

With tied segments (`program.tied`), every stage holding a segment of group g gets a
`ReduceTied(g)` per batch after its last weight gradient of those chunks and before their
`ReduceGrads` (which then follows it, once per batch even under ZeRO-2) and the step. The
members are placed right after the earliest consistent cut of the rendezvous model that holds all
their last weight gradients ([Note: tied collectives] in `schedcc.semantics.collectives`), so
the collective closes no cycle; a stage whose groups all sit on it alone gets it before its step.
Under a weight delay the members may meet only after one runs work of the next batch; its step
then follows the collective, and comm that insert_comm placed for speed is moved where work that
needs the step would come first (`_reorder_for_ties`); what cannot be is refused with a
`ScheduleConfigError`, never compiled into a deadlock.
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import chain

import attrs

from schedcc.errors import ScheduleConfigError
from schedcc.ir import (
    UPDATE,
    WEIGHT_GRADIENT,
    Comm,
    Compute,
    GatherParams,
    Instruction,
    OptimizerStep,
    ReduceGrads,
    ReduceTied,
)
from schedcc.program import Program
from schedcc.semantics import Layout, Units, match_comm, walk
from schedcc.semantics.collectives import (
    earliest_cut,
    step_blocker,
    tie_chunks,
    tie_members,
    with_dependents,
)

__all__ = ["insert_updates"]

_UPDATE = frozenset(UPDATE)


def insert_updates(program: Program) -> Program:
    """The program with its update instructions; unchanged if it already holds any, or if it
    is forward-only (nothing to update)."""
    owned = any(not _UPDATE.isdisjoint(map(type, ops)) for ops in program.stages)
    if program.forward_only or owned:
        return program
    reduce = program.data_parallel > 1 or program.zero > 0
    schedule = program.schedule
    m, v = schedule.num_microbatches, schedule.num_chunks
    ties = {}
    if program.tied:
        program, ties = _reorder_for_ties(program)
    stages = tuple(
        _insert(ops, m, v, reduce, program.zero, ties.get(s), _Late(program, s))
        for s, ops in enumerate(program.stages)
    )
    return program.evolve(stages=stages)


@attrs.frozen
class _Late:
    """What a stage's step may be delayed past: the program and the stage, for the refusal."""

    program: Program
    stage: int

    def step_after(self, ops, step_at: int, at: int, batch: int) -> int:
        """Where batch `batch`'s step goes when the tie collective must come after position
        `at` (past `step_at`, the last weight gradient's comm group): right after it, if no
        compute in between needs the step (`step_blocker`); else ScheduleConfigError."""
        schedule = self.program.schedule
        m, delay = schedule.num_microbatches, schedule.weight_delay
        blocker = step_blocker(ops, step_at + 1, at + 1, batch, m, delay)
        if blocker is not None:
            raise ScheduleConfigError(
                f"tied={list(map(list, self.program.tied))}: in {schedule!r}, stage "
                f"{self.stage} must run {ops[blocker]} (position {blocker}), which needs its "
                f"step of batch {batch}, before every stage of the tie can sum batch {batch}'s "
                "gradients, so no ReduceTied fits before that step; reorder the computes so "
                "each tied stage's last weight gradient of a batch precedes the next batch's "
                "work that waits on the other stages, or compile without tied"
            )
        return at


def _insert(ops, num_microbatches: int, num_chunks: int, reduce: bool, zero: int, ties, late):
    # After which position does each update go? Keyed by position, in insertion order.
    after: dict[int, list[Instruction]] = {}
    last_grad: dict[tuple[int, int], int] = {}  # (batch, chunk) -> position of last weight-grad
    groups, tied_chunks, tie_at = ties or ((), frozenset(), {})
    for pos, op in enumerate(ops):
        if isinstance(op, WEIGHT_GRADIENT):
            batch = op.microbatch // num_microbatches
            last_grad[batch, op.chunk] = pos
            if zero >= 2 and op.chunk not in tied_chunks:
                after.setdefault(_past_comm(ops, pos), []).append(ReduceGrads(op.chunk))
    batches = sorted({batch for batch, _ in last_grad})
    for batch in batches:
        ends = {c: last_grad[batch, c] for c in range(num_chunks) if (batch, c) in last_grad}
        if reduce and zero < 2:
            for c, pos in sorted(ends.items(), key=lambda item: item[1]):
                if c not in tied_chunks:
                    after.setdefault(_past_comm(ops, pos), []).append(ReduceGrads(c))
        step_at = _past_comm(ops, max(ends.values()))
        if groups:
            at = tie_at.get(batch, step_at)
            if at > step_at:  # a member must pass work of a later batch first: the step waits
                step_at = late.step_after(ops, step_at, at, batch)
            after.setdefault(at, []).extend(ReduceTied(g) for g in groups)
            if reduce:
                after[at].extend(ReduceGrads(c) for c in sorted(tied_chunks) if c in ends)
        after.setdefault(step_at, []).append(OptimizerStep())
        if 1 <= zero <= 2:
            after[step_at].extend(GatherParams(c) for c in sorted(ends))
    out: list[Instruction] = []
    done = 0
    for pos in sorted(after):  # copy the program in slices, the updates between them
        out.extend(ops[done : pos + 1])
        out.extend(after[pos])
        done = pos + 1
    out.extend(ops[done:])
    return tuple(out)


def _reorder_for_ties(program: Program) -> tuple[Program, dict[int, tuple]]:
    """The program reordered so that no tied stage must run work of a later batch that needs
    its step before the members can meet for batch b, and `_tie_points` of the result.

    Under a weight delay a member may have to run work of batch b + 1 before the others can
    reach their collective of batch b (an input gradient they wait for, say), so its step of
    batch b waits there too (`_Late`). When work in that stretch needs the step
    (`step_blocker`: a weight gradient of a later batch, a compute on the new weights), the
    comm that insert_comm placed for speed is moved, one move a round: the blocking work goes
    after the stretch with what depends on it (`_later_work`); a stage's comm of a later batch
    put before its last weight gradient of batch b, that nothing there needs, goes after it
    (`_early_comm`: the receives, then the sends); a send of batch b put after a weight
    gradient of a later batch goes ahead of it (`_move_late_sends`). The last two apply on any
    stage, since one outside the tie may relay what a member waits for. A round takes the first
    move whose program does not deadlock, then the cut is taken again; it stops when nothing is
    blocked or nothing moves, and what is still blocked is refused by `_Late`.
    """
    schedule = program.schedule
    m, delay = schedule.num_microbatches, schedule.weight_delay
    tensors = program.tensors
    ties = _tie_points(program)
    for _ in range(program.num_instructions):  # each round moves one op or stretch
        if not _blocked(program.stages, ties, m, delay):
            break
        moves = chain(
            _move_later_work(program.stages, ties, m, delay, tensors),
            _move_early_comm(program, tensors),
            _move_late_sends(program.stages, m, tensors),
        )
        for stages in moves:
            candidate = program.evolve(stages=stages)
            model = candidate.rendezvous_model
            if not model.problems and not walk(model.units, model.partner, links=model.links).stuck:
                program, ties = candidate, _tie_points(candidate)
                break
        else:
            break
    return program, ties


def _regions(ops, tie_at: dict[int, int], m: int):
    """`(batch, lo, hi)`: between the comm after a stage's last weight gradient of each batch
    and its tie collective's place, `ops[lo:hi]` (empty where the collective comes first)."""
    last: dict[int, int] = {}
    for pos, op in enumerate(ops):
        if isinstance(op, WEIGHT_GRADIENT):
            last[op.microbatch // m] = pos
    for batch, at in sorted(tie_at.items()):
        lo = _past_comm(ops, last[batch]) + 1
        yield batch, lo, max(lo, at + 1)


def _blocked(stages, ties, m: int, delay: int) -> bool:
    """Whether some tied stage's collective comes after work that needs its step."""
    return any(
        step_blocker(stages[s], lo, hi, batch, m, delay) is not None
        for s, (_, _, tie_at) in ties.items()
        for batch, lo, hi in _regions(stages[s], tie_at, m)
    )


def _move_later_work(stages, ties, m: int, delay: int, tensors):
    """Stages with one stretch's `_later_work` moved after the rest of it."""
    for s, (_, _, tie_at) in ties.items():
        ops = stages[s]
        for batch, lo, hi in _regions(ops, tie_at, m):
            later = _later_work(ops, lo, hi, batch, m, delay, tensors, s)
            keep = [op for pos, op in enumerate(ops[lo:hi], lo) if pos not in later]
            moved = (*ops[:lo], *keep, *(ops[pos] for pos in later), *ops[hi:])
            if moved != ops:
                yield (*stages[:s], moved, *stages[s + 1 :])


def _move_early_comm(program: Program, tensors):
    """Stages with one stage's `_early_comm` of one batch moved right after its last weight
    gradient of the batch (and that comm); on any stage, since one outside the tie may relay
    what a member waits for."""
    m, stages = program.schedule.num_microbatches, program.stages
    chunks = frozenset(range(program.schedule.num_chunks))
    for s, ops in enumerate(stages):
        for batch, seed in sorted(_seeds(ops, chunks, m).items()):
            for sends in (False, True):
                early = _early_comm(ops, seed + 1, batch, m, tensors, s, sends)
                if early:
                    keep = [op for pos, op in enumerate(ops[: seed + 1]) if pos not in early]
                    moved = (*keep, *(ops[pos] for pos in early), *ops[seed + 1 :])
                    yield (*stages[:s], moved, *stages[s + 1 :])


def _move_late_sends(stages, m: int, tensors):
    """Stages with one send of batch b that insert_comm put after a weight gradient of a later
    batch moved ahead of it, after the compute that makes its tensor and its channel's comm
    before it."""
    for s, ops in enumerate(stages):
        made = {tensors.makes(s, op): pos for pos, op in enumerate(ops) if isinstance(op, Compute)}
        seen: dict[tuple[int, int], int] = {}  # channel -> position of its last comm op
        for pos, op in enumerate(ops):
            route = tensors.route(s, op) if isinstance(op, Comm) else None
            if route is None:
                continue
            channel = (route.src, route.dst)
            floor = max(made.get(route.tensor, -1), seen.get(channel, -1))
            seen[channel] = pos
            if not op.is_send:
                continue
            batch = op.microbatch // m
            for at in range(floor + 1, pos):
                other = ops[at]
                if isinstance(other, WEIGHT_GRADIENT) and other.microbatch // m > batch:
                    moved = (*ops[:at], op, *ops[at:pos], *ops[pos + 1 :])
                    yield (*stages[:s], moved, *stages[s + 1 :])
                    break


def _early_comm(ops, hi: int, batch: int, m: int, tensors, s: int, sends: bool) -> list[int]:
    """The comm of batches after `batch` in `ops[:hi]` that no compute there needs (the
    receives of tensors used later, and with `sends` the sends) and that ends its channel
    there (moved after the rest, it overtakes none of its channel), in order."""
    needed = {key for op in ops[:hi] if isinstance(op, Compute) for key in tensors.needs(s, op)}
    early: list[int] = []
    stays: set[tuple[int, int]] = set()  # channels with a later op that stays
    for pos in reversed(range(hi)):
        op = ops[pos]
        route = tensors.route(s, op) if isinstance(op, Comm) else None
        if route is None:
            continue
        channel = (route.src, route.dst)
        free = op.microbatch // m > batch and (sends if op.is_send else route.tensor not in needed)
        if free and channel not in stays:
            early.append(pos)
        else:
            stays.add(channel)
    return early[::-1]


def _later_work(ops, lo: int, hi: int, batch: int, m: int, delay: int, tensors, s: int):
    """The positions in `ops[lo:hi]` that must follow the step of batch `batch`, in order: the
    `step_blocker`s and what depends on them on stage `s` (`with_dependents`)."""
    blockers, pos = set(), lo
    while (pos := step_blocker(ops, pos, hi, batch, m, delay)) is not None:
        blockers.add(pos)
        pos += 1
    return with_dependents(ops, lo, hi, blockers, tensors, s) if blockers else []


def _tie_points(program: Program) -> dict[int, tuple]:
    """Per stage holding tied segments: `(groups, tied chunks, {batch: position})`, each
    `ReduceTied` of a batch going right after that position (absent: before the step).

    A collective among several stages starts from its members' seeds: right after the last
    tied weight gradient of the batch and the comm ops of that batch or earlier that follow it
    (a comm group that also carries the next batch's tensors is split there). The seeds sit in a
    provisional program with a marker after each; the earliest consistent cut holding them all
    is then where every member goes ([Note: tied collectives]).
    """
    layout = Layout.of(program.schedule)
    m = program.schedule.num_microbatches
    members = tie_members(program.tied, layout)
    shared = {s for group in members if len(group) > 1 for s in group}
    out: dict[int, tuple] = {}
    seeds: dict[int, dict[int, int]] = {}  # stage -> {batch: seed position}
    for s, ops in enumerate(program.stages):
        chunks_of = tie_chunks(program.tied, layout, s)
        if not chunks_of:
            continue
        chunks = frozenset(c for group in chunks_of.values() for c in group)
        out[s] = (tuple(sorted(chunks_of)), chunks, {})
        if s in shared:
            seeds[s] = _seeds(ops, chunks, m)
    if not seeds:
        return out
    # markers: after each seed, and between comm ops of different batches (where a member may
    # split a comm group); `mark[s]`: the positions after which a marker goes, ascending
    marked, mark, markers = [list(ops) for ops in program.stages], {}, {}
    for s, by_batch in seeds.items():
        ops = program.stages[s]
        splits = {
            pos
            for pos in range(len(ops) - 1)
            if isinstance(ops[pos], Comm)
            and isinstance(ops[pos + 1], Comm)
            and ops[pos].microbatch // m < ops[pos + 1].microbatch // m
        }
        mark[s] = sorted(splits | set(by_batch.values()))
        markers[s] = [pos + 1 + n for n, pos in enumerate(mark[s])]  # where they land
        for pos in reversed(mark[s]):
            marked[s].insert(pos + 1, OptimizerStep())
    units = Units.of(marked)
    partner, _ = match_comm(marked, program.tensors)
    prefix = [-1] * program.num_stages
    for batch in sorted({b for by_batch in seeds.values() for b in by_batch}):
        at = {
            s: markers[s][mark[s].index(by_batch[batch])]
            for s, by_batch in seeds.items()
            if batch in by_batch
        }
        start = {s: units.unit_at[s][pos - 1] for s, pos in at.items()}
        earliest_cut(units.bounds, units.unit_at, partner, prefix, start)
        for s, pos in at.items():
            end = max(pos - 1, units.bounds[s][prefix[s]][1] - 1)
            out[s][2][batch] = end - bisect_right(markers[s], end)
    return out


def _seeds(ops, chunks: frozenset, num_microbatches: int) -> dict[int, int]:
    """`{batch: position}`: the last weight gradient of `chunks` in each batch, with the comm
    ops right after it that move tensors of that batch or an earlier one."""
    last: dict[int, int] = {}
    for pos, op in enumerate(ops):
        if isinstance(op, WEIGHT_GRADIENT) and op.chunk in chunks:
            last[op.microbatch // num_microbatches] = pos
    for batch, pos in last.items():
        while (
            pos + 1 < len(ops)
            and isinstance(ops[pos + 1], Comm)
            and ops[pos + 1].microbatch // num_microbatches <= batch
        ):
            pos += 1
        last[batch] = pos
    return last


def _past_comm(ops, pos: int) -> int:
    """The last position of the comm group right after `pos` (or `pos` if none follows)."""
    while pos + 1 < len(ops) and isinstance(ops[pos + 1], Comm):
        pos += 1
    return pos
