"""`Program`: the compiled, lowered per-stage instruction lists (and, on demand, the DAG)."""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING

import attrs

from schedcc.ir import Instruction, parse
from schedcc.schedule import Schedule
from schedcc.semantics.model import STAGE_CACHES

if TYPE_CHECKING:
    import networkx as nx

__all__ = ["Program"]


@attrs.frozen(slots=False, eq=False)
class Program:
    """What the compiler produces and the validator, simulator and backends consume.

    Attributes:
        schedule: the schedule it was compiled from (shape, placement, weight delay).
        stages: `stages[s]` is stage s's instructions, in the order it runs them.
        data_parallel: data-parallel replicas of the pipeline (each runs the same program).
        zero: 0 (plain all-reduce), 1 (ZeRO-1) or 2 (reduce-scatter after every backward).
        versions: `versions[s][pos]` is the weight version instruction `pos` of stage `s` uses
            (computes), or the version a step produces; None elsewhere. Set by `assign_versions`.
        tied: groups of segments that share parameters, each a sorted tuple of segment indices
            (`compile(..., tied=...)`); `ReduceTied(g)` sums the gradients of group `g`'s copies.
        forward_only: the program only runs forwards (`compile(..., forward_only=True)`, for
            evaluation): no backward, no update, and every forward uses the live weights.
        grad_norm: the compiler places a `GradNorm` before every step (`compile(...,
            grad_norm=True)`), for global gradient clipping and non-finite step skipping.
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

    @cached_property
    def graph(self) -> nx.DiGraph:
        """The dependency DAG, built on first use (see `schedcc.semantics.graph`)."""
        from schedcc.semantics.graph import build_graph

        return build_graph(self)

    def evolve(self, **changes) -> Program:
        """A copy with some fields replaced. What the semantics read off the schedule, stages
        and tied groups (steps, partners, versions) is carried over when none of them changes;
        the graph and the validator's proof are not."""
        copy = attrs.evolve(self, **changes)
        if not {"schedule", "stages", "tied"} & changes.keys():
            for key in STAGE_CACHES:
                if key in self.__dict__:
                    copy.__dict__[key] = self.__dict__[key]
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
