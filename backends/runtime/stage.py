"""`StageRuntime`: what each instruction does to tensors on one stage (shared by every backend).

A backend owns communication only: it feeds received messages in through `incoming`, takes the
messages to send from `outgoing` (a boundary value as flat tensors, spec and meta:
`backends.runtime.boundary`), and hands every compute and update instruction to `run`, which
dispatches through a table of one short handler per instruction. Data parallelism reaches the
runtime through a `Collectives` object (all-reduce, reduce-scatter, all-gather over this stage's
data-parallel group; `backends.runtime.collectives`). What a handler needs beyond a few lines
lives in the modules beside this one (docs/design.md lists them): applying a segment in
`backends.runtime.forwards`, what the stage keeps between runs (checkpoint state, ZeRO-3's whole
parameters) in `backends.runtime.stage_state`, the optimizer's builders in
`backends.runtime.optimizers`.

[Note: what the runtime keeps] Per (microbatch, chunk): the input value of the segment (received,
handed over from a segment on this stage, or the microbatch itself on segment 0; `ports`), the
graph of its forward (the output tensors that take a gradient, the input's leaves that do, the
parameter tensors it ran with) until its backward is done (for a forward its stage recomputes,
only its input and RNG states until the `Recompute` builds that graph: [Note: recomputation];
`graphs`), the input gradients to send, and the output gradients received (`ports`). Per chunk:
the live parameters (the module's own, the latest version), the weight versions in-flight
forwards still need (weight_delay >= 1, weight stashing; `versions`), and under ZeRO a flat shard
parameter that the optimizer steps (`zero`).

[Note: exactness] The last segment scales a mean loss by 1/(m * dp) (by its size over the
local batch's, n_j / (N * dp), for microbatches of unequal size: [Note: unequal microbatches]
in `backends.runtime.losses`; a `(loss_sum, count)` loss is divided by the batch's count at the
step instead: [Note: the count divides at the step]; a `schedcc.TokenLoss` by its count before
the backward: [Note: a count known up front]), gradients are accumulated into the live
parameters' `.grad` (by autograd itself, or from `torch.autograd.grad` of the stashed weights
under weight stashing: [Note: autograd accumulates] in `backends.runtime.grads`), and the
reductions sum in rank order, so a pipelined step equals a non-pipelined step on the
concatenated global batch up to float rounding.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from schedcc.backends.runtime.boundary import Message, grad_roots, gradients
from schedcc.backends.runtime.carries import Carries
from schedcc.backends.runtime.clipping import LossScaler, StageNorm
from schedcc.backends.runtime.collectives import Collectives, SoloCollectives
from schedcc.backends.runtime.forwards import SegmentForwards
from schedcc.backends.runtime.grads import full_backward, weight_backward
from schedcc.backends.runtime.graphs import Graph, Graphs
from schedcc.backends.runtime.handlers import Handlers
from schedcc.backends.runtime.losses import LossBook, StageCounts, up_front_count
from schedcc.backends.runtime.offload import CopyLane
from schedcc.backends.runtime.optimizers import build_lr_scheduler, build_optimizer
from schedcc.backends.runtime.ports import Ports
from schedcc.backends.runtime.precision import LOW_PRECISION, Precision
from schedcc.backends.runtime.recompute import (
    KeptInput,
    RngState,
    input_bytes,
    keeping_nothing,
    replaying,
)
from schedcc.backends.runtime.segment_calls import (
    SegmentCall,
    SegmentClock,
    check_compile,
    check_one_value,
    check_recompute_layers,
)
from schedcc.backends.runtime.stage_state import StageState
from schedcc.backends.runtime.tied import StageTies
from schedcc.backends.runtime.versions import WeightVersions
from schedcc.backends.runtime.zero import BUCKET_BYTES, Reducer
from schedcc.errors import RuntimeInstructionError, ScheduleConfigError
from schedcc.ir import (
    COMPUTE,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    GatherParams,
    GradNorm,
    Instruction,
    Offload,
    OptimizerStep,
    OverlappedBackward,
    Recompute,
    ReduceGrads,
    ReduceTied,
    Reload,
    Reshard,
    Unshard,
)
from schedcc.semantics import recomputed

if TYPE_CHECKING:
    from schedcc.program import Program

__all__ = ["StageRuntime"]


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
        norm_reduce: `norm_reduce(tensor)` sums a scalar over the replica's stages in place, in
            stage order, for `GradNorm` (the distributed backend's; the local backend meets
            its stages itself through `norm_part` and `apply_norm`).
        max_grad_norm: clip the whole model's gradient to this norm at `GradNorm`.
        mixed_precision: None, `torch.bfloat16` or `torch.float16` (with dynamic loss scaling):
            compute and boundary tensors in that dtype, parameters, gradients and optimizer
            state in the parameters' own (`backends.runtime.precision`).
        tp_rank: this rank's index in its tensor-parallel group: the norm counts a parameter
            not marked `tensor_model_parallel` (replicated) only on index 0 ([Note: the user's
            tensor parallelism] in `backends.tensor_parallel`).
        bucket_bytes: about how many bytes of gradients each launched data-parallel reduction
            carries ([Note: contiguous gradient buckets] in `backends.runtime.zero`).
        lr_scheduler: `lr_scheduler(optimizer) -> LRScheduler` over the stage's optimizer,
            stepped after each optimizer step that is not skipped (`build_lr_scheduler` in
            `backends.runtime.optimizers`).
        recompute_layers, compile: how each segment is applied (`check_recompute_layers`,
            `check_compile` and `SegmentCall` in `backends.runtime.segment_calls`).

    Raises:
        ScheduleConfigError: wrong number of modules, collectives whose size differs from the
            program's data_parallel, a `bucket_bytes` that is not a positive integer, or (where
            gradients are reduced) a chunk whose parameters differ in dtype or device.
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
        norm_reduce: Callable[[torch.Tensor], None] | None = None,
        max_grad_norm: float | None = None,
        mixed_precision: torch.dtype | None = None,
        tp_rank: int = 0,
        bucket_bytes: int = BUCKET_BYTES,
        lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
        recompute_layers: int | None = None,
        compile: bool | str = False,
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
        #: how each chunk's segment is applied: [Note: recomputing every N layers]
        every, backend = check_recompute_layers(recompute_layers), check_compile(compile, program)
        check_one_value(program, every, backend)
        self._calls = [
            SegmentCall(m, segment=k, recompute_layers=every, compile=backend)
            for m, k in zip(self.modules, self._segment)
        ]
        #: which segments start and end a model replica ([Note: replicas]): inputs and loss
        self._layout = program.tensors.layout
        #: the tied parameters this stage holds; the local backend meets its stages for a
        #: `ReduceTied` itself, through `ties.parts` and `ties.apply`
        self.ties, self._tie_reduce = ties, tie_reduce
        #: what the stage trains, by chunk: the modules, with private copies of tied parameters
        #: where another segment trains the caller's ([Note: copies of a tied parameter])
        self._views = ties.views if ties is not None else self.modules
        self._shadowed = [self.modules[c] for c in ties.shadowed] if ties is not None else []
        #: whether the program reduces this stage's gradients (in `Reducer`'s buffers)
        self._reduces = any(type(op) is ReduceGrads for op in program.stages[stage])
        self._reducer = Reducer(
            self._views,
            self.collectives,
            zero=self._zero,
            release=self._zero == 3,
            bucket_bytes=bucket_bytes,
            reduced=self._reduces,
        )
        #: what the stage's optimizer steps: the views' parameters, or under ZeRO the shards
        params = [p for mod in self._views for p in mod.parameters()]
        self._trained = list(self._reducer.shards) if self._zero else params
        # A stage without parameters (e.g. a lone activation) has nothing to step.
        self.optimizer = build_optimizer(optimizer, self._trained) if self._trained else None
        #: the optimizer's learning-rate schedule, stepped with it (None: none given, or no
        #: optimizer)
        self.lr_scheduler = (
            build_lr_scheduler(lr_scheduler, self.optimizer)
            if lr_scheduler is not None and self.optimizer is not None
            else None
        )
        self._dispatch: dict[type, Callable[[Any], None]] = {
            Forward: self._forward,
            Backward: self._backward,
            BackwardInput: self._backward_input,
            BackwardWeight: self._backward_weight,
            Recompute: self._recompute,
            OverlappedBackward: self._overlapped_backward,
            Offload: self._offload,
            Reload: self._reload,
            ReduceGrads: self._reduce_grads,
            OptimizerStep: self._optimizer_step,
            GatherParams: self._gather_params,
            ReduceTied: self._reduce_tied,
            Unshard: self._unshard,
            Reshard: self._reshard,
            GradNorm: self._grad_norm,
        }
        device = next((p.device for m in self.modules for p in m.parameters()), None)
        #: the user's handlers, and the overlapped pairs ([Note: custom handlers] in
        #: `backends.runtime.handlers`)
        self.handlers = Handlers(
            stage, program.stages[stage], self.modules, device or torch.device("cpu")
        )
        low = mixed_precision if mixed_precision in LOW_PRECISION else None  # float32: none
        self.precision = Precision(low, device)
        scaler = LossScaler() if mixed_precision == torch.float16 else None
        #: the stage's side of `GradNorm` (`backends.runtime.clipping`)
        self.norm = StageNorm(
            max_grad_norm,
            scaler,
            views=self._views,
            shards=self._reducer.shards if self._zero else None,
            numels=[[shape.numel() for shape in shapes] for shapes in self._reducer.shapes],
            collectives=self.collectives,
            later_copies=ties.later_copies if ties is not None else (),
            tp_rank=tp_rank,
            device=device or torch.device("cpu"),
        )
        self._norm_reduce = norm_reduce
        #: what the stage keeps between runs: its checkpoint state and skipped steps, ZeRO-3's
        #: whole parameters (`backends.runtime.stage_state`)
        self.state = StageState(
            program,
            stage,
            self.modules,
            self.optimizer,
            self._reducer,
            ties=ties,
            scaler=scaler,
            lr_scheduler=self.lr_scheduler,
            collectives=self.collectives,
        )
        #: what forwards leave for their backwards, and the activation bytes it holds
        self._graphs = Graphs(stage)
        #: the (microbatch, chunk) whose forwards keep only their input ([Note: recomputation])
        self._recomputed = recomputed(program.stages[stage])
        self._copies = CopyLane()
        self._device = device
        #: a run's losses (`losses`, `records`, `device_records`: `backends.runtime.losses`),
        #: and each batch's count ([Note: the count divides at the step])
        self.book = LossBook.of(self._layout, self._m, self.collectives.size)
        self._counts = StageCounts(
            self.book,
            program,
            self._layout,
            self._segment,
            self._trained,
            self.collectives,
            count_fn=up_front_count(loss_fn),
        )
        self._ports = Ports(stage, program.tensors, self._m)
        #: sequence parts' carries between the forwards of a segment ([Note: sequence parts])
        self._parts = schedule.num_parts
        self._carries = Carries(stage, self._parts)
        #: the seconds spent in the segments' own work, added up ([Note: a compute's own time]
        #: in `backends.runtime.segment_calls`): what a backend reads around each compute
        self.segment_clock = SegmentClock()
        #: how the stage applies its segments (`backends.runtime.forwards`)
        self._forwards = SegmentForwards(
            self.modules,
            self._calls,
            program.stages[stage],
            layout=self._layout,
            precision=self.precision,
            norm=self.norm,
            loss_fn=loss_fn,
            book=self.book,
            counts=self._counts,
            ports=self._ports,
            carries=self._carries,
            num_microbatches=self._m,
            stashed=self._delay > 0,
            shadowed=self._shadowed,
            clock=self.segment_clock,
        )
        self.reset()

    # -- the backend's side ---------------------------------------------------------------------

    def reset(self, *, forward_only: bool = False) -> None:
        """Start a new run of the program: clear per-run state; the live weights are version 0.

        `forward_only`: the run is a forward-only program (evaluation): forwards run without
        autograd and keep nothing for a backward; the last segment records the losses of the
        batches given targets and keeps the outputs (`outputs`) of the others.
        """
        self.forward_only = forward_only
        self.handlers.training = not forward_only  # no pair to hold a forward back for
        self._forwards.training = not forward_only
        self._graphs.reset()
        self.book.reset()
        self._ports.reset()
        self._carries.reset()
        #: forward-only runs: the last segment's output per microbatch, where no targets came
        self.outputs: dict[int, Any] = {}
        self._versions = WeightVersions(self.program, self.stage, self._views)
        self._reducer.reset()

    # -- activation bytes, owned by `graphs` ----------------------------------------------------

    @property
    def activation_bytes(self) -> int:
        """Bytes of saved activations held now (`Graphs.num_bytes`)."""
        return self._graphs.num_bytes

    @property
    def peak_activation_bytes(self) -> int:
        """The most `activation_bytes` ever was (`Graphs.peak`)."""
        return self._graphs.peak

    @property
    def host_activation_bytes(self) -> int:
        """Bytes of saved activations held on the host now (`Graphs.host_bytes`)."""
        return self._graphs.host_bytes

    @property
    def peak_host_activation_bytes(self) -> int:
        """The most `host_activation_bytes` ever was (`Graphs.peak_host`)."""
        return self._graphs.peak_host

    @property
    def microbatch_bytes(self) -> dict[int, dict[str, int]]:
        """Per segment this stage ran a forward of: the most one microbatch's forward saved and
        its input took, `{k: {"activations": ..., "inputs": ...}}` (`Graphs.sizes`)."""
        return {
            self._segment[c]: {"activations": a, "inputs": i}
            for c, (a, i) in sorted(self._graphs.sizes.items())
        }

    def load_batch(
        self,
        batch: int,
        inputs: Sequence[Any] | None,
        targets: Sequence[Any] | None,
        *,
        sizes: Sequence[int] | None = None,
    ):
        """Give the runtime the `m` microbatches of `batch` (an index within the program), each
        a boundary value (`backends.runtime.values`), of `sizes` samples each where they are
        unequal ([Note: unequal microbatches] in `backends.runtime.losses`).

        `inputs` is read only on the stage holding segment 0, `targets` only on the stage
        holding the last segment; other stages may pass None.
        """
        self._ports.load_batch(batch, inputs, targets)
        if sizes is not None:
            self.book.sized(batch, sizes)

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
        try:
            if self._zero == 3 and isinstance(op, COMPUTE):
                self._reducer.ready(op.chunk)  # the all-gather its Unshard launched ahead
            self.handlers.run(op, functools.partial(handler, op))
        except Exception as exc:
            exc.add_note(f"(while stage {self.stage} ran {op})")
            raise

    def outgoing(self, op: Instruction) -> Message:
        """The message a `SendActivation` or `SendGrad` sends (`backends.runtime.boundary`)."""
        return self._ports.outgoing(op)

    def incoming(self, op: Instruction, message: Message | Any) -> None:
        """Take the `Message` a `RecvActivation` or `RecvGrad` received (or a bare activation
        value, whose floating tensors then all take a gradient)."""
        self._ports.incoming(op, message)

    # -- compute --------------------------------------------------------------------------------

    def _forward(self, op: Forward) -> None:
        if self.handlers.holds_back(op):
            return  # runs with its overlapped backward: [Note: running an overlapped pair]
        i, c = op.microbatch, op.chunk
        k = self._segment[c]
        value, leaves = self._ports.input_of(i, c, k)
        if self.forward_only:  # the live weights, no graph
            with torch.no_grad():
                params = dict(self._views[c].named_parameters())
                if self._parts > 1:
                    carry = self._carries.take(i, c)[0]
                    out, carry = self._forwards.apply_part(c, k, params, value, carry)
                    self._carries.hand_on(i, c, k, carry)
                else:
                    out = self._forwards.apply(c, k, params, value)
            if self._layout.is_last(k) and not self._ports.has_targets(i):
                self.outputs[i] = out
            else:
                self._forwards.deliver(i, c, k, out)
            return
        params = self._versions.params_for(c, self._versions.version_of(i))
        if (i, c) in self._recomputed:  # keeps only its input: [Note: recomputation]
            rng = RngState.of(params.values(), value)
            with keeping_nothing():  # the loss is recorded here; the R only rebuilds the graph
                self._forwards.deliver(i, c, k, self._forwards.apply(c, k, params, value))
            kept = KeptInput(value, leaves, params, rng)
            self._graphs.keep(i, c, kept)
            self._graphs.took(c, kept.num_bytes)
            return
        self._graphs.took(c, input_bytes(value))
        graph, message = self._forwards.run_segment(c, k, i, value, leaves, params)
        self._graphs.hold(i, c, graph)
        if message is not None:
            self._ports.hand_on(i, c, k, message)

    def _recompute(self, op: Recompute) -> None:
        i, c = op.microbatch, op.chunk
        kept = self._graphs.take_kept(op)
        with replaying(kept.rng):
            graph, _ = self._forwards.run_segment(
                c, self._segment[c], i, kept.value, kept.leaves, kept.params, record=False
            )
        self._graphs.hold(i, c, graph, replacing=kept)

    def _output_grads(self, op) -> list[torch.Tensor | None]:
        """The gradients of the roots of op's graph (None for the loss on the last segment)."""
        k = self._segment[op.chunk]
        graph = self._graphs.graph(op)
        num_carried = graph.carried[0]  # the carry's roots come last ([Note: sequence parts])
        roots = graph.roots[: len(graph.roots) - num_carried]
        if self._layout.is_last(k):
            grads: list[torch.Tensor | None] = [None] * len(roots)
        else:
            grads, count = self._ports.gradient_of(op, k, roots)
            self._counts.received(op.microbatch, count)  # [Note: the count divides at the step]
        if num_carried:
            grads = grads + self._carries.gradient_of(op, graph.roots[len(roots) :])
        return grads

    def _backward(self, op: Backward) -> None:
        graph = self._graphs.graph(op)
        self._into_buffer(op.chunk)
        grads = self._output_grads(op)
        with self.segment_clock:
            got = full_backward(graph, grads, self._stashed_into(op))
        self._emit_input_grad(op, graph, got)
        self._graphs.free(op)

    def _overlapped_backward(self, op: OverlappedBackward) -> None:
        """The backward half of an overlapped pair (`F3.1 +B1`), run with the forward held back
        just before it ([Note: running an overlapped pair] in `backends.runtime.handlers`)."""
        carries = self._counts.carries(op.microbatch)
        backward = functools.partial(self._backward, op)
        self.handlers.run_pair(op, self._forward, backward, in_order=carries)

    def register_handler(self, kind: type, fn: Callable[[Any], Any]) -> None:
        """Run every instruction of `kind` on this stage through `fn` ([Note: custom handlers]
        in `backends.runtime.handlers`)."""
        self.handlers.register(kind, fn)

    def _offload(self, op: Offload) -> None:
        self._copies.offload(self._graphs.offloaded(op))

    def _reload(self, op: Reload) -> None:
        self._copies.reload(self._graphs.reloaded(op), self._device)

    def _backward_input(self, op: BackwardInput) -> None:
        graph = self._graphs.graph(op)
        graph.grads = self._output_grads(op)  # what BackwardWeight differentiates
        with self.segment_clock:
            got = grad_roots(graph.roots, graph.grads, graph.leaves, retain_graph=True)
        self._emit_input_grad(op, graph, got)

    def _backward_weight(self, op: BackwardWeight) -> None:
        graph = self._graphs.graph(op)
        if graph.grads is None:
            raise self._refused(op, "runs before its BackwardInput")
        self._into_buffer(op.chunk)
        with self.segment_clock:
            weight_backward(graph, self._stashed_into(op))
        self._graphs.free(op)

    def _into_buffer(self, c: int) -> None:
        """Before a weight gradient of chunk c: where the program reduces, its `.grad`s are
        views of the chunk's gradient buffer, its launched reduction waited ([Note: contiguous
        gradient buckets] in `backends.runtime.zero`)."""
        if self._reduces:
            self._reducer.prepare(c)

    def _stashed_into(self, op) -> Iterable[torch.Tensor] | None:
        """Under weight stashing, the live parameters the gradients of op's stashed weights go
        into; None where autograd puts them into `.grad` itself."""
        return self._views[op.chunk].parameters() if self._delay else None

    def _emit_input_grad(self, op, graph: Graph, grads: Sequence) -> None:
        i, c = op.microbatch, op.chunk
        k = self._segment[c]
        leaves = graph.leaves
        num_carried = graph.carried[1]  # the carry's leaves come last ([Note: sequence parts])
        if num_carried:
            at = len(leaves) - num_carried
            self._carries.hand_back(i, c, leaves[at:], grads[at:])
            leaves, grads = leaves[:at], grads[:at]
        if self._layout.is_first(k):
            return  # the batch's inputs take no gradient
        count = self._counts.carried(i, last=self._layout.is_last(k))
        self._ports.hand_back(i, c, k, gradients(leaves, grads, count))

    # -- updates --------------------------------------------------------------------------------

    def _reduce_grads(self, op: ReduceGrads) -> None:
        self._reducer.reduce(op.chunk)  # launched: waited where the sums are needed

    @property
    def reduction_events(self) -> list[tuple[str, int, int]]:
        """This run's data-parallel collectives, in order: ("launch" or "wait", chunk, bucket) of
        the gradient reductions, ("gather" or "gathered", chunk, 0) of ZeRO-3's all-gathers."""
        return self._reducer.events

    def _reduce_tied(self, op: ReduceTied) -> None:
        if self.ties is None or self._tie_reduce is None:
            raise self._refused(
                op,
                "needs the tied parameters and a tie collective (the engines give them for a "
                "program compiled with tied=...)",
            )
        self.ties.reduce(op.tie, self._tie_reduce)

    def _grad_norm(self, op: GradNorm) -> None:
        if self._norm_reduce is None:
            raise self._refused(
                op,
                "needs a collective over the stages (the engines give it for a program compiled "
                "with grad_norm=True)",
            )
        part = self.norm_part()
        self._norm_reduce(part)
        self.apply_norm(part)

    def norm_part(self) -> torch.Tensor:
        """This stage's part of `GradNorm` ([Note: one norm, every stage alike]): the batch's
        gradients made final, unscaled under float16, and their squares summed (under ZeRO
        over the data-parallel replicas too)."""
        self._reducer.wait()
        self._counts.divide_for_norm(self._versions.version)
        return self.norm.part()

    def apply_norm(self, total: torch.Tensor) -> None:
        """Given every stage's part summed: clip, or mark the step skipped."""
        self.norm.apply(total)

    def _optimizer_step(self, op: OptimizerStep) -> None:
        self._reducer.wait()
        self._counts.divide_for_step(self._versions.version)  # the n-th step applies batch n
        skip, self.norm.skip = self.norm.skip, False
        self.state.skipped_steps += skip
        if self.optimizer is not None:
            if not skip:  # a skipped step leaves the schedule where it was, too
                self.optimizer.step()
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        self._reducer.drop_grads()  # every chunk's `.grad`s, the buffers' views, set to None
        self._versions.advance(snapshot=not self._zero)  # under ZeRO, at the gather

    def _gather_params(self, op: GatherParams) -> None:
        c = op.chunk
        if not self._zero:
            raise self._refused(op, "needs ZeRO (compile with zero=1 or 2)")
        self._reducer.wait(c)
        self._reducer.gather(c)
        if self._delay:
            self._versions.snapshot(c, self._versions.version)

    def _unshard(self, op: Unshard) -> None:
        self._sharded(op).unshard(op.chunk)

    def _reshard(self, op: Reshard) -> None:
        self._sharded(op).release(op.chunk)

    def _sharded(self, op) -> Reducer:
        if self._zero != 3:
            raise self._refused(op, "needs ZeRO-3 (compile with zero=3)")
        return self._reducer

    def _refused(self, op: Instruction, why: str) -> RuntimeInstructionError:
        return RuntimeInstructionError(f"stage {self.stage}: {op} {why}", stage=self.stage)
