"""`StageRuntime`: what each instruction does to tensors on one stage (shared by every backend).

A backend owns communication only: it feeds received tensors in through `incoming`, takes the
tensors to send from `outgoing`, and hands every compute and update instruction to `run`. Data
parallelism reaches the runtime through a `Collectives` object (all-reduce, reduce-scatter,
all-gather over this stage's data-parallel group).

[Note: what the runtime keeps] Per (microbatch, chunk): the input of the segment (received, handed
over from a segment on this stage, or the microbatch itself on segment 0), the graph of its forward
(output, input, the parameter tensors it ran with) until its backward is done, the input gradient
to send, and the output gradient received. Per chunk: the live parameters (the module's own, the
latest version), the weight versions in-flight forwards still need (weight_delay >= 1, weight
stashing), and under ZeRO a flat shard parameter that the optimizer steps.

[Note: exactness] The last segment scales its loss by 1/(m * dp), gradients are accumulated into
the live parameters' `.grad` (by autograd itself, or from `torch.autograd.grad` of the stashed
weights under weight stashing), and the reductions sum in rank order, so a pipelined step equals a
non-pipelined step on the concatenated global batch up to float rounding.

[Note: activation bytes are measured once] Saved-tensor hooks count the bytes a forward saves for
its backward (views count their own bytes, a tensor saved twice counts once, parameters do not
count). A Python hook on every saved tensor costs time, so the count is taken on the first forward
of each signature (chunk, input shape/dtype/strides/requires_grad, the target's for the loss, the
module's training flag, grad mode) and reused for later forwards with the same signature: exact
for any module whose saved tensors depend on shapes, not on values (a data-dependent module, e.g.
a router that drops tokens, gets the first microbatch's count).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from schedcc.backends.state import canonical_optimizer_state, layout_optimizer_state
from schedcc.errors import CheckpointError, ScheduleConfigError, ScheduleError
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
    SendActivation,
    SendGrad,
)

if TYPE_CHECKING:
    from schedcc.program import Program

__all__ = ["Collectives", "RuntimeInstructionError", "SoloCollectives", "StageRuntime"]


class RuntimeInstructionError(ScheduleError):
    """An instruction the runtime cannot execute (unknown, or its inputs are missing)."""


class Collectives(Protocol):
    """Data-parallel communication over one stage's replicas, supplied by the backend."""

    rank: int
    size: int

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """In-place SUM across the data-parallel ranks."""

    def reduce_scatter(self, flat: torch.Tensor) -> torch.Tensor:
        """SUM of `flat` (length `size * shard`) across ranks; returns this rank's shard."""

    def all_gather(self, shard: torch.Tensor) -> torch.Tensor:
        """The concatenation, in rank order, of every rank's `shard` (flat)."""


