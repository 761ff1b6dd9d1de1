"""The rendezvous model: each stage's program cut into units, and one walk of their events.

[Note: the rendezvous model] (docs/design.md, "Semantics: the rendezvous model") Each stage's
program is cut into units: one per compute or update instruction, one per maximal run of consecutive
comm instructions (a comm group, posted together). A compute unit is one event; a group has a
*posted* event (when the stage reaches it) and a *done* event (once every op's partner group has
been posted: rendezvous). `walk` visits the events in a topological order, giving each a time; a
stage that can never finish its program is waiting at a group whose partner is never posted: a
deadlock, and following "waits for" from stage to stage finds the cycle.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping, Sequence
from itertools import accumulate

import attrs

from schedcc.ir import COMM, Backward, BackwardInput, BackwardWeight, Copy, Instruction, Reload

__all__ = [
    "CopyLanes", "Links", "Units", "Walk", "critical_units", "links_of", "wait_for_cycle", "walk"
]

#: `links[s][j]`: for a comm group, the flat indices of its partner groups; None otherwise.
Links = tuple[tuple[tuple[int, ...] | None, ...], ...]

_COMM = frozenset(COMM)


@attrs.frozen(slots=True)
class Units:
    """Each stage's program cut into units (see [Note: the rendezvous model]).

    `bounds[s][j]` is the `[start, end)` position range of unit j on stage s; `is_group[s][j]`
    tells a comm group from a single compute or update instruction; `unit_at[s][pos]` is the
    unit that holds position pos.

    >>> from schedcc.ir import parse
    >>> units = Units.of([[parse(op) for op in "F0 RG0 SA0 B0 Step".split()]])
    >>> units.bounds[0], units.is_group[0]
    (((0, 1), (1, 3), (3, 4), (4, 5)), (False, True, False, False))
    """

    bounds: tuple[tuple[tuple[int, int], ...], ...]
    is_group: tuple[tuple[bool, ...], ...]
    unit_at: tuple[tuple[int, ...], ...]

    @property
    def offset(self) -> list[int]:
        """`offset[s]`: the flat index of stage s's first unit (`offset[-1]`: all units)."""
        return list(accumulate((len(b) for b in self.bounds), initial=0))

    @classmethod
    def of(cls, stages: Sequence[Sequence[Instruction]]) -> Units:
        bounds, is_group, unit_at = [], [], []
        for ops in stages:
            starts: list[int] = []
            groups: list[bool] = []
            at: list[int] = []
            previous, j = False, -1  # was the op before a comm op? the current unit
            for pos, op in enumerate(ops):
                comm = type(op) in _COMM
                if not (comm and previous):  # a new unit starts here
                    starts.append(pos)
                    groups.append(comm)
                    j += 1
                at.append(j)
                previous = comm
            bounds.append(tuple(zip(starts, [*starts[1:], len(ops)])))
            is_group.append(tuple(groups))
            unit_at.append(tuple(at))
        return cls(tuple(bounds), tuple(is_group), tuple(unit_at))


@attrs.frozen(slots=True)
class CopyLanes:
    """Each stage's copy lane ([Note: offloading] in `schedcc.rules.offload`): `copies[s]` are
    the units that run on it (`Offload`, `Reload`), and `waits[s][j]` is the `Reload` unit
    that unit j, a backward piece, waits for.

    >>> from schedcc.ir import parse
    >>> ops = [parse(op) for op in "F0 O0 F1 L0 B0 B1".split()]
    >>> lanes = CopyLanes.of([ops], Units.of([ops]))
    >>> sorted(lanes.copies[0]), lanes.waits[0]
    ([1, 3], {4: 3})
    """

    copies: tuple[frozenset[int], ...]
    waits: tuple[dict[int, int], ...]

    @classmethod
    def of(cls, stages: Sequence[Sequence[Instruction]], units: Units) -> CopyLanes | None:
        """The lanes of `stages`, or None when no stage has a copy."""
        copies, waits = [], []
        for ops, unit_at in zip(stages, units.unit_at):
            on_lane: set[int] = set()
            wait: dict[int, int] = {}
            reloaded: dict[tuple[int, int], int] = {}
            for pos, op in enumerate(ops):
                if isinstance(op, Copy):
                    on_lane.add(unit_at[pos])
                    if type(op) is Reload:
                        reloaded[op.microbatch, op.chunk] = unit_at[pos]
                elif isinstance(op, _BACKWARD) and reloaded:
                    at = reloaded.get((op.microbatch, op.chunk))
                    if at is not None:
                        wait[unit_at[pos]] = at
            copies.append(frozenset(on_lane))
            waits.append(wait)
        if not any(copies):
            return None
        return cls(tuple(copies), tuple(waits))


