"""Collectives in the rendezvous model: `ReduceTied(g)` meets the matching `ReduceTied(g)` of every
other stage that holds a segment of tied group g.

[Note: tied collectives] A `ReduceTied(g)` is a step with the two events of a comm group: it is
*posted* when its stage reaches it and *done* once every member of the collective is posted (then
the summed gradients exist everywhere). Its members are the stages holding a segment of
`program.tied[g]` (the same data-parallel replica: every replica runs the same program); the n-th
`ReduceTied(g)` of each member meets the n-th of every other member. With every copy on one stage
(zb-v puts segments 0 and 2p - 1 on stage 0) the collective has one member and waits for nobody.
A cycle through a collective is a deadlock like any other, so `walk` follows these steps as it
follows comm groups (`links`), and the validator prints the same wait-for chain.

`earliest_cut` is the smallest set of step prefixes, one per stage, that contains given steps and
everything they wait for (a consistent cut of the rendezvous model). Putting a collective's members
right after such a cut cannot close a cycle: nothing before the cut waits for anything after it.
`insert_updates` places `ReduceTied` that way. Under a weight delay the cut may pass a member's
step (its members meet only after it runs work of the next batch); the step then follows the
collective, unless work in between needs it (`step_blocker`), which `insert_updates` moves
after the collective with what depends on it (`with_dependents`) or refuses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from schedcc.ir import WEIGHT_GRADIENT, Comm, Compute, Instruction, ReduceTied
from schedcc.semantics.layout import Layout
from schedcc.semantics.tensors import Tensors
from schedcc.semantics.units import Links, Units
from schedcc.semantics.versions import version_used

__all__ = [
    "Meets",
    "TieProblem",
    "earliest_cut",
    "step_blocker",
    "match_collectives",
    "tie_chunks",
    "tie_links",
    "tie_members",
    "with_dependents",
]

#: `meets[s][pos]`: for a `ReduceTied` matched on every member, the `(stage, position)` of the
#: other members' ops; None for any other op and for an unmatched `ReduceTied`.
Meets = list[list[tuple[tuple[int, int], ...] | None]]


@attrs.frozen(slots=True)
class TieProblem:
    """A `ReduceTied` that meets nothing: `kind` is "group" (no such tied group), "stage" (its
    stage holds no segment of the group) or "unmatched" (another member has no n-th one)."""

    kind: str
    stage: int
    position: int
    peer: int | None = None


def tie_members(tied: Sequence[Sequence[int]], layout: Layout) -> tuple[tuple[int, ...], ...]:
    """Per tied group, the stages that hold one of its segments, in order.

    >>> import schedcc
    >>> tie_members([(0, 3)], Layout.of(schedcc.get_schedule("1f1b")(4, 4)))
    ((0, 3),)
    """
    return tuple(tuple(sorted({layout.stage_of[k] for k in group})) for group in tied)


def tie_chunks(tied: Sequence[Sequence[int]], layout: Layout, stage: int) -> dict[int, tuple]:
    """`{group: chunks}`: the chunks of `stage` that hold a segment of each tied group."""
    out = {}
    for g, group in enumerate(tied):
        chunks = tuple(sorted(layout.chunk_of[k] for k in group if layout.stage_of[k] == stage))
        if chunks:
            out[g] = chunks
    return out


def match_collectives(
    stages: Sequence[Sequence[Instruction]], tied: Sequence[Sequence[int]], layout: Layout
) -> tuple[Meets, list[TieProblem]]:
    """Pair each member's n-th `ReduceTied(g)` with every other member's n-th; linear.

    >>> import schedcc
    >>> from schedcc.ir import parse
    >>> layout = Layout.of(schedcc.get_schedule("1f1b")(2, 1))
    >>> stages = [[parse("F0"), parse("Tied0")], [parse("Tied0")]]
    >>> meets, problems = match_collectives(stages, [(0, 1)], layout)
    >>> meets[0][1], meets[1][0], problems
    (((1, 0),), ((0, 1),), [])
    """
    members = tie_members(tied, layout)
    meets: Meets = [[None] * len(ops) for ops in stages]
    problems: list[TieProblem] = []
    found: dict[tuple[int, int], list[int]] = {}  # (group, stage) -> positions, in order
    for s, ops in enumerate(stages):
        for pos, op in enumerate(ops):
            if type(op) is not ReduceTied:
                continue
            g = op.tie
            if not 0 <= g < len(tied):
                problems.append(TieProblem("group", s, pos))
            elif s not in members[g]:
                problems.append(TieProblem("stage", s, pos))
            else:
                found.setdefault((g, s), []).append(pos)
    for g, stages_g in enumerate(members):
        rows = [found.get((g, s), []) for s in stages_g]
        count = min(len(row) for row in rows)
        for n in range(count):
            ops_n = [(s, row[n]) for s, row in zip(stages_g, rows)]
            for s, pos in ops_n:
                meets[s][pos] = tuple(other for other in ops_n if other[0] != s)
        for s, row in zip(stages_g, rows):
            short = next(t for t, other in zip(stages_g, rows) if len(other) == count)
            problems.extend(TieProblem("unmatched", s, pos, short) for pos in row[count:])
    return meets, problems


def tie_links(program: Any, layout: Layout, units: Units, links: Links):
    """`links` with each `ReduceTied` step linked to its other members' steps (flat indices, as
    `walk` follows them; `(-1,)` for one that meets nothing), and `match_collectives`' result.

    >>> import schedcc
    >>> program = schedcc.compile(schedcc.get_schedule("gpipe")(2, 1), tied=[(0, 1)])
    >>> program.to_text()
    'stage 0: F0 SA0 RG0 B0 Tied0 Step\\nstage 1: RA0 F0 B0 SG0 Tied0 Step'
    >>> model = program.rendezvous_model  # Tied0 is step 3 of stage 0 and step 4 of stage 1
    >>> model.links[0][3], model.links[1][4], model.units.offset[1]
    ((9,), (3,), 5)
    """
    meets, problems = match_collectives(program.stages, program.tied, layout)
    offset, unit_at = units.offset, units.unit_at
    rows = [list(row) for row in links]
    for s, ops in enumerate(program.stages):
        for pos, op in enumerate(ops):
            if type(op) is ReduceTied:
                others = meets[s][pos]
                rows[s][unit_at[s][pos]] = (
                    (-1,)
                    if others is None
                    else tuple(offset[t] + unit_at[t][tpos] for t, tpos in others)
                )
    return tuple(map(tuple, rows)), meets, problems


def earliest_cut(
    bounds: Sequence[Sequence[tuple[int, int]]],
    unit_at: Sequence[Sequence[int]],
    partner: Sequence[Sequence[tuple[int, int] | None]],
    prefix: list[int],
    seeds: dict[int, int],
) -> None:
    """Grow `prefix` in place to the earliest consistent cut that holds step `seeds[s]` of each
    stage s, and everything it waits for: `prefix[s]` is the last step of stage s inside the
    cut (-1 for none). A comm group inside the cut needs its partner groups *posted*, that is
    everything before them done; on a stage of `seeds` a cut falls between units, so a partner
    group there is taken whole. Linear in the steps it adds."""
    whole = seeds.keys()
    stack = list(seeds.items())
    while stack:
        s, j = stack.pop()
        if j <= prefix[s]:
            continue
        partner_s = partner[s]
        for step in range(prefix[s] + 1, j + 1):
            lo, hi = bounds[s][step]
            for pos in range(lo, hi):
                peer = partner_s[pos]
                if peer is not None:
                    t = peer[0]
                    stack.append((t, unit_at[t][peer[1]] - (t not in whole)))
        prefix[s] = j


def step_blocker(
    ops: Sequence[Instruction], lo: int, hi: int, batch: int, num_microbatches: int, delay: int
) -> int | None:
    """The first position in `ops[lo:hi]` that the optimizer step of batch `batch` cannot be
    delayed past, or None: a weight gradient (it would join this batch's sum) or a compute on
    a version the step makes (`version_used > batch`). Under a weight delay a later batch's
    forward and input gradient run on older weights, so a collective before the step may wait
    for them ([Note: tied collectives]).

    >>> from schedcc.ir import parse
    >>> ops = [parse(x) for x in "W0 F1 I1 SG1 F2 W1".split()]
    >>> [step_blocker(ops, 1, hi, 0, 1, 1) for hi in (4, 5, 6)]
    [None, 4, 4]
    """
    for pos in range(lo, hi):
        op = ops[pos]
        if isinstance(op, WEIGHT_GRADIENT) or (
            isinstance(op, Compute) and version_used(op.microbatch, num_microbatches, delay) > batch
        ):
            return pos
    return None


def with_dependents(
    ops: Sequence[Instruction], lo: int, hi: int, moving: set[int], tensors: Tensors, stage: int
) -> list[int]:
    """The positions in `ops[lo:hi]` (the program of `stage`) that move later with those in
    `moving`, in order: those and every op after one of them that depends on it on the stage
    (a compute using a tensor one makes or receives, a send of such a tensor) or shares a
    peer with a moving comm op (so each channel keeps its order). Moved after the rest of
    `ops[lo:hi]`, in this order, they leave every dependency and channel order intact. It is
    how a collective's pass moves comm of a later batch, or work that needs the step, past it.

    >>> import schedcc
    >>> from schedcc.ir import parse
    >>> schedule = schedcc.get_schedule("gpipe")(2, 2)
    >>> ops = [parse(x) for x in "RA1 F1 B0 SG0 B1 SG1".split()]
    >>> with_dependents(ops, 0, 6, {0}, Tensors.of(schedule), 1)
    [0, 1, 3, 4, 5]
    """
    out: list[int] = []
    made: set[int] = set()  # tensors the moving ops make or receive
    peers: set[int] = set()  # the peers of their comm
    for pos in range(lo, hi):
        op = ops[pos]
        route = tensors.route(stage, op) if isinstance(op, Comm) else None
        peer = None if route is None else route.dst if route.src == stage else route.src
        if not (
            pos in moving
            or (isinstance(op, Compute) and not made.isdisjoint(tensors.needs(stage, op)))
            or (route is not None and (route.tensor in made or peer in peers))
        ):
            continue
        out.append(pos)
        key = tensors.makes(stage, op) if isinstance(op, Compute) else None
        if key is not None:
            made.add(key)
        if route is not None:
            peers.add(peer)
            if not op.is_send:
                made.add(route.tensor)
    return out
