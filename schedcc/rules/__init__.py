"""The validator's rules: small functions from a `Context` to the `Problem`s they find.

Each rule reads the program through `schedcc.semantics` (the rendezvous model, tensor identity, the
weight-version rule, activation counting), so what it proves is what the simulators time and the
backends run. `schedcc.validate.RULES` lists them in the order they run; the table of rules and
errors is in docs/design.md ("What the validator guarantees").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import cached_property

import attrs

from schedcc.errors import ScheduleError
from schedcc.ir import COMM, Instruction
from schedcc.memory_model import MemoryModel
from schedcc.program import Program
from schedcc.semantics import CommProblem, RendezvousModel

__all__ = ["Context", "Problem", "Rule"]

_COMM = frozenset(COMM)


@attrs.frozen
class Problem:
    """One finding of a rule: the error class, what is wrong and how to fix it, and where."""

    error: type[ScheduleError]
    message: str
    stage: int | None = None
    position: int | None = None


class Context:
    """What several rules read, computed once per validation."""

    def __init__(
        self,
        program: Program,
        max_activations: int | None,
        *,
        max_bytes: float | None = None,
        memory: MemoryModel | None = None,
    ):
        self.program = program
        self.stages = program.stages
        self.schedule = program.schedule
        self.max_activations = max_activations
        #: the byte limit and the model that counts bytes (`schedcc.rules.bytes`)
        self.max_bytes, self.memory = max_bytes, memory
        self.tensors = program.tensors
        self.layout = self.tensors.layout

    @property
    def model(self) -> RendezvousModel:
        """The program's rendezvous model (`Program.rendezvous_model`, shared with the
        simulators)."""
        return self.program.rendezvous_model

    @property
    def matching(self) -> tuple[list[list[tuple[int, int] | None]], tuple[CommProblem, ...]]:
        """`match_comm`'s `(partner, problems)` for the program."""
        return self.model.partner, self.model.problems

    @property
    def kinds(self) -> frozenset[type]:
        """The instruction classes the program holds (the rendezvous model's): a rule about an
        optional instruction (`R`, `+B`, `Norm`, ZeRO-3's) returns at once where there is none."""
        return self.model.kinds

    @cached_property
    def computes_and_updates(self) -> list[list[tuple[int, Instruction]]]:
        """Per stage, `(position, instruction)` of its computes and updates (no comm), for the
        rules that read only those."""
        return [
            [(pos, op) for pos, op in enumerate(ops) if type(op) not in _COMM]
            for ops in self.stages
        ]

    def where(self, stage: int, pos: int) -> str:
        return f"stage {stage}, position {pos} ({self.stages[stage][pos]})"


Rule = Callable[[Context], Iterator[Problem]]
