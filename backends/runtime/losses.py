"""What `loss_fn` returns, what the last segment backpropagates, and what a batch's loss is.

`loss_fn(output, targets)` runs on the last segment, once per microbatch, and returns one of:

- a scalar tensor, the mean over the microbatch (`MEAN`). A batch's loss is the mean of its
  microbatches' (and data-parallel replicas') losses; the last segment backpropagates
  `loss / (m * dp)`.
- `(loss_sum, count)` (`RATIO`): a summed loss and how many items it sums (tokens that are not
  padding, say; a tensor or a number). A batch's loss is its total sum over its total count, over
  every microbatch and every data-parallel replica, and so is the gradient, however unevenly the
  items fall into microbatches ([Note: the count divides at the step]). A `schedcc.TokenLoss`
  is one whose count is a function of the targets: each `loss_sum` is then divided by the
  batch's count before its backward ([Note: a count known up front]).
- a dict of named scalars, each a mean over the microbatch (`PARTS`, e.g. a language-model loss
  and an auxiliary one): their sum is optimised as a `MEAN` loss is, and each is reported.

[Note: the count divides at the step] A batch's total count is known only once its last forward
has run on the last segment, and under 1F1B the first backwards run before that. So the last
segment backpropagates each `loss_sum` as it is: every stage accumulates the gradient of the
batch's *sum*, and divides it by the count `N` right before its optimizer step, which is exact
(the gradient is linear in the loss) up to rounding. `N` reaches every stage without a new
message: the last input-backward (B or I) of a batch on the last segment (`count_carriers`) runs
after every forward of that batch there (each forward precedes its own backward), so the
gradient it sends carries the replica's count; each earlier segment's backward of that same
microbatch needs that gradient, and passes the count on with its own. Every stage's step follows
its backward of that microbatch, so it knows `N` by then. With data parallelism each step first
sums `N` over the stage's replicas (one scalar all-reduce, at a place every replica reaches).

[Note: a count known up front] With `schedcc.TokenLoss(sum_fn, count_fn)` the count is a
function of the targets, and the stage of the last segment holds every microbatch's targets of
the batch (its data-parallel replica's, and under model replicas all `m`: each replica's last
stage loads them all) before the batch's first forward there. So at that forward the stage
computes the batch's count `N` (`count_fn` of each microbatch's targets, added in order, in
float64; with `dp > 1` summed over the stage's replicas, one scalar all-reduce at a forward that
every replica of the stage reaches in the same order, as it does each `Reduce`), and
backpropagates each microbatch's `loss_sum / N` instead: the gradient of the ratio itself, with
the seed `1/N` entering the backward where non-pipelined training of the ratio has it. No stage
divides at its step (every stage holds the same `loss_fn`, so each knows that statically); the
count a gradient message carries then only reports. This matters for a model that rounds in
float32 inside (an RMSNorm that upcasts): dividing float32 gradients of the sum by `N` after
the backward rounds differently from backpropagating `1/N` (about 1e-8 apart unless `N` is a
power of two), while backpropagating `loss_sum / N` rounds as the reference does (to about
1e-16 in a float64 model).

[Note: unequal microbatches] Given `microbatch_sizes` `n_1..n_m` (a local batch of `N = sum n_j`
samples, alike on each of `dp` replicas), a mean loss trains the mean over the global batch's
samples, which is what the non-pipelined loss over the whole batch is for a loss that averages
per sample (`mse_loss`, `cross_entropy` without ignored targets): microbatch j's mean weighs
`n_j / (N * dp)`, so the last segment backpropagates `loss_j * n_j / (N * dp)` and the batch's
loss is `sum n_j * loss_j / (N * dp)`; a dict loss's parts alike. For equal sizes this is the
mean of the means (which equal microbatches keep computing as `loss_j / (m * dp)`). A `(loss_sum,
count)` loss needs nothing new: its count already weighs each microbatch by what it holds (and is
the objective to use where a microbatch's mean is over tokens rather than samples).

With model replicas (DualPipe, [Note: replicas] in `schedcc.semantics.layout`) each replica's last
segment sees only its own microbatches, so each replica carries its own count `N_r` down its own
segments (one carrier per batch and replica), and a step divides by the sum of every replica's
`N_r`, added in replica order. That needs every stage to hold a segment of every replica (as
both DualPipes do): a layout where some stage holds none of a replica's segments cannot learn
that replica's count, and a `(loss_sum, count)` loss is refused there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from schedcc.backends.runtime.syncs import host_read
from schedcc.errors import ScheduleConfigError, UserCodeError, call_user, name_of
from schedcc.ir import INPUT_GRADIENT
from schedcc.losses import TokenLoss

if TYPE_CHECKING:
    from schedcc.backends.runtime.collectives import Collectives
    from schedcc.program import Program
    from schedcc.semantics.layout import Layout

__all__ = [
    "MEAN",
    "PARTS",
    "RATIO",
    "LossBook",
    "LossRecord",
    "StageCounts",
    "call_loss",
    "count_carriers",
    "divide_grads",
    "interpret",
    "unseen_replica",
    "up_front_count",
]

MEAN, RATIO, PARTS = "mean", "(sum, count)", "dict"


class LossRecord(NamedTuple):
    """One batch's loss on one replica: `total / count`, and each named part's `total / count`.

    `total` sums the microbatches' losses (their means, or their sums under `RATIO`); `count` is
    what divides it (`m`, or the batch's count under `RATIO`); `parts` sums each named loss.
    """

    total: float
    count: float
    parts: dict[str, float]


class LossBook:
    """The losses of one run on the last segment's stage, and each batch's count on every stage.

    Args:
        num_microbatches: `m`, the microbatches of a batch.
        data_parallel: the replicas a `MEAN` loss is averaged over.
        replicas: the model replicas that run microbatches (DualPipe: 0 and 1), each counting
            its own under `RATIO`.
        unseen: why some stage cannot learn every replica's count (a `(loss_sum, count)` loss
            is then refused); None where every stage holds a segment of every replica.
    """

    def __init__(
        self,
        num_microbatches: int,
        data_parallel: int,
        *,
        replicas: Sequence[int] = (0,),
        unseen: str | None = None,
    ) -> None:
        self._m = num_microbatches
        self._dp = data_parallel
        self._replicas = tuple(replicas)
        self._unseen = unseen
        self.reset()

    @classmethod
    def of(cls, layout: Layout, num_microbatches: int, data_parallel: int) -> LossBook:
        """The book of a program laid out as `layout` (its model replicas; a `(loss_sum,
        count)` loss refused where some stage cannot learn every replica's count)."""
        return cls(
            num_microbatches,
            data_parallel,
            replicas=sorted(set(layout.replica)),
            unseen=unseen_replica(layout),
        )

    def reset(self) -> None:
        """A new run: no losses, no counts."""
        self.mode: str | None = None
        self._values: dict[int, list[torch.Tensor]] = {}
        #: per (batch, model replica), the counts of its microbatches under `RATIO`
        self._counts: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._parts: dict[int, dict[str, list[torch.Tensor]]] = {}
        #: Per (batch, model replica), the replica's count under `RATIO` (float64, on the
        #: device), once known: on this data-parallel replica only.
        self.normaliser: dict[tuple[int, int], torch.Tensor] = {}
        #: Per batch, its whole count (every microbatch and replica) known before its first
        #: backward: each `loss_sum` is divided by it ([Note: a count known up front]).
        self.up_front: dict[int, torch.Tensor] = {}
        #: Per batch given unequal microbatches, their sizes ([Note: unequal microbatches]).
        self._sizes: dict[int, tuple[int, ...]] = {}

    def sized(self, batch: int, sizes: Sequence[int]) -> None:
        """The microbatches of `batch` hold `sizes` samples each ([Note: unequal
        microbatches]): a mean loss weighs each by its size."""
        self._sizes[batch] = tuple(sizes)

    def _weight(self, batch: int, index: int) -> float | None:
        """What microbatch `index` of `batch` weighs in a mean loss given sizes, None without."""
        sizes = self._sizes.get(batch)
        if sizes is None:
            return None
        return sizes[index] / (sum(sizes) * self._dp)

    def objective(
        self,
        batch: int,
        result: Any,
        *,
        where: str,
        record: bool = True,
        replica: int = 0,
        index: int = 0,
    ) -> torch.Tensor:
        """Record `loss_fn`'s `result` for microbatch `index` of `batch` run by model replica
        `replica`; what to backpropagate.

        `record=False` (a `Recompute` of the forward) only returns what to backpropagate.

        Raises:
            ScheduleConfigError: a result that is none of the three forms, or another form than
                the earlier microbatches' (`where` says which call).
        """
        mode, value, count, parts = interpret(result, where)
        if self.mode is None:
            self.mode = mode
        elif mode != self.mode:
            raise ScheduleConfigError(
                f"{where} returned a {mode} loss after a {self.mode} one: return the same form "
                "for every microbatch"
            )
        if mode == RATIO and self._unseen is not None:
            raise ScheduleConfigError(
                f"{where} returned a (loss_sum, count) loss, but {self._unseen}, so it cannot "
                "learn the batch's count: return a mean over the microbatch, or place a segment "
                "of every replica on every stage"
            )
        if not record:
            return self._scaled(batch, mode, value, index)
        size = self._sizes[batch][index] if batch in self._sizes and mode != RATIO else None
        self._values.setdefault(batch, []).append(_times(value.detach(), size))
        if mode == RATIO:
            self._counts.setdefault((batch, replica), []).append(count)
            return self._scaled(batch, mode, value, index)
        if mode == PARTS:
            book = self._parts.setdefault(batch, {})
            for name, part in parts.items():
                book.setdefault(name, []).append(_times(part.detach(), size))
        return self._scaled(batch, mode, value, index)

    def _scaled(self, batch: int, mode: str, value: torch.Tensor, index: int) -> torch.Tensor:
        """What the last segment backpropagates of microbatch `index`'s loss `value`: a mean
        over `m * dp` (weighed by its size given unequal microbatches), a `loss_sum` over the
        batch's count when known up front, else as it is."""
        if mode != RATIO:
            weight = self._weight(batch, index)  # [Note: unequal microbatches]
            return value / (self._m * self._dp) if weight is None else value * weight
        total = self.up_front.get(batch)
        if total is None:  # [Note: the count divides at the step]
            return value
        # [Note: a count known up front]; a count on the CPU (count_fn returned numbers) is
        # taken by the kernel as an argument, never copied to the device ([Note: host syncs])
        device = None if total.device.type == "cpu" else value.device
        return value / total.to(device, value.dtype)

    def close(self, batch: int, replica: int = 0) -> None:
        """Every forward of `batch` on `replica` has run here (its last segment): fix the
        replica's count (`RATIO`)."""
        counts = self._counts.get((batch, replica))
        if counts is not None and (batch, replica) not in self.normaliser:
            self.normaliser[batch, replica] = torch.stack(counts).sum()

    def count(self, batch: int) -> torch.Tensor | None:
        """The batch's count on this data-parallel replica: every model replica's, added in
        replica order; None without a `RATIO` loss.

        Raises:
            RuntimeError: some replicas' counts are known here and others are not (a program
                whose carriers did not reach this stage; the engines build none such).
        """
        known = [self.normaliser.get((batch, r)) for r in self._replicas]
        if all(n is None for n in known):
            return None
        if any(n is None for n in known):
            missing = [r for r, n in zip(self._replicas, known) if n is None]
            raise RuntimeError(f"batch {batch}: the count of replica(s) {missing} never arrived")
        total = known[0]
        for n in known[1:]:
            total = total + n
        return total

    def device_records(self) -> dict[int, tuple[torch.Tensor, torch.Tensor, dict]]:
        """Per batch of this run, its `LossRecord`'s total, count and parts as float64 tensors on
        the device: running sums in forward order, the same bits `records` reads."""
        out = {}
        for b, values in self._values.items():
            counts = [c for key in sorted(self._counts) if key[0] == b for c in self._counts[key]]
            count = _running_sum(counts) if self.mode == RATIO else None
            if count is None:
                sizes = self._sizes.get(b)  # [Note: unequal microbatches]
                number = sum(sizes) if sizes is not None else len(values)
                # made on the device, never copied there: [Note: host syncs]
                count = torch.full((), float(number), dtype=torch.float64, device=values[0].device)
            parts = {name: _running_sum(v) for name, v in self._parts.get(b, {}).items()}
            out[b] = (_running_sum(values), count, parts)
        return out

    def records(self) -> dict[int, LossRecord]:
        """Per batch of this run, its `LossRecord`: one host read for the whole run."""
        device = self.device_records()
        tensors = [
            t for total, count, parts in device.values() for t in (total, count, *parts.values())
        ]
        read = iter(
            host_read(torch.stack([t.to(tensors[0].device) for t in tensors])) if tensors else []
        )
        return {
            b: LossRecord(next(read), next(read), {name: next(read) for name in parts})
            for b, (_, _, parts) in device.items()
        }

    def losses(self) -> dict[int, float]:
        """`losses[batch]`: the batch's loss on this replica (last stage only): the mean of its
        microbatches' losses, or its summed loss over its count.

        The microbatch losses stay tensors until read here, so a forward never waits for the
        device to hand a number back (no sync per microbatch on CUDA).
        """
        records = self.records()
        return {b: r.total / r.count if r.count else float("nan") for b, r in records.items()}


def _times(value: torch.Tensor, size: int | None) -> torch.Tensor:
    """A recorded loss: `value`, times its microbatch's size given unequal microbatches."""
    return value if size is None else value.to(torch.float64) * size


def _running_sum(values: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """`values` added one by one in order in float64 (None for none): the bits a running
    Python float sum of their values gives."""
    total = None
    for value in values:
        value = value.detach().to(torch.float64)
        total = value if total is None else total + value
    return total


def call_loss(loss_fn: Callable[[Any, Any], Any], output: Any, target: Any) -> Any:
    """`loss_fn(output, target)`, through the user-code guard (`schedcc.errors.call_user`).

    Raises:
        UserCodeError: `loss_fn` raised (a `ScheduleConfigError` naming it and both shapes;
            most often a target of another shape, which the message then suggests).
    """

    def function() -> str:
        shapes = f"output {_described(output)}, target {_described(target)}"
        return f"loss_fn {name_of(loss_fn)}({shapes})"

    try:
        return call_user(function, lambda: loss_fn(output, target))
    except UserCodeError as error:
        if not isinstance(error.__cause__, (RuntimeError, ValueError, TypeError, IndexError)):
            raise
        raise UserCodeError(f"{error}; check the targets' shape") from error.__cause__


def _described(value: Any) -> str:
    """`of shape (4, 3)` for a tensor, `of type tuple` for anything else (for messages)."""
    if isinstance(value, torch.Tensor):
        return f"of shape {tuple(value.shape)}"
    return f"of type {type(value).__name__}"


def interpret(result: Any, where: str) -> tuple[str, torch.Tensor, Any, dict]:
    """`(mode, value, count, parts)` of what `loss_fn` returned: `value` is the loss (the sum
    under `RATIO`, the parts' sum under `PARTS`), `count` a float64 tensor under `RATIO`.

    Raises:
        ScheduleConfigError: none of the three forms; `where` names the call.
    """
    if _is_scalar(result):
        return MEAN, result, None, {}
    if type(result) in (tuple, list) and len(result) == 2 and _is_scalar(result[0]):
        count = result[1]
        device = result[0].device
        if type(count) in (int, float):  # made on the device, not copied: [Note: host syncs]
            return RATIO, result[0], torch.full((), count, dtype=torch.float64, device=device), {}
        if _is_scalar(count, floating=False):
            return RATIO, result[0], count.to(device, torch.float64), {}
    if (
        isinstance(result, dict)
        and result
        and all(isinstance(name, str) and _is_scalar(v) for name, v in result.items())
    ):
        return PARTS, _total(result.values()), None, result
    got = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
    raise ScheduleConfigError(
        f"{where}: loss_fn must return a scalar tensor (a mean over the microbatch), a "
        f"(loss_sum, count) pair or a dict of named scalar tensors, got {got}: reduce it, e.g. "
        "with reduction='mean'"
    )


def _total(parts: Iterable[torch.Tensor]) -> torch.Tensor:
    total = None
    for part in parts:  # in the dict's order
        total = part if total is None else total + part
    return total  # type: ignore[return-value]


def _is_scalar(value: Any, *, floating: bool = True) -> bool:
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        return False
    return value.is_floating_point() or not floating


def count_carriers(program: Program, layout: Layout) -> dict[tuple[int, int], int]:
    """`{(batch, replica): microbatch}`: the last input-backward (B or I) of each batch on each
    model replica's last segment, whose gradient message carries the replica's count of the
    batch ([Note: the count divides at the step])."""
    schedule = program.schedule
    m = schedule.num_microbatches
    carriers: dict[tuple[int, int], int] = {}
    for replica, segment in enumerate(layout.lasts):
        stage, chunk = layout.stage_of[segment], layout.chunk_of[segment]
        for op in program.stages[stage]:
            if isinstance(op, INPUT_GRADIENT) and op.chunk == chunk:  # `+B` too
                carriers[op.microbatch // m, replica] = op.microbatch
    return carriers


def unseen_replica(layout: Layout) -> str | None:
    """Why some stage cannot learn every model replica's count, or None (see [Note: the count
    divides at the step])."""
    for stage, segments in enumerate(layout.segment):
        held = {k // layout.replica_length for k in segments}
        for replica in sorted(set(layout.replica)):  # those that run microbatches
            if replica not in held:
                return f"stage {stage} holds no segment of model replica {replica}"
    return None


def up_front_count(loss_fn: Any) -> Callable[[Any], Any] | None:
    """The `count_fn` of a `schedcc.TokenLoss`, whose count is known up front ([Note: a count
    known up front]); None for any other loss."""
    return loss_fn.count_fn if isinstance(loss_fn, TokenLoss) else None


def divide_grads(params: Iterable[torch.Tensor], count: torch.Tensor) -> None:
    """Divide every gradient among `params` by the batch's `count`, in place."""
    for p in params:
        if p.grad is not None:
            p.grad.div_(count.to(p.grad.device))


class StageCounts:
    """One stage's side of [Note: the count divides at the step]: the count a gradient message
    brings or carries on, and the division of the batch's gradients by its count at the step.

    Args:
        book: the stage's `LossBook` (it holds the counts).
        program: the compiled program (which backwards carry a count).
        layout: the program's layout of segments on stages ([Note: replicas]).
        segments: this stage's segment of each chunk.
        params: what the stage's optimizer steps (the shards under ZeRO).
        collectives: the stage's data-parallel group, over which a count is summed.
        count_fn: a `schedcc.TokenLoss`'s `count_fn`: the count is known up front and nothing
            is divided at the step ([Note: a count known up front]); None: it divides there.
    """

    def __init__(
        self,
        book: LossBook,
        program: Program,
        layout: Layout,
        segments: Sequence[int],
        params: Sequence[torch.Tensor],
        collectives: Collectives,
        *,
        count_fn: Callable[[Any], Any] | None = None,
    ) -> None:
        self._book = book
        self._count_fn = count_fn
        self._m = program.schedule.num_microbatches
        self._replica = layout.replica
        self._carriers = set(count_carriers(program, layout).values())
        #: the model replicas whose last segment this stage holds
        self._ends = [k // layout.replica_length for k in segments if layout.is_last(k)]
        self._params = params
        self._collectives = collectives
        self._divided = False  # the batch's count already divided (at its GradNorm)

    def received(self, microbatch: int, count: torch.Tensor | None) -> None:
        """A gradient for `microbatch` arrived, carrying `count` (None: it carries none)."""
        if count is not None:
            self._book.normaliser[self.key(microbatch)] = count

    def carries(self, microbatch: int) -> bool:
        """Whether the input gradient of `microbatch` carries its batch's count."""
        return microbatch in self._carriers

    def carried(self, microbatch: int, *, last: bool) -> torch.Tensor | None:
        """The count the input gradient of `microbatch` carries on (`last`: sent from its
        replica's last segment, where the count is fixed now); None for a non-carrier."""
        if microbatch not in self._carriers:
            return None
        key = self.key(microbatch)
        if last:
            self._book.close(*key)
        return self._book.normaliser.get(key)

    def divide_for_norm(self, batch: int) -> None:
        """At `GradNorm`: the batch's gradients divided by its count, before they are measured."""
        self._divide(batch)
        self._divided = True

    def divide_for_step(self, batch: int) -> None:
        """At `OptimizerStep`: the batch's gradients divided by its count, unless its
        `GradNorm` already did."""
        if not self._divided:
            self._divide(batch)
        self._divided = False

    def know_up_front(self, batch: int, targets: Sequence[Any]) -> None:
        """At a forward of `batch` on a last segment, before its first backward: with a
        `count_fn`, fix the batch's whole count from the targets of its microbatches (once),
        summed over the data-parallel replicas ([Note: a count known up front]).

        Raises:
            UserCodeError: `count_fn` raised or returned no count (a `ScheduleConfigError`).
        """
        if self._count_fn is None or batch in self._book.up_front:
            return
        counts = [self._count_of(batch, i, target) for i, target in enumerate(targets)]
        total = _running_sum(counts)
        if self._collectives.size > 1:
            total = total.clone()
            self._collectives.all_reduce(total)
        self._book.up_front[batch] = total

    def _count_of(self, batch: int, index: int, target: Any) -> torch.Tensor:
        """`count_fn(target)` of microbatch `index` of `batch`, as a float64 tensor."""
        fn = self._count_fn
        where = f"count_fn {name_of(fn)} on the targets of microbatch {index} of batch {batch}"
        count = call_user(where, lambda: fn(target))
        if not (_is_scalar(count, floating=False) or type(count) in (int, float)):
            got = tuple(count.shape) if isinstance(count, torch.Tensor) else type(count).__name__
            raise UserCodeError(
                f"{where} returned {got}, not a count: return an int or a 0-dim tensor, e.g. "
                "(targets != -100).sum()"
            )
        return torch.as_tensor(count).to(torch.float64)

    def key(self, microbatch: int) -> tuple[int, int]:
        """`(batch, model replica)` of a global microbatch ([Note: replicas])."""
        return microbatch // self._m, self._replica[microbatch % self._m]

    def _divide(self, batch: int) -> None:
        """Divide the batch's gradients by its count, summed over the model replicas and the
        data-parallel replicas; nothing without a `(loss_sum, count)` loss, or with one whose
        count was known up front ([Note: a count known up front])."""
        if self._count_fn is not None:
            return
        for replica in self._ends:
            self._book.close(batch, replica)
        count = self._book.count(batch)
        if count is None:
            return
        if self._collectives.size > 1:
            count = count.clone()
            self._collectives.all_reduce(count)
        divide_grads(self._params, count)
