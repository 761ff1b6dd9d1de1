"""The gradient-norm collective in the rendezvous model: `GradNorm` meets the matching `GradNorm` of
every other stage.

[Note: the norm collective] The norm of the whole model's gradient needs every stage's part, so
a `GradNorm` is a collective among all the stages of a replica (the data-parallel replicas run
the same program and join it at the same place). It is modelled as `ReduceTied` is ([Note: tied
collectives] in `schedcc.semantics.collectives`): a step with a *posted* event when its stage
reaches it and a *done* event once every stage has posted its n-th `GradNorm`; `walk` follows it
as it follows comm groups, so a cycle through it is a deadlock the validator prints like any
other. With one stage it waits for nobody. An n-th `GradNorm` that another stage lacks meets
nothing (a `NormProblem`).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from schedcc.ir import GradNorm, Instruction
from schedcc.semantics.collectives import Meets
from schedcc.semantics.units import Links, Units

__all__ = ["NormProblem", "match_norms", "norm_links"]


@attrs.frozen(slots=True)
class NormProblem:
    """A `GradNorm` at `(stage, position)` that meets nothing: stage `peer` runs fewer."""

    stage: int
    position: int
    peer: int


def match_norms(
    stages: Sequence[Sequence[Instruction]],
) -> tuple[list[list[tuple[tuple[int, int], ...] | None]], list[NormProblem]]:
    """Pair each stage's n-th `GradNorm` with every other stage's n-th; linear.

    >>> from schedcc.ir import parse
    >>> meets, problems = match_norms([[parse("F0"), parse("Norm")], [parse("Norm")]])
    >>> meets[0][1], meets[1][0], problems
    (((1, 0),), ((0, 1),), [])
    """
    rows = [[pos for pos, op in enumerate(ops) if type(op) is GradNorm] for ops in stages]
    meets: list[list[tuple[tuple[int, int], ...] | None]] = [[None] * len(ops) for ops in stages]
    problems: list[NormProblem] = []
    if not any(rows):
        return meets, problems
    count = min(len(row) for row in rows)
    short = next(s for s, row in enumerate(rows) if len(row) == count)
    for n in range(count):
        members = [(s, row[n]) for s, row in enumerate(rows)]
        for s, pos in members:
            meets[s][pos] = tuple(other for other in members if other[0] != s)
    for s, row in enumerate(rows):
        problems.extend(NormProblem(s, pos, short) for pos in row[count:])
    return meets, problems


def norm_links(stages, units: Units, links: Links, meets: Meets):
    """`links` with each `GradNorm` step linked to the other stages' matching ones (flat indices,
    `(-1,)` for one that meets nothing), `meets` with the norm collectives added (made if empty),
    and `match_norms`' problems."""
    found, problems = match_norms(stages)
    if not meets:
        meets = found
    else:
        meets = [
            [mine if mine is not None else theirs for mine, theirs in zip(row, other)]
            for row, other in zip(meets, found)
        ]
    offset, unit_at = units.offset, units.unit_at
    rows = [list(row) for row in links]
    for s, ops in enumerate(stages):
        for pos, op in enumerate(ops):
            if type(op) is GradNorm:
                others = found[s][pos]
                rows[s][unit_at[s][pos]] = (
                    (-1,)
                    if others is None
                    else tuple(offset[t] + unit_at[t][tpos] for t, tpos in others)
                )
    return tuple(map(tuple, rows)), meets, problems