_BACKWARD = (Backward, BackwardInput, BackwardWeight)  # `+B` is a Backward


def wait_for_cycle(waits_for: Mapping[int, int]) -> list[int]:
    """The stages of one wait-for cycle, from the lowest waiting stage's chain.

    `waits_for[a] = b`: stage a waits for stage b. Returns `[a, b, ...]`, each waiting for the
    next and the last for the first; empty if nothing waits.

    >>> wait_for_cycle({0: 2, 1: 0, 2: 1})
    [0, 2, 1]
    >>> wait_for_cycle({0: 1, 1: 2, 2: 1})
    [1, 2]
    """
    if not waits_for:
        return []
    stage = min(waits_for)
    order: list[int] = []
    while stage not in order:
        order.append(stage)
        stage = waits_for[stage]
    return order[order.index(stage) :]


@attrs.frozen(slots=True)
class Walk:
    """The result of `walk`: per stage and unit, start and end times (posted and done, for a group).

    `stuck` maps each stage that cannot finish to `(unit, peer stage, peer unit)`: the group it
    waits at and the partner group that is never posted. Empty when the program completes.
    """

    start: tuple[tuple[float, ...], ...]
    end: tuple[tuple[float, ...], ...]
    stuck: dict[int, tuple[int, int, int]]

    def wait_for_cycle(self) -> list[int]:
        """The stages of one wait-for cycle (stage a waits for b, ..., which waits for a)."""
        return wait_for_cycle({s: peer for s, (_, peer, _) in self.stuck.items()})


def links_of(units: Units, partner: Sequence[Sequence[tuple[int, int] | None]]) -> Links:
    """Per stage and unit: for a comm group, the flat indices of its partner groups (-1 for an
    op without a partner), None for a single instruction. Unit j of stage s has flat index
    `units.offset[s] + j` (see `walk`)."""
    offset, unit_at = units.offset, units.unit_at
    links = []
    for s, (bounds, groups) in enumerate(zip(units.bounds, units.is_group)):
        partner_s = partner[s]
        row: list[tuple[int, ...] | None] = []
        for (lo, hi), group in zip(bounds, groups):
            if not group:
                row.append(None)
                continue
            peers = []
            for pos in range(lo, hi):
                peer = partner_s[pos]
                peers.append(-1 if peer is None else offset[peer[0]] + unit_at[peer[0]][peer[1]])
            row.append(tuple(peers))
        links.append(tuple(row))
    return tuple(links)


