"""What one stage's forwards leave for their backwards, for `StageRuntime`, and its bytes.

Per (microbatch, chunk): the `Graph` of a forward until its backward is done, or, for a forward
its stage recomputes, only its `KeptInput` until the `Recompute` builds the graph ([Note:
recomputation] in `backends.runtime.recompute`). `num_bytes` counts what they hold now: each
graph's saved activations (measured by `backends.runtime.memory`) and each kept input.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from schedcc.errors import RuntimeInstructionError

if TYPE_CHECKING:
    from schedcc.backends.runtime.recompute import KeptInput
    from schedcc.ir import Instruction

__all__ = ["Graph", "Graphs"]


class Graph:
    """What a forward leaves for its backward: the output tensors a gradient comes back for
    (`roots`; the scaled loss on the last segment), the input's grad-requiring leaves, the
    parameter tensors it ran with, and once `BackwardInput` ran, the roots' gradients."""

    __slots__ = ("carried", "grads", "leaves", "num_bytes", "params", "roots")

    def __init__(
        self,
        roots: list[torch.Tensor],
        leaves: list[torch.Tensor],
        params: list[torch.Tensor],
        num_bytes: int,
    ) -> None:
        self.roots = roots
        self.leaves = leaves
        self.params = params
        self.num_bytes = num_bytes
        self.grads: list | None = None
        #: how many of `roots` and of `leaves`, the last ones, are a sequence part's carry
        #: (`backends.runtime.carries`)
        self.carried = (0, 0)


class Graphs:
    """The graphs and kept inputs of one stage for one run, keyed by (microbatch, chunk).

    `num_bytes` is the activation bytes they hold now; `peak` the most it ever was (kept across
    runs).
    """

    def __init__(self, stage: int) -> None:
        self._stage = stage
        self.peak = 0
        self.reset()

    def reset(self) -> None:
        """A new run: nothing held."""
        self.num_bytes = 0
        self._graphs: dict[tuple[int, int], Graph] = {}
        self._kept: dict[tuple[int, int], KeptInput] = {}

    def hold(self, i: int, c: int, graph: Graph, *, replacing: KeptInput | None = None) -> None:
        """Hold the graph of microbatch i's forward of chunk c (`replacing`: the kept input
        it was recomputed from, whose bytes the graph now holds what it needs of)."""
        if replacing is not None:
            self.num_bytes -= replacing.num_bytes
        self._graphs[i, c] = graph
        self._add(graph.num_bytes)

    def graph(self, op: Instruction) -> Graph:
        """The graph a backward piece `op` differentiates."""
        graph = self._graphs.get((op.microbatch, op.chunk))
        if graph is None:
            raise RuntimeInstructionError(
                f"stage {self._stage}: {op} has no forward graph (its forward has not run, or it "
                "was already backwarded)",
                stage=self._stage,
            )
        return graph

    def free(self, op: Instruction) -> None:
        """`op` finished its forward's backward: drop the graph."""
        graph = self._graphs.pop((op.microbatch, op.chunk))
        self.num_bytes -= graph.num_bytes

    def keep(self, i: int, c: int, kept: KeptInput) -> None:
        """Keep the input of microbatch i's forward of chunk c for its `Recompute`."""
        self._kept[i, c] = kept
        self._add(kept.num_bytes)

    def take_kept(self, op: Instruction) -> KeptInput:
        """The kept input a `Recompute` runs its forward again from (its bytes stay counted
        until `hold` replaces it by the graph)."""
        kept = self._kept.pop((op.microbatch, op.chunk), None)
        if kept is None:
            raise RuntimeInstructionError(
                f"stage {self._stage}: {op} has no kept input (its forward has not run, did not "
                "run as a recomputed forward, or was already recomputed)",
                stage=self._stage,
            )
        return kept

    def _add(self, num_bytes: int) -> None:
        self.num_bytes += num_bytes
        self.peak = max(self.peak, self.num_bytes)
