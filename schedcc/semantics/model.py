"""The rendezvous model of a program: what `Program.rendezvous_model`, `Program.rule_versions`
and `Program.reference_walk` are built from.

The validator (its comm and deadlock rules), the simulators and the drawings all read the same
facts of a program: its tensor keys, its units, each comm op's partner, the weight versions and
one walk of the rendezvous model. The functions here build them; a `Program` keeps what they
build as its cached properties ([Note: derived facts] in `schedcc.program`), so read them there.

[Note: the reference walk] Whether the rendezvous model completes does not depend on how long each
step takes, so the deadlock rule walks it timed with the default costs (`UNIT_COSTS`: F = 1,
B = 2, I = W = R = 1, comm and updates free, `CostModel()`'s) and keeps the walk: `simulate` under
the default costs is then that walk, not a second one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from schedcc.ir import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    GradNorm,
    Instruction,
    OverlappedBackward,
    Recompute,
    ReduceTied,
)
from schedcc.semantics.channels import CommProblem, Partner, match_comm
from schedcc.semantics.collectives import Meets, TieProblem, tie_links
from schedcc.semantics.norms import NormProblem, norm_links
from schedcc.semantics.tensors import Tensors
from schedcc.semantics.units import Links, Units, Walk, links_of, walk
from schedcc.semantics.versions import versions_of

if TYPE_CHECKING:
    from schedcc.program import Program

__all__ = [
    "UNIT_COSTS",
    "RendezvousModel",
    "build_reference_walk",
    "build_rendezvous_model",
    "build_rule_versions",
    "unit_durations",
]

#: The default duration of each compute (`CostModel()`'s); comm and updates take none.
UNIT_COSTS: dict[type, float] = {
    Forward: 1.0,
    Backward: 2.0,
    BackwardInput: 1.0,
    BackwardWeight: 1.0,
    Recompute: 1.0,
    OverlappedBackward: 1.5,  # `CostModel()`'s pair, 2.5, less its forward (`overlapped_pair`)
}


@attrs.frozen(slots=True)
class RendezvousModel:
    """A program's tensor keys, units, comm partners and pairing problems (`match_comm`), and
    each comm group's partner groups (`links_of`, what `walk` follows)."""

    tensors: Tensors
    units: Units
    partner: Partner
    problems: tuple[CommProblem, ...]
    links: Links
    #: each `ReduceTied`'s other members (`match_collectives`) and those that meet nothing
    meets: Meets = ()
    tie_problems: tuple[TieProblem, ...] = ()
    #: the `GradNorm`s that meet nothing ([Note: the norm collective])
    norm_problems: tuple[NormProblem, ...] = ()
    #: the instruction classes the program holds
    kinds: frozenset[type] = frozenset()


def build_rendezvous_model(program: Program) -> RendezvousModel:
    """The `RendezvousModel` of `program` (read it as `program.rendezvous_model`, built once).

    >>> import schedcc
    >>> model = build_rendezvous_model(schedcc.compile(schedcc.get_schedule("gpipe")(2, 1)))
    >>> model.partner[0][1], model.problems
    ((1, 0), ())
    """
    tensors = program.tensors
    partner, problems = match_comm(program.stages, tensors)
    units = Units.of(program.stages)
    links = links_of(units, partner)
    meets, tie_problems = [], []
    kinds = frozenset({type(op) for ops in program.stages for op in ops})
    # a ReduceTied in a program without ties meets nothing: matched, it is reported
    if program.tied or ReduceTied in kinds:  # [Note: tied collectives]
        links, meets, tie_problems = tie_links(program, tensors.layout, units, links)
    norm_problems = []
    if GradNorm in kinds:
        links, meets, norm_problems = norm_links(program.stages, units, links, meets)
    return RendezvousModel(
        tensors,
        units,
        partner,
        tuple(problems),
        links,
        meets,
        tuple(tie_problems),
        tuple(norm_problems),
        kinds,
    )


def build_rule_versions(program: Program) -> tuple[tuple[int | None, ...], ...]:
    """`versions_of` every stage of `program`: the versions the weight-version rule gives (read
    it as `program.rule_versions`, built once)."""
    schedule = program.schedule
    m, delay = schedule.num_microbatches, schedule.weight_delay
    if program.forward_only:  # no step: every forward uses version 0
        delay = schedule.num_batches
    return tuple(versions_of(ops, m, delay) for ops in program.stages)


def unit_durations(stages: Sequence[Sequence[Instruction]], units: Units) -> list[list[float]]:
    """`durations[s][j]` of every step under `UNIT_COSTS` (what `walk` takes)."""
    get = UNIT_COSTS.get  # a comm group's first op is a comm op: it costs nothing here
    return [
        [get(type(ops[lo]), 0.0) for lo, _ in bounds] for ops, bounds in zip(stages, units.bounds)
    ]


def build_reference_walk(program: Program) -> Walk:
    """The walk of `program`'s rendezvous model timed with `UNIT_COSTS` (see [Note: the reference
    walk]; read it as `program.reference_walk`, built once)."""
    model = program.rendezvous_model
    durations = unit_durations(program.stages, model.units)
    return walk(model.units, model.partner, durations, links=model.links)
