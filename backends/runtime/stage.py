"""`StageRuntime`: what each instruction does to tensors on one stage (shared by every backend).

A backend owns communication only: it feeds received tensors in through `incoming`, takes the
tensors to send from `outgoing`, and hands every compute and update instruction to `run`. Data
parallelism reaches the runtime through a `Collectives` object (all-reduce, reduce-scatter,
all-gather over this stage's data-parallel group; `backends.runtime.collectives`).

Helpers it delegates to: `backends.runtime.versions` (the stashed weight versions),
`backends.runtime.zero` (the gradient reduction and the ZeRO shards), `backends.runtime.grads`
(gradients into `.grad`), `backends.runtime.memory` (the activation bytes a forward saves),
`backends.checkpoint.restore` (loading a checkpoint's state). The file stays over ~400 lines on
purpose: one short handler per instruction, in one class, so what each does reads in one place.

[Note: what the runtime keeps] Per (microbatch, chunk): the input of the segment (received, handed
over from a segment on this stage, or the microbatch itself on segment 0), the graph of its forward
(output, input, the parameter tensors it ran with) until its backward is done, the input gradient
to send, and the output gradient received. Per chunk: the live parameters (the module's own, the
latest version), the weight versions in-flight forwards still need (weight_delay >= 1, weight
stashing), and under ZeRO a flat shard parameter that the optimizer steps.

[Note: exactness] The last segment scales its loss by 1/(m * dp), gradients are accumulated into
the live parameters' `.grad` (by autograd itself, or from `torch.autograd.grad` of the stashed
weights under weight stashing: [Note: autograd accumulates] in `backends.runtime.grads`), and the
reductions sum in rank order, so a pipelined step equals a non-pipelined step on the concatenated
global batch up to float rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from schedcc.backends.checkpoint.restore import check_saved, load_optimizer
from schedcc.backends.runtime.collectives import Collectives, SoloCollectives
from schedcc.backends.runtime.grads import accumulate, backward_into_grads
from schedcc.backends.runtime.memory import SavedBytes
from schedcc.backends.runtime.tied import StageTies
from schedcc.backends.runtime.versions import WeightVersions
from schedcc.backends.runtime.zero import Reducer
from schedcc.errors import RuntimeInstructionError, ScheduleConfigError
from schedcc.ir import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    GatherParams,
    Instruction,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTied,
    SendActivation,
    SendGrad,
)

if TYPE_CHECKING:
    from schedcc.program import Program

__all__ = ["StageRuntime"]


class _Graph:
    """What a forward leaves for its backward: output, input and the parameter tensors used."""

    __slots__ = ("input", "num_bytes", "output", "params")

    def __init__(self, output, input, params, num_bytes):
        self.output = output
        self.input = input
        self.params = params
        self.num_bytes = num_bytes


class StageRuntime:
    """Executes one stage's compute and update instructions on its segments.

    Args:
        program: the compiled program (its schedule gives shape, placement and weight delay).
        stage: which stage this runtime is.
        modules: the segments this stage holds, indexed by chunk (`len == num_chunks`).
        loss_fn: `loss_fn(output, target) -> scalar`, a mean over the microbatch.
        optimizer: a callable from an iterable of parameters to a `torch.optim.Optimizer`.
        collectives: data-parallel communication; None means `data_parallel == 1`.
        ties: the tied parameters this stage holds (`backends.runtime.tied`); None for none.
        tie_reduce: `tie_reduce(group, tensor)` sums a tensor over the stages of tied group
            `group` in place, for `ReduceTied` (the distributed backend's).

    Raises:
        ScheduleConfigError: wrong number of modules, or collectives whose size differs from the
            program's data_parallel.

    Attributes:
        activation_bytes: bytes of saved activations held now (saved-tensor hooks).
        peak_activation_bytes: the most `activation_bytes` ever was.
    """

    def __init__(
        self,
        program: Program,
        stage: int,
        modules: Sequence[nn.Module],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        optimizer: Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer],
        *,
        collectives: Collectives | None = None,
        ties: StageTies | None = None,
        tie_reduce: Callable[[int, torch.Tensor], None] | None = None,
    ) -> None:
        schedule = program.schedule
        if len(modules) != schedule.num_chunks:
            raise ScheduleConfigError(
                f"stage {stage} holds {schedule.num_chunks} chunk(s) but got {len(modules)} "
                "module(s): pass one module per chunk"
            )
        self.collectives: Collectives = collectives or SoloCollectives()
        if self.collectives.size != program.data_parallel:
            raise ScheduleConfigError(
                f"the program has data_parallel={program.data_parallel} but the collectives span "
                f"{self.collectives.size} rank(s)"
            )
        self.program = program
        self.stage = stage
        self.modules = list(modules)
        self.loss_fn = loss_fn
        self._m = schedule.num_microbatches
        self._delay = schedule.weight_delay
        self._zero = program.zero
        self._segment = [schedule.segment_of(stage, c) for c in range(schedule.num_chunks)]
        self._last = schedule.num_segments - 1
        self._stage_of = [schedule.placement(k)[0] for k in range(schedule.num_segments)]
        self._names = [[n for n, _ in mod.named_parameters()] for mod in self.modules]
        #: the tied parameters this stage holds; the local backend meets its stages for a
        #: `ReduceTied` itself, through `ties.parts` and `ties.apply`
        self.ties, self._tie_reduce = ties, tie_reduce
        #: what the stage trains, by chunk: the modules, with private copies of tied parameters
        #: where another segment trains the caller's ([Note: copies of a tied parameter])
        self._views = ties.views if ties is not None else self.modules
        self._shadowed = [self.modules[c] for c in ties.shadowed] if ties is not None else []
        self._reducer = Reducer(self._views, self.collectives, zero=self._zero)
        if self._zero:
            self.optimizer: torch.optim.Optimizer | None = optimizer(self._reducer.shards)
        else:
            params = [p for mod in self._views for p in mod.parameters()]
            # A stage without parameters (e.g. a lone activation) has nothing to step.
            self.optimizer = optimizer(params) if params else None
        self._dispatch: dict[type, Callable[[Any], None]] = {
            Forward: self._forward,
            Backward: self._backward,
            BackwardInput: self._backward_input,
            BackwardWeight: self._backward_weight,
            ReduceGrads: self._reduce_grads,
            OptimizerStep: self._optimizer_step,
            GatherParams: self._gather_params,
            ReduceTied: self._reduce_tied,
        }
        self.peak_activation_bytes = 0
        #: bytes a forward saves, by signature: kept across runs ([Note: activation bytes are
        #: measured once])
        self._saved_bytes = SavedBytes()
        self.reset()

    # -- the backend's side ---------------------------------------------------------------------

    def reset(self) -> None:
        """Start a new run of the program: clear per-run state; the live weights are version 0."""
        self._loss_parts: dict[int, list[torch.Tensor]] = {}
        self.activation_bytes = 0
        self._batch_inputs: dict[int, Sequence[torch.Tensor]] = {}
        self._batch_targets: dict[int, Sequence[torch.Tensor]] = {}
        self._inputs: dict[tuple[int, int], torch.Tensor] = {}
        self._output_grads: dict[tuple[int, int], torch.Tensor] = {}
        self._to_send: dict[tuple[str, int, int], torch.Tensor] = {}
        self._handoff: dict[tuple[str, int, int], torch.Tensor] = {}  # keyed by segment
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._versions = WeightVersions(self.program, self.stage, self._views)

    @property
    def losses(self) -> dict[int, float]:
        """`losses[batch]`: the batch's loss, the mean over its microbatches (last stage only).

        The microbatch losses stay tensors until read here, so a forward never waits for the
        device to hand a number back (no sync per microbatch on CUDA).
        """
        means = {}
        for batch, parts in self._loss_parts.items():
            total = 0.0
            for part in parts:  # in forward order, as a running float sum
                total = total + part.item() / self._m
            means[batch] = total
        return means

    def load_batch(
        self,
        batch: int,
        inputs: Sequence[torch.Tensor] | None,
        targets: Sequence[torch.Tensor] | None,
    ) -> None:
        """Give the runtime the `m` microbatches of `batch` (an index within the program).

        `inputs` is read only on the stage holding segment 0, `targets` only on the stage
        holding the last segment; other stages may pass None.
        """
        if inputs is not None:  # detached: a backward stops at the batch (no graph behind it)
            self._batch_inputs[batch] = [x.detach() for x in inputs]
        if targets is not None:
            self._batch_targets[batch] = list(targets)

    def run(self, op: Instruction) -> None:
        """Execute a compute or update instruction."""
        handler = self._dispatch.get(type(op))
        if handler is None:
            raise RuntimeInstructionError(
                f"StageRuntime (stage {self.stage}) cannot run {op} ({type(op).__name__}): "
                "run() takes compute and update instructions; comm goes through "
                "outgoing()/incoming()",
                stage=self.stage,
            )
        handler(op)

    def outgoing(self, op: Instruction) -> torch.Tensor:
        """The tensor a `SendActivation` or `SendGrad` sends (contiguous, detached)."""
        if type(op) is SendActivation:
            key = ("A", op.microbatch, op.chunk)
        elif type(op) is SendGrad:
            key = ("G", op.microbatch, op.chunk)
        else:
            raise RuntimeInstructionError(
                f"StageRuntime.outgoing (stage {self.stage}) got {op}: only SendActivation and "
                "SendGrad send a tensor",
                stage=self.stage,
            )
        if key not in self._to_send:
            raise RuntimeInstructionError(
                f"stage {self.stage}: {op} has nothing to send yet (its compute has not run)",
                stage=self.stage,
            )
        return self._to_send.pop(key)

    def incoming(self, op: Instruction, tensor: torch.Tensor) -> None:
        """Take the tensor a `RecvActivation` or `RecvGrad` received."""
        key = (op.microbatch, op.chunk)  # type: ignore[attr-defined]
        if type(op) is RecvActivation:
            self._inputs[key] = tensor.detach().requires_grad_(True)
        elif type(op) is RecvGrad:
            self._output_grads[key] = tensor.detach()
        else:
            raise RuntimeInstructionError(
                f"StageRuntime.incoming (stage {self.stage}) got {op}: only RecvActivation and "
                "RecvGrad receive a tensor",
                stage=self.stage,
            )

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of this stage between runs (see `backends.checkpoint.state`)."""
        return {
            "modules": [mod.state_dict() for mod in self.modules],
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "zero": self._zero,
            "rank": self.collectives.rank,
            "data_parallel": self.collectives.size,
            "numels": [[p.numel() for p in mod.parameters()] for mod in self.modules],
        }

    def check_state(self, saved: Sequence[dict[str, Any]]) -> None:
        """Raise `CheckpointError` unless `saved` (every old rank's state, in rank order) fits."""
        check_saved(self.stage, self.modules, saved)

    def load_state_dict(self, saved: Sequence[dict[str, Any]]) -> None:
        """Restore from every old data-parallel rank's state of this stage (in rank order).

        The old layout may differ in data-parallel degree or ZeRO: the optimizer state is
        re-sharded (exact for elementwise optimizers such as SGD and Adam).
        """
        self.check_state(saved)
        for mod, state in zip(self.modules, saved[0]["modules"]):
            mod.load_state_dict(state)
        if self.ties is not None:
            self.ties.refresh()
        self._reducer.refresh_shards()
        if self.optimizer is None:
            return
        coll = self.collectives
        load_optimizer(
            self.optimizer, saved, self.modules, zero=self._zero, rank=coll.rank, size=coll.size
        )

    # -- compute --------------------------------------------------------------------------------

    def _forward(self, op: Forward) -> None:
        i, c = op.microbatch, op.chunk
        k = self._segment[c]
        x = self._forward_input(i, c, k)
        params = self._versions.params_for(c, self._versions.version_of(i))
        graph = self._run_segment(c, k, i, x, params)
        self._graphs[i, c] = graph
        self.activation_bytes += graph.num_bytes
        self.peak_activation_bytes = max(self.peak_activation_bytes, self.activation_bytes)
        if k < self._last:
            out = graph.output.detach()
            if self._stage_of[k + 1] == self.stage:
                self._handoff["A", i, k] = out
            else:
                self._to_send["A", i, c] = out.contiguous()

    def _run_segment(self, c, k, i, x, params) -> _Graph:
        def forward() -> torch.Tensor:
            out = self._call(self.modules[c], params, x)
            return self._loss(i, out) if k == self._last else out

        signature = self._signature(c, k, i, x)
        out, num_bytes = self._saved_bytes.run(signature, params.values(), forward)
        return _Graph(out, x, list(params.values()), num_bytes)

    def _call(self, module: nn.Module, params, x: torch.Tensor) -> torch.Tensor:
        if self._delay or module in self._shadowed:
            return torch.func.functional_call(module, params, (x,))
        return module(x)

    def _signature(self, c: int, k: int, i: int, x: torch.Tensor) -> tuple:
        """What the saved tensors of a forward depend on ([Note: activation bytes are measured
        once] in `backends.runtime.memory`)."""
        target = None
        if k == self._last:
            batch, local = divmod(i, self._m)
            t = self._batch_targets[batch][local]
            target = (t.shape, t.dtype, t.stride())
        training = self.modules[c].training
        grad_mode = torch.is_grad_enabled()
        return (c, x.shape, x.dtype, x.stride(), x.requires_grad, target, training, grad_mode)

    def _loss(self, i: int, out: torch.Tensor) -> torch.Tensor:
        batch, local = divmod(i, self._m)
        target = self._batch_targets[batch][local]
        try:
            loss = self.loss_fn(out, target)
        except (RuntimeError, ValueError) as error:
            raise ScheduleConfigError(
                f"loss_fn(output of shape {tuple(out.shape)}, target of shape "
                f"{tuple(target.shape)}) failed: {error}; check the targets' shape"
            ) from error
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ScheduleConfigError(
                f"loss_fn must return a scalar tensor (a mean over the microbatch), got {shape}: "
                "reduce it, e.g. with reduction='mean'"
            )
        self._loss_parts.setdefault(batch, []).append(loss.detach())  # read once, see `losses`
        return loss / (self._m * self.collectives.size)

    def _forward_input(self, i: int, c: int, k: int) -> torch.Tensor:
        if k == 0:
            batch, local = divmod(i, self._m)
            return self._batch_inputs[batch][local]
        if self._stage_of[k - 1] == self.stage:
            return self._handoff.pop(("A", i, k - 1)).requires_grad_(True)
        return self._take(self._inputs, (i, c), "activation", i, c)

    def _output_grad(self, i: int, c: int) -> torch.Tensor | None:
        k = self._segment[c]
        if k == self._last:
            return None
        if self._stage_of[k + 1] == self.stage:
            return self._handoff.pop(("G", i, k + 1))
        return self._take(self._output_grads, (i, c), "gradient", i, c)

    def _take(self, store, key, what, i, c) -> torch.Tensor:
        if key not in store:
            raise RuntimeInstructionError(
                f"stage {self.stage}: microbatch {i} chunk {c} needs a received {what} that has "
                "not arrived; the program must receive it before the compute",
                stage=self.stage,
            )
        return store.pop(key)

    def _backward(self, op: Backward) -> None:
        graph = self._graph(op)
        grad_out = self._output_grad(op.microbatch, op.chunk)
        x = graph.input
        if self._delay:  # the graph ran on stashed weights: their gradients go to the live ones
            wrt = ([x] if x.requires_grad else []) + graph.params
            grads = torch.autograd.grad(graph.output, wrt, grad_out, allow_unused=True)
            if x.requires_grad:
                self._emit_input_grad(op, x, grads[0])
                grads = grads[1:]
            accumulate(self._views[op.chunk].parameters(), grads)
        else:
            backward_into_grads(graph.output, grad_out)
            if x.requires_grad:
                self._emit_input_grad(op, x, x.grad)
        self._free(op)

    def _backward_input(self, op: BackwardInput) -> None:
        graph = self._graph(op)
        grad_out = self._output_grad(op.microbatch, op.chunk)
        graph.output = (graph.output, grad_out)  # what BackwardWeight differentiates
        if graph.input.requires_grad:
            (grad,) = torch.autograd.grad(
                graph.output[0], [graph.input], grad_out, retain_graph=True, allow_unused=True
            )
            self._emit_input_grad(op, graph.input, grad)

    def _backward_weight(self, op: BackwardWeight) -> None:
        graph = self._graph(op)
        if not isinstance(graph.output, tuple):
            raise RuntimeInstructionError(
                f"stage {self.stage}: {op} runs before its BackwardInput",
                stage=self.stage,
            )
        output, grad_out = graph.output
        if self._delay:
            grads = torch.autograd.grad(output, graph.params, grad_out, allow_unused=True)
            accumulate(self._views[op.chunk].parameters(), grads)
        else:
            backward_into_grads(output, grad_out, graph.params)
        self._free(op)

    def _graph(self, op) -> _Graph:
        graph = self._graphs.get((op.microbatch, op.chunk))
        if graph is None:
            raise RuntimeInstructionError(
                f"stage {self.stage}: {op} has no forward graph (its forward has not run, or it "
                "was already backwarded)",
                stage=self.stage,
            )
        return graph

    def _free(self, op) -> None:
        graph = self._graphs.pop((op.microbatch, op.chunk))
        self.activation_bytes -= graph.num_bytes

    def _emit_input_grad(self, op, x: torch.Tensor, grad: torch.Tensor | None) -> None:
        i, c = op.microbatch, op.chunk
        k = self._segment[c]
        grad = torch.zeros_like(x) if grad is None else grad.detach()
        if self._stage_of[k - 1] == self.stage:
            self._handoff["G", i, k] = grad
        else:
            self._to_send["G", i, c] = grad.contiguous()

    # -- updates --------------------------------------------------------------------------------

    def _reduce_grads(self, op: ReduceGrads) -> None:
        self._reducer.reduce(op.chunk)

    def _reduce_tied(self, op: ReduceTied) -> None:
        if self.ties is None or self._tie_reduce is None:
            raise RuntimeInstructionError(
                f"stage {self.stage}: {op} needs the tied parameters and a tie collective "
                "(the engines give them for a program compiled with tied=...)",
                stage=self.stage,
            )
        self.ties.reduce(op.tie, self._tie_reduce)

    def _optimizer_step(self, op: OptimizerStep) -> None:
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        for mod in self._views:
            mod.zero_grad(set_to_none=True)
        self._versions.advance()
        if self._delay and not self._zero:
            for c in range(len(self.modules)):
                self._versions.snapshot(c, self._versions.version)

    def _gather_params(self, op: GatherParams) -> None:
        c = op.chunk
        if not self._zero:
            raise RuntimeInstructionError(
                f"stage {self.stage}: {op} needs ZeRO (compile with zero=1 or 2)",
                stage=self.stage,
            )
        self._reducer.gather(c)
        if self._delay:
            self._versions.snapshot(c, self._versions.version)
