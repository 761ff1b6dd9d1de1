"""The weight versions one stage keeps for `StageRuntime` (weight stashing, weight_delay >= 1).

A forward of microbatch `i` runs on version `i // m - weight_delay` of its chunk's parameters (at
least 0); the live parameters are the newest version. Under a weight delay each version a later
forward will use is stashed as a detached copy when it becomes live, and dropped once its last
forward has taken it (the graphs of in-flight forwards keep the tensors until their backward).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from schedcc.errors import RuntimeInstructionError
from schedcc.ir import Forward
from schedcc.semantics import version_used

if TYPE_CHECKING:
    from schedcc.program import Program

__all__ = ["WeightVersions"]


class WeightVersions:
    """Which parameters each forward runs with, for one run of the program on one stage.

    Args:
        program: the compiled program (its schedule gives m and the weight delay).
        stage: the stage whose forwards are counted.
        modules: the stage's segments, by chunk (their parameters are the live version).

    `version` is the live version, 0 at the start of a run; `advance` moves it on.
    """

    def __init__(
        self,
        program: Program,
        stage: int,
        modules: Sequence[nn.Module],
    ) -> None:
        self._m = program.schedule.num_microbatches
        self._delay = program.schedule.weight_delay
        self._stage = stage
        self._modules = modules
        self.version = 0
        self._stash: list[dict[int, dict[str, torch.Tensor]]] = [{} for _ in modules]
        # only stashed versions are counted (a program with no weight delay stashes none)
        self._uses_left = self._count_uses(program) if self._delay else []
        # the live parameters by chunk, looked up once per run instead of once per forward
        self._live = [dict(mod.named_parameters()) for mod in modules]
        if self._delay:
            for c in range(len(modules)):
                self.snapshot(c, 0)

    def version_of(self, microbatch: int) -> int:
        """The weight version the forward of `microbatch` runs on."""
        return version_used(microbatch, self._m, self._delay)

    def _count_uses(self, program: Program) -> list[dict[int, int]]:
        uses: list[dict[int, int]] = [defaultdict(int) for _ in self._modules]
        for op in program.stages[self._stage]:
            if type(op) is Forward:
                uses[op.chunk][self.version_of(op.microbatch)] += 1
        return uses

    def params_for(self, c: int, version: int) -> dict[str, torch.Tensor]:
        """The parameters of chunk `c` at `version`, counting one use of a stashed version."""
        if not self._delay:
            return self._live[c]
        stash = self._stash[c]
        if version not in stash:
            raise RuntimeInstructionError(
                f"stage {self._stage} chunk {c}: weight version {version} is not available "
                f"(live version {self.version}, stashed {sorted(stash)})",
                stage=self._stage,
            )
        params = stash[version]
        uses = self._uses_left[c]
        uses[version] -= 1
        if uses[version] <= 0:
            del stash[version]  # in-flight graphs keep the tensors until their backward
        return params

    def snapshot(self, c: int, version: int) -> None:
        """Stash the live parameters of chunk c as `version` if a later forward will use it."""
        if self._uses_left[c].get(version, 0) > 0:
            self._stash[c][version] = {
                name: p.detach().clone().requires_grad_(p.requires_grad)
                for name, p in self._modules[c].named_parameters()
            }

    def advance(self, *, snapshot: bool = False) -> None:
        """The optimizer stepped: the live parameters are the next version (`snapshot`: stashed
        now, for the forwards that will use it; under ZeRO they are whole only once gathered)."""
        self.version += 1
        if snapshot and self._delay:
            for c in range(len(self._modules)):
                self.snapshot(c, self.version)
