"""`Program`: the compiled, lowered per-stage instruction lists (and, on demand, the DAG)."""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING

import attrs

from schedcc.ir import Instruction, parse
from schedcc.schedule import Schedule
from schedcc.semantics.model import (
    RendezvousModel,
    build_reference_walk,
    build_rendezvous_model,
    build_rule_versions,
)
from schedcc.semantics.tensors import Tensors
from schedcc.semantics.units import Walk

if TYPE_CHECKING:
    import networkx as nx

    from schedcc.errors import ScheduleError

__all__ = ["Program"]


class _Derived(cached_property):
    """A cached property of `Program` read from the fields `inputs` ([Note: derived facts])."""

    #: the fields the fact is read from; None: every field (it is never handed to a copy)
    inputs: frozenset[str] | None = None


def _derived(*inputs: str):
    """Declare a derived fact of `Program` read from the fields `inputs` (every field when none
    is named): a cached property that `Program.evolve` hands to a copy with those unchanged."""

    def fact(method):
        prop = _Derived(method)
        if inputs:
            prop.inputs = frozenset(inputs)
        return prop

    return fact


@attrs.frozen(slots=False, eq=False)
class Program:
    """What the compiler produces and the validator, simulator and backends consume.

    Attributes:
        schedule: the schedule it was compiled from (shape, placement, weight delay).
        stages: `stages[s]` is stage s's instructions, in the order it runs them.
        data_parallel: data-parallel replicas of the pipeline (each runs the same program).
        zero: 0 (plain all-reduce), 1 (ZeRO-1: reduce-scatter, sharded step, all-gather), 2
            (reduce-scatter after every backward) or 3 (as 2, and each chunk's parameters stay
            sharded between uses: whole from its `Unshard` to its `Reshard`), as `compile`.
        versions: `versions[s][pos]` is the weight version instruction `pos` of stage `s` uses
            (computes), or the version a step produces; None elsewhere. Set by `assign_versions`.
        tied: groups of segments that share parameters, each a sorted tuple of segment indices
            (`compile(..., tied=...)`); `ReduceTied(g)` sums the gradients of group `g`'s copies.
        forward_only: the program only runs forwards (`compile(..., forward_only=True)`, for
            evaluation): no backward, no update, and every forward uses the live weights.
        grad_norm: the compiler places a `GradNorm` before every step (`compile(...,
            grad_norm=True)`), for global gradient clipping and non-finite step skipping.

    [Note: derived facts] What the semantics, the validator and the backends read off a program
    is computed on first use and kept with it, as the facts below and nowhere else: `tensors`,
    `rendezvous_model`, `rule_versions`, `reference_walk`, `graph` and the validator's
    `problems`. A program is immutable, so a fact once read stays true. Each fact names the
    fields it is read from (`_derived(...)`); `evolve` hands a fact to the copy only when none
    of those fields is among the changes (assign_versions' copy keeps the rendezvous model), and
    the graph and the problems, which read every field, never: a copy is proved by its own
    validation. A new fact is one more `_derived` property here, named in this list
    (`tests/core/test_program_facts.py` checks both and that each fact's fields are all it
    reads).
    """

    schedule: Schedule
    stages: tuple[tuple[Instruction, ...], ...]
    data_parallel: int = 1
    zero: int = 0
    versions: tuple[tuple[int | None, ...], ...] | None = None
    tied: tuple[tuple[int, ...], ...] = ()
    forward_only: bool = False
    grad_norm: bool = False

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_instructions(self) -> int:
        return sum(len(ops) for ops in self.stages)

    @_derived("schedule")
    def tensors(self) -> Tensors:
        """The tensor keys of the schedule's segments (`Tensors.of(self.schedule)`)."""
        return Tensors.of(self.schedule)

    @_derived("schedule", "stages", "tied")
    def rendezvous_model(self) -> RendezvousModel:
        """The units, comm partners and collectives
        (`schedcc.semantics.build_rendezvous_model`).

        >>> import schedcc
        >>> program = schedcc.compile(schedcc.get_schedule("gpipe")(2, 1))
        >>> program.rendezvous_model.partner[0][1], program.rendezvous_model.problems
        ((1, 0), ())
        """
        return build_rendezvous_model(self)

    @_derived("schedule", "stages", "forward_only")
    def rule_versions(self) -> tuple[tuple[int | None, ...], ...]:
        """The weight versions the weight-version rule gives each instruction (what
        `assign_versions` records as `versions` and `check_versions` checks)."""
        return build_rule_versions(self)

    @_derived("schedule", "stages", "tied")
    def reference_walk(self) -> Walk:
        """The walk of the rendezvous model timed with the default costs ([Note: the reference
        walk] in `schedcc.semantics.model`): what the deadlock rule and `simulate` share."""
        return build_reference_walk(self)

    @_derived()
    def graph(self) -> nx.DiGraph:
        """The dependency DAG (see `schedcc.semantics.graph`)."""
        from schedcc.semantics.graph import build_graph

        return build_graph(self)

    @_derived()
    def problems(self) -> tuple[ScheduleError, ...]:
        """Every problem the validator's rules find (`validate(self, collect=True)`); the
        program is proved when there is none. `validate` and `ensure_valid` read it, so a
        program is validated once.

        >>> import schedcc
        >>> schedcc.compile(schedcc.get_schedule("1f1b")(2, 4)).problems
        ()
        """
        from schedcc.validate import find_problems

        return find_problems(self)

    def evolve(self, **changes) -> Program:
        """A copy with some fields replaced; it keeps the derived facts read from none of them,
        and builds the others anew ([Note: derived facts]): a copy is validated anew."""
        copy = attrs.evolve(self, **changes)
        kept, built = vars(copy), vars(self)
        for name, fact in _FACTS.items():
            if name in built and fact.inputs is not None and fact.inputs.isdisjoint(changes):
                kept[name] = built[name]
        return copy

    def to_text(self) -> str:
        """One line per stage: `stage 0: F0 F1 SA0 ...` (what golden files store)."""
        return "\n".join(
            f"stage {s}: " + " ".join(str(op) for op in ops) for s, ops in enumerate(self.stages)
        )

    @staticmethod
    def parse_stages(text: str) -> tuple[tuple[Instruction, ...], ...]:
        """The inverse of `to_text` for the instruction lists."""
        stages = []
        for line in text.strip().splitlines():
            _, _, body = line.partition(":")
            stages.append(tuple(parse(word) for word in body.split()))
        return tuple(stages)

    def __repr__(self) -> str:
        return (
            f"Program({self.schedule!r}, {self.num_instructions} instructions, "
            f"data_parallel={self.data_parallel}, zero={self.zero})"
        )


#: every derived fact, by name (the list of [Note: derived facts])
_FACTS = {name: fact for name, fact in vars(Program).items() if isinstance(fact, _Derived)}
assert all(
    fact.inputs is None or fact.inputs <= attrs.fields_dict(Program).keys()
    for fact in _FACTS.values()
), "a derived fact names a field Program does not have"
