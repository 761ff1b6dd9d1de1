"""`rendezvous_model(program)`: a program read once through the semantics, kept with the program.

The validator (its comm and deadlock rules), the simulators and the drawings all read the same
facts of a program: its tensor keys, its units, each comm op's partner, the weight versions and
one walk of the rendezvous model. A `Program` is immutable, so they are computed on first use and
kept in the program's `__dict__`; `Program.evolve` carries them to a copy with the same schedule and
stages (`STAGE_CACHES`), and a copy with others starts without them.

[Note: the reference walk] Whether the rendezvous model completes does not depend on how long each
step takes, so the deadlock rule walks it timed with the default costs (`UNIT_COSTS`: F = 1,
B = 2, I = W = R = 1, comm and updates free, `CostModel()`'s) and keeps the walk: `simulate` under
the default costs is then that walk, not a second one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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

__all__ = [
    "STAGE_CACHES",
    "UNIT_COSTS",
    "RendezvousModel",
    "reference_walk",
    "rule_versions",
    "rendezvous_model",
    "tensors_of",
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

_TENSORS, _MODEL = "_schedcc_tensors", "_schedcc_rendezvous_model"
_VERSIONS, _WALK = "_schedcc_versions", "_schedcc_reference_walk"
#: The `__dict__` keys of what depends only on a program's schedule and stages.
STAGE_CACHES = (_TENSORS, _MODEL, _VERSIONS, _WALK)


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


def tensors_of(program: Any) -> Tensors:
    """The `Tensors` of `program.schedule`, made once per program."""
    tensors = program.__dict__.get(_TENSORS)
    if tensors is None:
        tensors = program.__dict__[_TENSORS] = Tensors.of(program.schedule)
    return tensors


def rendezvous_model(program: Any) -> RendezvousModel:
    """The `RendezvousModel` of `program` (a `Program`), made once per program.

    >>> import schedcc
    >>> program = schedcc.compile(schedcc.get_schedule("gpipe")(2, 1))
    >>> model = rendezvous_model(program)
    >>> model.partner[0][1], model.problems, rendezvous_model(program) is model
    ((1, 0), (), True)
    """
    model = program.__dict__.get(_MODEL)
    if model is None:
        tensors = tensors_of(program)
        partner, problems = match_comm(program.stages, tensors)
        units = Units.of(program.stages)
        links = links_of(units, partner)
        meets, tie_problems = [], []
        kinds = frozenset({type(op) for ops in program.stages for op in ops})
        # a ReduceTied in a program without ties meets nothing: matched, it is reported
        if getattr(program, "tied", ()) or ReduceTied in kinds:  # [Note: tied collectives]
            links, meets, tie_problems = tie_links(program, tensors.layout, units, links)
        norm_problems = []
        if GradNorm in kinds:
            links, meets, norm_problems = norm_links(program.stages, units, links, meets)
        model = RendezvousModel(
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
        program.__dict__[_MODEL] = model
    return model


def rule_versions(program: Any) -> tuple[tuple[int | None, ...], ...]:
    """`versions_of` every stage of `program`: the versions the weight-version rule gives (what
    `assign_versions` records and `check_versions` checks), made once per program."""
    versions = program.__dict__.get(_VERSIONS)
    if versions is None:
        schedule = program.schedule
        m, delay = schedule.num_microbatches, schedule.weight_delay
        if getattr(program, "forward_only", False):  # no step: every forward uses version 0
            delay = schedule.num_batches
        versions = tuple(versions_of(ops, m, delay) for ops in program.stages)
        program.__dict__[_VERSIONS] = versions
    return versions


def unit_durations(stages: Sequence[Sequence[Instruction]], units: Units) -> list[list[float]]:
    """`durations[s][j]` of every step under `UNIT_COSTS` (what `walk` takes)."""
    get = UNIT_COSTS.get  # a comm group's first op is a comm op: it costs nothing here
    return [
        [get(type(ops[lo]), 0.0) for lo, _ in bounds] for ops, bounds in zip(stages, units.bounds)
    ]


def reference_walk(program: Any) -> Walk:
    """The walk of `program`'s rendezvous model timed with `UNIT_COSTS` (see [Note: the reference
    walk]), made once per program."""
    result = program.__dict__.get(_WALK)
    if result is None:
        model = rendezvous_model(program)
        durations = unit_durations(program.stages, model.units)
        result = walk(model.units, model.partner, durations, links=model.links)
        program.__dict__[_WALK] = result
    return result
