"""Non-pipelined reference training: what every pipelined run must equal.

`train_reference` trains the segments chained as one model (each called on what the previous
returned, `backends.runtime.values.call`) on whole batches, one optimizer step per batch; with
`weight_delay = d` it applies the PipeDream-2BW rule `W[b+1] = W[b] - lr * grad(loss_b at
W[b-d])`. It trains the objective the engines train, on each local batch split into the same
microbatches: a scalar loss's mean over the microbatches (of every local batch), a `(loss_sum,
count)` loss's total sum over its total count, a dict's parts summed; and it builds it as the last
segment does (`objective`), so even a model that rounds in float32 inside matches.
`assert_matches_reference` runs a program on the local backend and the reference side by side on
copies of the same segments and checks that losses and weights agree.

    >>> import torch, schedcc
    >>> from schedcc.backends.reference import assert_matches_reference
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <...>
    >>> segments = [torch.nn.Linear(2, 2, dtype=torch.float64) for _ in range(2)]
    >>> data = [(torch.randn(4, 2, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64))]
    >>> program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4))
    >>> diff = assert_matches_reference(program, segments, torch.nn.functional.mse_loss,
    ...                                 lambda ps: torch.optim.SGD(ps, lr=0.1), data)
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules.dropout import _DropoutNd

from schedcc.backends.batches import local_batches, split_pair
from schedcc.backends.runtime.carries import call_part
from schedcc.backends.runtime.losses import MEAN, PARTS, RATIO, interpret, up_front_count
from schedcc.backends.runtime.values import call, concat
from schedcc.program import Program

__all__ = [
    "OBJECTIVES",
    "SAMPLE_MEAN",
    "UP_FRONT",
    "Chain",
    "assert_matches_reference",
    "global_batch",
    "objective",
    "reference_loss",
    "train_reference",
    "without_dropout",
]


class Chain(nn.Module):
    """The segments as one model: each called on what the previous returned (`carries`: on the
    whole sequence as on a first sequence part, `segment(x, None)`, keeping the output of the
    `(output, carry)` it returns: [Note: the parts' calling convention])."""

    def __init__(self, segments: Sequence[nn.Module], *, carries: bool = False) -> None:
        super().__init__()
        self.segments = nn.ModuleList(segments)
        self.carries = carries

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        value: Any = kwargs if kwargs else (args[0] if len(args) == 1 else args)
        for k, segment in enumerate(self.segments):
            if self.carries:
                value = call_part(segment, value, None, where=f"segment {k}")[0]
            else:
                value = call(segment, value)
        return value


def global_batch(batch: Any) -> tuple[Any, Any]:
    """`(inputs, targets)` of a batch, joining per-replica local batches in order."""
    if len(batch) == 2 and not all(isinstance(b, (tuple, list)) and len(b) == 2 for b in batch):
        return batch[0], batch[1]
    return concat([x for x, _ in batch], name="inputs"), concat(
        [y for _, y in batch], name="targets"
    )


#: What `--check` calls each objective the reference trains (as the engines do).
OBJECTIVES = {
    MEAN: "per-microbatch means",
    PARTS: "per-microbatch means of the parts, summed",
    RATIO: "token ratio, divided at the step",
}
#: A `schedcc.TokenLoss`'s objective ([Note: a count known up front]).
UP_FRONT = "token ratio, count known up front"
#: A mean loss over microbatches of unequal size ([Note: unequal microbatches]).
SAMPLE_MEAN = "mean over the samples of unequal microbatches"


def reference_loss(
    model: Callable[..., Any],
    loss_fn: Callable[[Any, Any], Any],
    locals_: Sequence[tuple],
    *,
    num_microbatches: int = 1,
    microbatch_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """One batch's loss through `model`, from its local batches, each split into
    `num_microbatches` microbatches as the engines split it (of `microbatch_sizes` samples,
    where given): the mean of the microbatches' mean losses (weighed by their sizes, where
    given: the mean over the samples), a dict's parts summed, or a `(loss_sum, count)` loss's
    total sum over its total count. Its gradient is the engines' (see `objective`)."""
    return objective(
        model,
        loss_fn,
        locals_,
        num_microbatches=num_microbatches,
        microbatch_sizes=microbatch_sizes,
    )[0]


def objective(
    model: Callable[..., Any],
    loss_fn: Callable[[Any, Any], Any],
    locals_: Sequence[tuple],
    *,
    num_microbatches: int = 1,
    microbatch_sizes: Sequence[int] | None = None,
) -> tuple[torch.Tensor, str]:
    """`(loss, what it is)`: `reference_loss`, built as the last segment builds what it
    backpropagates, and its name in `OBJECTIVES` (or `UP_FRONT`, `SAMPLE_MEAN`).

    A mean loss is each microbatch's over `m * dp`, summed (gradient accumulation of the
    microbatch means), or with `microbatch_sizes` `n_j` each microbatch's times `n_j / (N *
    dp)` (the mean over the samples: [Note: unequal microbatches] in
    `backends.runtime.losses`); a `schedcc.TokenLoss` each microbatch's `loss_sum` over the
    batch's count, summed ([Note: a count known up front]); another `(loss_sum, count)` loss
    the total sum over the total count.

    Raises:
        ScheduleConfigError: a batch that does not split into `num_microbatches` (or into
            `microbatch_sizes`), or a loss that is none of the three forms.
    """
    results = []
    for r, (inputs, targets) in enumerate(locals_):
        where = f"local batch {r}"
        if microbatch_sizes is not None:
            m = num_microbatches
            xs, ys = split_pair(inputs, targets, m, where=where, sizes=microbatch_sizes)
        else:
            xs, ys = _microbatches(inputs, targets, num_microbatches, where)
        for x, y in zip(xs, ys):
            results.append(interpret(loss_fn(call(model, x), y), "loss_fn"))
    mode = results[0][0]
    values = [value for _, value, _, _ in results]
    if mode != RATIO and microbatch_sizes is not None:
        sizes = list(microbatch_sizes) * len(locals_)
        weights = [n / (sum(microbatch_sizes) * len(locals_)) for n in sizes]
        return _added(value * w for value, w in zip(values, weights)), SAMPLE_MEAN
    if mode != RATIO:
        assert mode in (MEAN, PARTS)
        return _added(value / len(values) for value in values), OBJECTIVES[mode]
    count = _added(count for _, _, count, _ in results)
    if up_front_count(loss_fn) is None:
        return torch.stack(values).sum() / count, OBJECTIVES[RATIO]
    return _added(value / count.to(value.device, value.dtype) for value in values), UP_FRONT


def _microbatches(inputs: Any, targets: Any, m: int, where: str) -> tuple[list, list]:
    if m == 1:
        return [inputs], [targets]
    return split_pair(inputs, targets, m, where=where)


def _added(values: Iterable[torch.Tensor]) -> torch.Tensor:
    """`values` added one by one, in order."""
    total = None
    for value in values:
        total = value if total is None else total + value
    assert total is not None
    return total


def train_reference(
    segments: Sequence[nn.Module],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    optimizer: Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer],
    batches: Iterable[Any],
    *,
    weight_delay: int = 0,
    batches_per_run: int | None = None,
    max_grad_norm: float | None = None,
    skip_nonfinite: bool = False,
    grad_norms: list[float] | None = None,
    num_microbatches: int = 1,
    objectives: list[str] | None = None,
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    microbatch_sizes: Sequence[int] | None = None,
    carries: bool = False,
) -> list[float]:
    """Train `segments` in place without a pipeline; returns the per-batch losses.

    Args:
        segments: the model's segments, in order (run as one `nn.Sequential`).
        loss_fn: `loss_fn(output, targets)`: a mean over the batch, a `(loss_sum, count)` pair
            or a dict of named scalars.
        optimizer: a callable from parameters to a `torch.optim.Optimizer`.
        batches: `(inputs, targets)` global batches, or sequences of per-replica local batches
            (each run through the model on its own; `reference_loss` combines them).
        weight_delay: `d`; batch b's gradient is taken at the weights of `max(0, b - d)` steps.
        batches_per_run: with a delay, the versions restart every this many batches (the local
            backend's `train` drains the pipeline after each run of the program).
        max_grad_norm: clip with `torch.nn.utils.clip_grad_norm_` before each step.
        skip_nonfinite: skip the step of a batch whose gradient norm is inf or NaN.
        grad_norms: if given, each batch's gradient norm (before clipping) is appended to it.
        num_microbatches: `m`: each local batch is split into `m` microbatches, as the engines
            split it, so a mean loss is the mean of microbatch means (`objective`).
        objectives: if given, each batch's objective (`OBJECTIVES`, `UP_FRONT`) is appended.
        lr_scheduler: `lr_scheduler(optimizer)`, stepped after every step taken (not a skipped
            one).
        microbatch_sizes: each local batch's `m` microbatches hold these many samples, as
            `train_step(..., microbatch_sizes=...)` splits them (`objective`).
        carries: the segments take sequence parts (`Chain`); the reference runs each whole
            sequence as one part, so give `num_microbatches` the microbatches of the data.
    """
    model = Chain(segments, carries=carries)
    opt = optimizer(model.parameters())
    scheduler = lr_scheduler(opt) if lr_scheduler is not None else None
    names = [name for name, _ in model.named_parameters()]
    split = {"num_microbatches": num_microbatches, "microbatch_sizes": microbatch_sizes}
    history: list[dict[str, torch.Tensor]] = []
    losses = []
    for b, batch in enumerate(batches):
        locals_ = _locals(batch)
        local = b % batches_per_run if batches_per_run else b
        if local == 0:
            history = []
        opt.zero_grad(set_to_none=True)
        if not weight_delay:
            loss, name = objective(model, loss_fn, locals_, **split)
            loss.backward()
        else:
            history.append(
                {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
            )
            params = history[max(0, local - weight_delay)]

            def stashed(*args, params=params, **kwargs):  # the model on version b - d
                return torch.func.functional_call(model, params, args, kwargs)

            loss, name = objective(stashed, loss_fn, locals_, **split)
            grads = torch.autograd.grad(loss, [params[n] for n in names], allow_unused=True)
            for p, g in zip(model.parameters(), grads):
                p.grad = None if g is None else g
        if objectives is not None:
            objectives.append(name)
        if max_grad_norm is not None or skip_nonfinite or grad_norms is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm or math.inf)
            if grad_norms is not None:
                grad_norms.append(norm.item())
            if skip_nonfinite and not math.isfinite(norm.item()):
                opt.zero_grad(set_to_none=True)
                losses.append(loss.item())
                continue
        opt.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def without_dropout(modules: Iterable[nn.Module]) -> list[str]:
    """Set every dropout probability in `modules` to 0, in place; what it changed, one text each
    (`segment 1 drop (p=0.1)`), in order.

    It sets the `p` of every `torch.nn` dropout module (`Dropout`, `Dropout1d`..`3d`,
    `AlphaDropout`, ...) and every float attribute of a module whose name holds "dropout" (the
    `dropout` of `MultiheadAttention` and of the RNNs, the `attention_dropout` an attention
    passes to `scaled_dot_product_attention`). Dropout called with a constant in code
    (`F.dropout(x, 0.1)`) it cannot see. `schedcc run --check` uses it: a pipeline draws its
    masks per stage and microbatch, so with dropout on no run equals non-pipelined training.
    """
    changed = []
    for k, module in enumerate(modules):
        for name, sub in module.named_modules():
            where = f"segment {k} {name or type(sub).__name__}"
            if isinstance(sub, _DropoutNd) and sub.p > 0:
                changed.append(f"{where} (p={sub.p:g})")
                sub.p = 0.0
            for attr, value in list(vars(sub).items()):
                if "dropout" in attr and type(value) is float and value > 0:
                    changed.append(f"{where}.{attr} ({value:g})")
                    setattr(sub, attr, 0.0)
    return changed


def _locals(batch: Any) -> list[tuple[Any, Any]]:
    """A batch's local batches: per-replica ones as given, or the one global batch."""
    if len(batch) == 2 and not all(isinstance(b, (tuple, list)) and len(b) == 2 for b in batch):
        return [(batch[0], batch[1])]
    return [(x, y) for x, y in batch]


def assert_matches_reference(
    program: Program,
    segments: Sequence[nn.Module],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    optimizer: Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer],
    batches: Sequence[Any],
    *,
    atol: float = 1e-10,
    rtol: float = 1e-10,
    max_grad_norm: float | None = None,
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    microbatch_sizes: Sequence[int] | None = None,
) -> float:
    """Run `program` on the local backend and the reference on copies of `segments`; compare.

    With `microbatch_sizes` every batch is split into microbatches of those sizes (one
    `train_step` each: a flush program of one batch).

    The caller's `segments` are not changed. Returns the largest absolute difference seen.
    With model replicas (DualPipe) `segments` holds each replica (the same modules again, say
    `parts + parts`) and the reference trains the first replica's segments.

    Raises:
        AssertionError: a loss or a parameter differs beyond the tolerance (names which).
        ScheduleError: the program does not validate or fails to run.
    """
    from schedcc.backends.local import Engine

    schedule = program.schedule
    piped, plain = copy.deepcopy(list(segments)), copy.deepcopy(list(segments))
    engine = Engine(
        program,
        piped,
        loss_fn,
        optimizer,
        max_grad_norm=max_grad_norm,
        lr_scheduler=lr_scheduler,
    )
    if microbatch_sizes is None:
        losses = list(engine.train(batches))
    else:
        losses = [engine.train_step(*b, microbatch_sizes=microbatch_sizes) for b in batches]
    length = schedule.num_segments // type(schedule).num_replicas
    dp = program.data_parallel
    expected = train_reference(
        plain[:length],
        loss_fn,
        optimizer,
        [local_batches(batch, b, dp) for b, batch in enumerate(batches)],  # as the engine splits
        weight_delay=schedule.weight_delay,
        batches_per_run=schedule.num_batches,
        max_grad_norm=max_grad_norm,
        num_microbatches=schedule.num_microbatches // schedule.num_parts,  # whole sequences
        lr_scheduler=lr_scheduler,
        microbatch_sizes=microbatch_sizes,
        carries=schedule.num_parts > 1,
    )
    worst = 0.0
    for b, (got, want) in enumerate(zip(losses, expected)):
        if abs(got - want) > atol + rtol * abs(want):
            raise AssertionError(f"{schedule!r}: loss of batch {b} is {got!r}, expected {want!r}")
        worst = max(worst, abs(got - want))
    with engine.unsharded():  # ZeRO-3 holds only shards between runs
        for k, (mine, theirs) in enumerate(zip(piped, plain)):
            for (name, p), q in zip(mine.named_parameters(), theirs.parameters()):
                diff = (p.detach() - q.detach()).abs().max().item() if p.numel() else 0.0
                if not torch.allclose(p, q, atol=atol, rtol=rtol):
                    raise AssertionError(
                        f"{schedule!r} (data_parallel={program.data_parallel}, "
                        f"zero={program.zero}): segment {k} parameter {name!r} differs from "
                        f"non-pipelined training by {diff}"
                    )
                worst = max(worst, diff)
    return worst