def walk(
    units: Units,
    partner: Sequence[Sequence[tuple[int, int] | None]],
    durations: Sequence[Sequence[float]] | None = None,
    *,
    links: Links | None = None,
    lanes: CopyLanes | None = None,
) -> Walk:
    """Visit every unit in a topological order of the rendezvous model, timing it.

    `partner[s][pos]` is the matched op of each comm op (`schedcc.semantics.match_comm`);
    `durations[s][j]` is unit j's run time (a compute or update) or comm cost (a group) on stage
    s (all 0 if omitted); `links` is `links_of(units, partner)` if the caller keeps it. With
    `lanes`, a copy unit runs on its stage's copy lane (after the stage reached it and the
    lane's previous copy ended; the stage goes on at once) and a backward piece starts no
    earlier than its reload ends. Linear in the number of instructions.

    >>> import schedcc
    >>> from schedcc.semantics import match_comm
    >>> program = schedcc.compile(schedcc.get_schedule("gpipe")(2, 1))
    >>> partner, _ = match_comm(program.stages, program.tensors)
    >>> units = Units.of(program.stages)
    >>> walk(units, partner, [[1.0] * len(row) for row in units.bounds]).end
    ((1.0, 5.0, 6.0, 7.0), (2.0, 3.0, 4.0, 5.0, 6.0))
    """
    if links is None:
        links = links_of(units, partner)
    offset = units.offset
    num_stages, total = len(units.bounds), offset[-1]
    start, end = [0.0] * total, [0.0] * total  # by flat unit index
    posted = bytearray(total)
    clock, cursor = [0.0] * num_stages, [0] * num_stages
    waiting: dict[int, list[int]] = {}  # flat index of a group -> stages waiting for its post
    blocked: dict[int, int] = {}  # stage -> the flat index it waits for
    pending, queued = list(range(num_stages)), [True] * num_stages
    zero = [0.0] * max((len(b) for b in units.bounds), default=0)
    lane_free = [0.0] * num_stages  # when each stage's copy lane is next free
    none: frozenset[int] = frozenset()
    while pending:
        s = pending.pop()
        queued[s] = False
        blocked.pop(s, None)
        links_s, base = links[s], offset[s]
        cost = durations[s] if durations is not None else zero
        now, j, n = clock[s], cursor[s], len(links_s)
        copies, waits = (lanes.copies[s], lanes.waits[s]) if lanes is not None else (none, {})
        while j < n:
            peers, q = links_s[j], base + j
            if peers is None:  # a compute, update or copy
                if j in copies:  # on the copy lane: the stage goes on
                    start[q] = max(now, lane_free[s])
                    end[q] = lane_free[s] = start[q] + cost[j]
                    j += 1
                    continue
                if waits and j in waits:
                    now = max(now, end[base + waits[j]])
                start[q] = now
                now += cost[j]
                end[q] = now
                j += 1
                continue
            if not posted[q]:
                posted[q] = 1
                start[q] = now
                for waiter in waiting.pop(q, ()):
                    if not queued[waiter]:
                        queued[waiter] = True
                        pending.append(waiter)
            ready, missing = start[q], -1
            for peer in peers:
                if peer < 0 or not posted[peer]:  # unmatched (never completes) or not posted
                    missing = q if peer < 0 else peer
                    break
                if start[peer] > ready:
                    ready = start[peer]
            if missing >= 0:
                waiting.setdefault(missing, []).append(s)
                blocked[s] = missing
                break
            now = ready + cost[j]
            end[q] = now
            j += 1
        clock[s], cursor[s] = now, j
    return Walk(
        tuple(tuple(start[offset[s] : offset[s + 1]]) for s in range(num_stages)),
        tuple(tuple(end[offset[s] : offset[s + 1]]) for s in range(num_stages)),
        {s: (cursor[s], *_stage_unit(offset, blocked[s])) for s in sorted(blocked)},
    )


def critical_units(
    units: Units, partner: Sequence[Sequence[tuple[int, int] | None]], walked: Walk
) -> list[tuple[int, int]]:
    """`(stage, unit)` of a chain of units, in time order, from time 0 to the end of `walked`
    with no slack.

    Walking back from the unit that ends last, each unit's start was set by the one before it:
    the previous unit on its stage, or the partner group its comm group waited for (reached at
    that group's posted time, so the chain goes on from its stage's unit before it).
    """
    if not any(units.bounds):
        return []
    ends = [row[-1] if row else 0.0 for row in walked.end]
    s = max(range(len(ends)), key=lambda t: (ends[t], -t))
    j = len(units.bounds[s]) - 1
    chain: list[tuple[int, int]] = []
    at_done = True  # False: we reached this group at its posted event, through a partner
    while j >= 0:
        chain.append((s, j))
        start = walked.start[s][j]
        if at_done and units.is_group[s][j]:
            best = None
            lo, hi = units.bounds[s][j]
            for pos in range(lo, hi):
                ps, ppos = partner[s][pos]
                punit = units.unit_at[ps][ppos]
                posted = walked.start[ps][punit]
                if posted > start and (best is None or posted > walked.start[best[0]][best[1]]):
                    best = (ps, punit)
            if best is not None:
                s, j = best
                at_done = False
                continue
        at_done = True
        j -= 1
    chain.reverse()
    return chain


def _stage_unit(offset: Sequence[int], index: int) -> tuple[int, int]:
    """The (stage, unit) of a flat unit index."""
    stage = bisect_right(offset, index) - 1
    return stage, index - offset[stage]
