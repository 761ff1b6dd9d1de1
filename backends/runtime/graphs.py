"""What one stage's forwards leave for their backwards, for `StageRuntime`, and its bytes.

Per (microbatch, chunk): the `Graph` of a forward until its backward is done, or, for a forward
its stage recomputes, only its `KeptInput` until the `Recompute` builds the graph ([Note:
recomputation] in `backends.runtime.recompute`). `num_bytes` counts what they hold on the device
now: each graph's saved activations (measured by `backends.runtime.memory`) but those of an
offloaded graph, which `host_bytes` counts ([Note: offloading in the runtime] in
`backends.runtime.offload`), and each kept input. `sizes` keeps, per chunk, the most one
microbatch's forward saved and its input took: what `schedcc run --trace` records for a
byte-limited search ([Note: a trace's bytes] in `backends.run.report`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from schedcc.errors import RuntimeInstructionError

if TYPE_CHECKING:
    from schedcc.backends.runtime.offload import OffloadedSaved
    from schedcc.backends.runtime.recompute import KeptInput
    from schedcc.ir import Instruction

__all__ = ["Graph", "Graphs"]


class Graph:
    """What a forward leaves for its backward: the output tensors a gradient comes back for
    (`roots`; the scaled loss on the last segment), the input's grad-requiring leaves, the
    parameter tensors it ran with, once `BackwardInput` ran, the roots' gradients, and for a
    forward its stage offloads, its saved tensors (`saved`)."""

    __slots__ = ("carried", "grads", "leaves", "num_bytes", "params", "roots", "saved")

    def __init__(
        self,
        roots: list[torch.Tensor],
        leaves: list[torch.Tensor],
        params: list[torch.Tensor],
        num_bytes: int,
        saved: OffloadedSaved | None = None,
    ) -> None:
        self.roots = roots
        self.leaves = leaves
        self.params = params
        self.num_bytes = num_bytes
        self.grads: list | None = None
        self.saved = saved
        #: how many of `roots` and of `leaves`, the last ones, are a sequence part's carry
        #: (`backends.runtime.carries`)
        self.carried = (0, 0)


class Graphs:
    """The graphs and kept inputs of one stage for one run, keyed by (microbatch, chunk).

    `num_bytes` is the activation bytes they hold on the device now, `host_bytes` those of the
    offloaded graphs; `peak` and `peak_host` the most each ever was, and `sizes[c]` the most
    one forward of chunk c saved and its input took (`[activations, inputs]`), kept across runs.
    """

    def __init__(self, stage: int) -> None:
        self._stage = stage
        self.peak = self.peak_host = 0
        self.sizes: dict[int, list[int]] = {}
        self.reset()

    def reset(self) -> None:
        """A new run: nothing held."""
        self.num_bytes = self.host_bytes = 0
        self._graphs: dict[tuple[int, int], Graph] = {}
        self._kept: dict[tuple[int, int], KeptInput] = {}

    def hold(self, i: int, c: int, graph: Graph, *, replacing: KeptInput | None = None) -> None:
        """Hold the graph of microbatch i's forward of chunk c (`replacing`: the kept input
        it was recomputed from, whose bytes the graph now holds what it needs of)."""
        if replacing is not None:
            self.num_bytes -= replacing.num_bytes
        self._graphs[i, c] = graph
        self._add(graph.num_bytes)
        self._sized(c, 0, graph.num_bytes)

    def took(self, c: int, num_bytes: int) -> None:
        """A forward of chunk c ran on an input of `num_bytes` (`sizes`)."""
        self._sized(c, 1, num_bytes)

    def _sized(self, c: int, field: int, num_bytes: int) -> None:
        sizes = self.sizes.setdefault(c, [0, 0])
        sizes[field] = max(sizes[field], num_bytes)

    def graph(self, op: Instruction) -> Graph:
        """The graph a backward piece `op` differentiates."""
        graph = self._graphs.get((op.microbatch, op.chunk))
        if graph is None:
            raise RuntimeInstructionError(
                f"stage {self._stage}: {op} has no forward graph (its forward has not run, or it "
                "was already backwarded)",
                stage=self._stage,
            )
        if graph.saved is not None:
            if graph.saved.on_host:
                raise self._refused(op, "its activations are offloaded: its Reload must run first")
            graph.saved.ready()
        return graph

    def offloaded(self, op: Instruction) -> OffloadedSaved:
        """The saved tensors an `Offload` moves to the host; their bytes leave the device."""
        saved = self._saved(op, on_host=False)
        graph = self._graphs[op.microbatch, op.chunk]
        self.num_bytes -= graph.num_bytes
        self.host_bytes += graph.num_bytes
        self.peak_host = max(self.peak_host, self.host_bytes)
        return saved

    def reloaded(self, op: Instruction) -> OffloadedSaved:
        """The saved tensors a `Reload` brings back; their bytes are on the device again."""
        saved = self._saved(op, on_host=True)
        graph = self._graphs[op.microbatch, op.chunk]
        self.host_bytes -= graph.num_bytes
        self._add(graph.num_bytes)
        return saved

    def _saved(self, op: Instruction, *, on_host: bool) -> OffloadedSaved:
        graph = self._graphs.get((op.microbatch, op.chunk))
        if graph is None or graph.saved is None:
            raise self._refused(
                op,
                "has no offloadable forward graph (its forward has not run here as an offloaded "
                "one, is recomputed, or was already backwarded)",
            )
        if graph.saved.on_host != on_host:
            where = "already on the host" if graph.saved.on_host else "not offloaded"
            raise self._refused(op, f"finds its activations {where}")
        return graph.saved

    def _refused(self, op: Instruction, why: str) -> RuntimeInstructionError:
        return RuntimeInstructionError(f"stage {self._stage}: {op} {why}", stage=self._stage)

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