class SoloCollectives:
    """The collectives of a single replica (data_parallel == 1): identities."""

    rank = 0
    size = 1

    def all_reduce(self, tensor: torch.Tensor) -> None:
        return None

    def reduce_scatter(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.clone()

    def all_gather(self, shard: torch.Tensor) -> torch.Tensor:
        return shard.clone()


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
        self._shards: list[nn.Parameter] = []
        if self._zero:
            self._shards = [self._make_shard(c) for c in range(len(self.modules))]
            self.optimizer: torch.optim.Optimizer | None = optimizer(self._shards)
        else:
            params = [p for mod in self.modules for p in mod.parameters()]
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
        }
        self.peak_activation_bytes = 0
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
        self._version = 0
        self._versions: list[dict[int, dict[str, torch.Tensor]]] = [{} for _ in self.modules]
        self._uses_left = self._count_version_uses()
        # the live parameters by chunk, looked up once per run instead of once per forward
        self._live = [dict(mod.named_parameters()) for mod in self.modules]
        self._saved_bytes: dict[tuple, int] = {}
        if self._delay:
            for c in range(len(self.modules)):
                self._snapshot(c, 0)

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
        if inputs is not None:
            self._batch_inputs[batch] = list(inputs)
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
        """What a checkpoint keeps of this stage between program runs (see `backends.state`)."""
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
        numels = [[p.numel() for p in mod.parameters()] for mod in self.modules]
        ranks = [state.get("rank") for state in saved]
        if ranks != list(range(len(saved))) or any(
            state.get("data_parallel") != len(saved) for state in saved
        ):
            raise CheckpointError(
                f"stage {self.stage}: the checkpoint's data-parallel shards are incomplete "
                f"(ranks {ranks})"
            )
        if any(state.get("numels") != numels for state in saved):
            raise CheckpointError(
                f"stage {self.stage}: the checkpoint's parameters have sizes "
                f"{saved[0].get('numels')}, this model's {numels}: it was saved from another model"
            )

    def load_state_dict(self, saved: Sequence[dict[str, Any]]) -> None:
        """Restore from every old data-parallel rank's state of this stage (in rank order).

        The old layout may differ in data-parallel degree or ZeRO: the optimizer state is
        re-sharded (exact for elementwise optimizers such as SGD and Adam).
        """
        self.check_state(saved)
        for mod, state in zip(self.modules, saved[0]["modules"]):
            mod.load_state_dict(state)
        if self._zero:
            with torch.no_grad():
                for c, shard in enumerate(self._shards):
                    size, rank = shard.numel(), self.collectives.rank
                    flat = self._flat_params(c, size * self.collectives.size)
                    shard.copy_(flat[rank * size : (rank + 1) * size])
        if self.optimizer is None:
            return
        same = saved[0]["zero"] == self._zero and len(saved) == self.collectives.size
        if same:
            self.optimizer.load_state_dict(saved[self.collectives.rank]["optimizer"])
            return
        numels = saved[0]["numels"]
        target = self.optimizer.state_dict()
        target["state"] = layout_optimizer_state(
            canonical_optimizer_state(saved, numels),
            numels,
            [[p.shape for p in mod.parameters()] for mod in self.modules],
            zero=self._zero,
            rank=self.collectives.rank,
            size=self.collectives.size,
        )
        for group, old in zip(target["param_groups"], saved[0]["optimizer"]["param_groups"]):
            group.update({key: value for key, value in old.items() if key != "params"})
        self.optimizer.load_state_dict(target)

    # -- compute --------------------------------------------------------------------------------

    def _forward(self, op: Forward) -> None:
        i, c = op.microbatch, op.chunk
        k = self._segment[c]
        x = self._forward_input(i, c, k)
        params = self._params_for(c, self._version_of(i))
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
        module = self.modules[c]
        signature = self._signature(c, k, i, x)
        num_bytes = self._saved_bytes.get(signature)
        if num_bytes is not None:  # see [Note: activation bytes are measured once]
            out = self._call(module, params, x)
            if k == self._last:
                out = self._loss(i, out)
            return _Graph(out, x, list(params.values()), num_bytes)
        skip = {t.untyped_storage().data_ptr() for t in params.values()}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            # A view counts its own bytes (a microbatch is a view of the whole batch); a tensor
            # saved twice counts once; parameters are weights, not activations.
            if t.untyped_storage().data_ptr() not in skip:
                seen[t.data_ptr()] = max(seen.get(t.data_ptr(), 0), t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = self._call(module, params, x)
            if k == self._last:
                out = self._loss(i, out)
        num_bytes = self._saved_bytes[signature] = sum(seen.values())
        return _Graph(out, x, list(params.values()), num_bytes)

    def _call(self, module: nn.Module, params, x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(module, params, (x,)) if self._delay else module(x)

    def _signature(self, c: int, k: int, i: int, x: torch.Tensor) -> tuple:
        """What the saved tensors of a forward depend on (see the note in `_run_segment`)."""
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
            self._accumulate(op.chunk, grads)
        else:
            self._backward_into_grads(graph.output, grad_out, [x, *graph.params])
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
            self._accumulate(op.chunk, grads)
        else:
            self._backward_into_grads(output, grad_out, graph.params)
        self._free(op)

    @staticmethod
    def _backward_into_grads(output, grad_out, leaves: list[torch.Tensor]) -> None:
        """Accumulate d output / d leaf into each leaf's `.grad` (the leaves needing gradients).

        [Note: autograd accumulates] `torch.autograd.backward(..., inputs=leaves)` does in the
        engine what `_accumulate` does in Python: a leaf without `.grad` takes the gradient, one
        with `.grad` adds it in place; so the result is bitwise the same, without the clone and
        the per-parameter Python loop. A segment's input is a fresh leaf per microbatch, so its
        `.grad` is exactly its input gradient.
        """
        wrt = [t for t in leaves if t.requires_grad]
        if wrt:
            torch.autograd.backward(output, grad_out, inputs=wrt)

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

    def _accumulate(self, c: int, grads: Sequence[torch.Tensor | None]) -> None:
        for p, g in zip(self.modules[c].parameters(), grads):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g.detach().clone()
            else:
                p.grad.add_(g)

    # -- weight versions (weight_delay >= 1) ----------------------------------------------------

    def _version_of(self, microbatch: int) -> int:
        return max(0, microbatch // self._m - self._delay)

    def _count_version_uses(self) -> list[dict[int, int]]:
        uses: list[dict[int, int]] = [defaultdict(int) for _ in self.modules]
        for op in self.program.stages[self.stage]:
            if type(op) is Forward:
                uses[op.chunk][self._version_of(op.microbatch)] += 1
        return uses

    def _params_for(self, c: int, version: int) -> dict[str, torch.Tensor]:
        if not self._delay:
            return self._live[c]
        stash = self._versions[c]
        if version not in stash:
            raise RuntimeInstructionError(
                f"stage {self.stage} chunk {c}: weight version {version} is not available "
                f"(live version {self._version}, stashed {sorted(stash)})",
                stage=self.stage,
            )
        params = stash[version]
        uses = self._uses_left[c]
        uses[version] -= 1
        if uses[version] <= 0:
            del stash[version]  # in-flight graphs keep the tensors until their backward
        return params

    def _snapshot(self, c: int, version: int) -> None:
        """Stash the live parameters of chunk c as `version` if a later forward will use it."""
        if self._uses_left[c].get(version, 0) > 0:
            self._versions[c][version] = {
                name: p.detach().clone().requires_grad_(p.requires_grad)
                for name, p in self.modules[c].named_parameters()
            }

    # -- updates --------------------------------------------------------------------------------

    def _flat_grads(self, c: int, length: int) -> torch.Tensor:
        params = list(self.modules[c].parameters())
        parts = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params
        ]
        flat = torch.cat(parts) if parts else torch.zeros(0)
        if length > flat.numel():
            flat = torch.cat([flat, flat.new_zeros(length - flat.numel())])
        return flat

    def _numel(self, c: int) -> int:
        return sum(p.numel() for p in self.modules[c].parameters())

    def _shard_size(self, c: int) -> int:
        return max(1, math.ceil(self._numel(c) / self.collectives.size))

    def _make_shard(self, c: int) -> nn.Parameter:
        size = self._shard_size(c)
        rank = self.collectives.rank
        with torch.no_grad():
            flat = self._flat_params(c, size * self.collectives.size)
            return nn.Parameter(flat[rank * size : (rank + 1) * size].clone())

    def _flat_params(self, c: int, length: int) -> torch.Tensor:
        params = list(self.modules[c].parameters())
        flat = torch.cat([p.detach().reshape(-1) for p in params]) if params else torch.zeros(0)
        return torch.cat([flat, flat.new_zeros(length - flat.numel())])

    def _reduce_grads(self, op: ReduceGrads) -> None:
        c = op.chunk
        coll = self.collectives
        if not self._zero:
            flat = self._flat_grads(c, 0)
            coll.all_reduce(flat)
            self._unflatten_into_grads(c, flat)
            return
        shard = coll.reduce_scatter(self._flat_grads(c, self._shard_size(c) * coll.size))
        target = self._shards[c]
        if target.grad is None:
            target.grad = shard.detach().clone()
        else:
            target.grad.add_(shard)
        for p in self.modules[c].parameters():
            p.grad = None  # reduced: what accumulates next is new

    def _unflatten_into_grads(self, c: int, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.modules[c].parameters():
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n

    def _optimizer_step(self, op: OptimizerStep) -> None:
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        for mod in self.modules:
            mod.zero_grad(set_to_none=True)
        self._version += 1
        if self._delay and not self._zero:
            for c in range(len(self.modules)):
                self._snapshot(c, self._version)

    def _gather_params(self, op: GatherParams) -> None:
        c = op.chunk
        if not self._zero:
            raise RuntimeInstructionError(
                f"stage {self.stage}: {op} needs ZeRO (compile with zero=1 or 2)",
                stage=self.stage,
            )
        full = self.collectives.all_gather(self._shards[c].detach())
        offset = 0
        with torch.no_grad():
            for p in self.modules[c].parameters():
                n = p.numel()
                p.copy_(full[offset : offset + n].view_as(p))
                offset += n
        if self._delay:
            self._snapshot(c, self._version)
