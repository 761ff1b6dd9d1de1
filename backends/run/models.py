"""The models `schedcc run` trains: the `--model` factory contract, the built-ins, and loading.

`schedcc run --model NAME` trains what a factory builds. NAME is a built-in (`tiny-gpt`, the
default: the GPT of `backends/run/gpt.py`; `mlp`), `package.module:make` or
`path/to/file.py:make`, where `make` is

    def make(num_segments: int, *, seed: int) -> RunModel
    def make(num_segments: int, *, seed: int, segments: tuple[int, ...] | None = None) -> RunModel
    def make(num_segments: int, *, seed: int, segments=None, parts: int = 1) -> RunModel

It builds the model cut into `num_segments` (`p * v`) segments in model order and returns them
with the loss and the data (`RunModel`). A factory that takes `segments` builds only those when
given them (`RunModel.segments` is then `{k: module}` for just those), so a rank allocates only
its own stage's parameters; one that does not builds them all, and the rank keeps its own and
drops the rest. What the run does with it:

- it calls `make` once in the launching process, to check what comes back and to find the ties
  before any rank starts (the whole model), and once on every rank (with that rank's segments);
  so `make` must build the same model every time for a given `seed`, and a segment built alone
  must start with the values it has in the whole model (seed each parameter, or each segment,
  itself: the built-ins draw each parameter from a generator seeded by its name);
- a Parameter object held by several segments of the whole model (`head.weight = tok.weight`)
  is a tie: the run compiles with `tied=` covering every such sharing (`tied_groups`), and each
  rank trains its own stage's segments; built apart, a tie's copies are found by value, so
  they must start equal (the last segment's head a copy of the first one's embedding);
- the segments are built in `torch.get_default_dtype()`: `--check` sets float64 before calling
  `make` and compares with non-pipelined training of a copy of the same segments, so training must
  be deterministic (`--check` sets every dropout probability to 0 for both, and says where);
- `batch(batch_size, step)` gives the global batch of optimizer step `step` (`batch_size` is
  `m * --microbatch-size * dp`); every rank draws it and keeps its data-parallel share, so it must
  be a pure function of `step` (`--check` and `--resume` replay it too);
- under a schedule of sequence parts (`seq1f1b`, `-k K`), each segment is called on one part
  at a time with the carry of the part before ([Note: the parts' calling convention] in
  `backends.runtime.carries`), and `batch` must give sequences that `K` parts divide (a batch
  that does not split is one line before any rank starts); a factory that takes `parts` is
  given `parts=K` (`takes_parts`; `tiny-gpt` pads its batches to a multiple of it), and a
  built-in that does not (`mlp`: no sequence) is refused with parts.

A bad NAME, a `make` that raises, or a return value that breaks the contract is one line naming
`--model NAME` (`UserError`), before any rank starts.

    >>> model = build("mlp", 2)
    >>> len(model.segments), model.unit
    (2, 'samples')
    >>> sorted(build("mlp", 4, segments=(1, 3)).segments)
    [1, 3]
    >>> build("no-such-model", 2)
    Traceback (most recent call last):
    ...
    schedcc.errors.UserError: --model 'no-such-model': not a built-in model (tiny-gpt, mlp), \
module:make or path/to/file.py:make
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from schedcc.backends.batches import batch_size, local_batches, split_pair
from schedcc.backends.run.gpt import (
    GPT,
    GPT_LOSS,
    GPTConfig,
    PaddedBigramData,
    gpt_segment,
    gpt_segments,
    real_tokens,
)
from schedcc.errors import ScheduleConfigError, UserError, call_user
from schedcc.registry import load_object

__all__ = [
    "BUILT_IN",
    "HELD_OUT",
    "RunModel",
    "TeacherData",
    "build",
    "builds_some",
    "check_batch",
    "held_out",
    "mlp",
    "mlp_segments",
    "split_evenly",
    "takes_parts",
    "tiny_gpt",
]


@dataclass(frozen=True)
class RunModel:
    """What a `--model` factory returns: a model cut into segments, its loss and its data.

    Args:
        segments: the `num_segments` modules asked for, in model order, or, when `make` was
            given `segments=`, `{k: module}` for just those; what a segment returns is what the
            next one takes (a tuple as positional arguments, a dict as keyword arguments), the
            first takes a batch's inputs, the last's output goes to `loss_fn`.
        loss_fn: `loss_fn(output, targets)`: a scalar mean over the microbatch, a
            `(loss_sum, count)` pair (normalised over the whole batch; a `schedcc.TokenLoss` to
            divide before the backward) or a dict of named scalars.
        batch: `batch(batch_size, step) -> (inputs, targets)`, a pure function of `step`;
            each may be a tensor or any nesting of tuple, list and dict of tensors and constants,
            and every tensor is split along dim 0 into microbatches.
        optimizer: a callable from parameters to a `torch.optim.Optimizer`; default
            `torch.optim.Adam(params, lr=--lr)`.
        lr_scheduler: a callable from an optimizer to a
            `torch.optim.lr_scheduler.LRScheduler` over it, stepped once per optimizer step
            on every rank's optimizer (and by `--check`'s non-pipelined loop); None: a constant
            rate.
        floor: a loss no model can beat (an entropy, a noise variance), shown beside the final
            loss; None shows none.
        floor_name: what the summary calls it.
        count: `count(inputs, targets) -> int`, how many `unit`s a batch holds (e.g. its real
            tokens), for the throughput; default: its samples.
        unit: what `count` counts ("tokens").
        eval_batch: `eval_batch(batch_size, k) -> (inputs, targets)`, the k-th held-out batch
            (a pure function of `k`, data the training batches never hold), for `--eval-every`;
            None: the model cannot be evaluated.

    Raises:
        TypeError: a field of the wrong kind (a callable that is not, a floor that is no number).

    Example (a file `my_model.py`, run as `schedcc run --model my_model.py:make`):

        def make(num_segments, *, seed):
            torch.manual_seed(seed)
            segments = [nn.Linear(8, 8) for _ in range(num_segments)]
            def batch(batch_size, step):
                gen = torch.Generator().manual_seed(step)
                x = torch.randn(batch_size, 8, generator=gen)
                return x, x.flip(1)
            return RunModel(segments, F.mse_loss, batch)
    """

    segments: Sequence[nn.Module] | Mapping[int, nn.Module]
    loss_fn: Callable[[Any, Any], Any]
    batch: Callable[[int, int], tuple[Any, Any]]
    optimizer: Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer] | None = None
    floor: float | None = None
    floor_name: str = "floor"
    count: Callable[[Any, Any], int] | None = None
    unit: str = "samples"
    eval_batch: Callable[[int, int], tuple[Any, Any]] | None = None
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(
                "RunModel.optimizer must be a callable from parameters to an optimizer, not an "
                "optimizer: pass e.g. lambda params: torch.optim.AdamW(params, lr=1e-3)"
            )
        for field in ("loss_fn", "batch"):
            _need(callable(getattr(self, field)), field, "a callable")
        for field in ("optimizer", "count", "eval_batch", "lr_scheduler"):
            value = getattr(self, field)
            _need(value is None or callable(value), field, "None or a callable")
        floor = self.floor
        _need(floor is None or isinstance(floor, numbers.Real), "floor", "None or a number")
        for field in ("floor_name", "unit"):
            _need(isinstance(getattr(self, field), str), field, "a str")

    def size(self, inputs: Any, targets: Any) -> int:
        """What one batch counts for in the throughput: `count`'s, or its samples."""
        if self.count is not None:
            return int(self.count(inputs, targets))
        return batch_size(inputs, "inputs", "a batch") or 0


def _need(ok: bool, field: str, what: str) -> None:
    if not ok:
        raise TypeError(f"RunModel.{field} must be {what}")


# -- loading -------------------------------------------------------------------------------------


def factory(name: str) -> Callable[..., RunModel]:
    """The factory `--model name` names: a built-in, `module:make` or `path/to/file.py:make`.

    Raises:
        UserError: nothing by that name, a module that does not import, not a callable.
    """
    if name in BUILT_IN:
        return BUILT_IN[name]
    if ":" not in name:
        raise UserError(
            f"--model {name!r}: not a built-in model ({', '.join(BUILT_IN)}), module:make or "
            "path/to/file.py:make"
        )
    make = load_object(name, what=f"--model {name}", kind="make", error=UserError)
    if not callable(make):
        raise UserError(
            f"--model {name}: names an object of type {type(make).__name__!r}, not a "
            "function make(num_segments, *, seed) -> RunModel"
        )
    return make


def build(
    name: str,
    num_segments: int,
    *,
    seed: int = 0,
    segments: Sequence[int] | None = None,
    parts: int = 1,
) -> RunModel:
    """`--model name`'s factory called for `num_segments` segments, its result checked.

    With `segments` (indices in `range(num_segments)`), the result holds `{k: module}` for just
    those: built alone by a factory that takes `segments=` (`builds_some`), else cut from the
    whole model, whose other segments are dropped. `parts` (the schedule's `num_parts`, above 1)
    goes to a factory that takes it (`takes_parts`: `tiny-gpt` pads its batches' lengths to a
    multiple of it); one that does not makes lengths that split itself.

    Raises:
        UserError: see `factory`; the factory raised (its exception's first line), returned
            something other than a `RunModel`, or other segments than asked for or a segment
            that is not a module.
    """
    make = factory(name)
    some = segments is not None and builds_some(make)
    wanted = tuple(segments) if segments is not None else None
    kwargs: dict[str, Any] = {"seed": seed}
    if some:
        kwargs["segments"] = wanted
    if parts > 1 and takes_parts(make):
        kwargs["parts"] = parts
    extra = "".join(f", {key}={value}" for key, value in kwargs.items())
    call = f"{getattr(make, '__name__', 'make')}({num_segments}{extra})"
    model = call_user(
        call, lambda: make(num_segments, **kwargs), error=UserError, where=f"--model {name}"
    )
    if not isinstance(model, RunModel):
        raise UserError(
            f"--model {name}: {call} returned a {type(model).__name__}, not a RunModel "
            "(from schedcc.backends.run.models import RunModel)"
        )
    if some:
        got = model.segments
        if not isinstance(got, Mapping) or sorted(got) != sorted(wanted):  # type: ignore[arg-type]
            keys = sorted(got) if isinstance(got, Mapping) else f"a {type(got).__name__}"
            raise UserError(
                f"--model {name}: {call} returned segments {keys}; asked for segments=, it "
                f"must return {{k: module}} for exactly {sorted(wanted)}"  # type: ignore[arg-type]
            )
        _check_modules(name, got)
        return model
    whole = model.segments
    if not isinstance(whole, Sequence) or len(whole) != num_segments:
        got = f"{len(whole)}" if isinstance(whole, Sequence) else "no sequence of"
        raise UserError(
            f"--model {name}: {call} returned {got} segment(s); the schedule needs p*v = "
            f"{num_segments}, in model order"
        )
    _check_modules(name, dict(enumerate(whole)))
    if wanted is None:
        return model
    return dataclasses.replace(model, segments={k: whole[k] for k in wanted})


def builds_some(make: Callable[..., RunModel]) -> bool:
    """Whether factory `make` takes `segments=` (builds only the segments it is given)."""
    return _takes(make, "segments")


def takes_parts(make: Callable[..., RunModel]) -> bool:
    """Whether factory `make` takes `parts=` (the sequence parts each microbatch is cut into)."""
    return _takes(make, "parts")


def _takes(make: Callable[..., RunModel], keyword: str) -> bool:
    try:
        parameters = inspect.signature(make).parameters.values()
    except (TypeError, ValueError):  # no signature to read: call it the old way
        return False
    return any(
        p.name == keyword and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
        for p in parameters
    )


def _check_modules(name: str, segments: Mapping[int, Any]) -> None:
    for k, segment in segments.items():
        if not isinstance(segment, nn.Module):
            raise UserError(
                f"--model {name}: segment {k} is a {type(segment).__name__}, not a torch.nn.Module"
            )


def check_batch(
    model: RunModel,
    name: str,
    *,
    batch_size: int,
    num_microbatches: int,
    data_parallel: int,
    field: str = "batch",
    parts: int = 1,
    seq_dim: int = 1,
) -> None:
    """Draw the first batch of `field` (`batch` or `eval_batch`) and split it as the engines
    will (into `parts` sequence parts along `seq_dim`, the schedule's); raise `UserError` if
    that fails."""
    call = f"{field}({batch_size}, 0)"
    draw = getattr(model, field)
    batch = call_user(call, lambda: draw(batch_size, 0), error=UserError, where=f"--model {name}")
    try:
        for r, (inputs, targets) in enumerate(local_batches(batch, 0, data_parallel)):
            where = f"{call} (replica {r})" if data_parallel > 1 else call
            split_pair(
                inputs, targets, num_microbatches, where=where, parts=parts, seq_dim=seq_dim
            )
    except ScheduleConfigError as exc:
        raise UserError(f"--model {name}: {exc}") from None


# -- built-in models -----------------------------------------------------------------------------


def tiny_gpt(
    num_segments: int,
    *,
    seed: int = 0,
    segments: Sequence[int] | None = None,
    parts: int = 1,
) -> RunModel:
    """The GPT of `backends/run/gpt.py` (32 wide, `max(4, num_segments)` blocks, LM head tied to
    the token embedding) on padded bigram sequences of 8 to 32 tokens (the length varies); the
    boundary value is `(x, pad_mask, pos_ids)` and the floor is the chain's entropy. With
    `segments`, only those are built (`gpt_segment`), with the whole model's values.

    Its segments take sequence parts (a schedule's `num_parts`, e.g. seq1f1b's) and their carry
    ([Note: the GPT's carry] in `backends.run.gpt`); with `parts` each batch is padded on the
    right to a multiple of `parts` tokens (padding: the loss and the position ids are those of
    the unpadded batch), and `parts=1` draws exactly the batches it draws without."""
    data = PaddedBigramData(vocab=64, max_len=32, min_len=8, seed=seed, pad_to_multiple_of=parts)
    config = GPTConfig(vocab=data.vocab, max_len=data.max_len, num_blocks=max(4, num_segments))
    if segments is None:
        built: Any = gpt_segments(GPT(config, seed=seed), num_segments)
    else:
        built = {k: gpt_segment(config, k, num_segments, seed=seed) for k in segments}
    return RunModel(
        built,
        GPT_LOSS,
        data.batch,
        floor=data.entropy,
        floor_name="entropy floor",
        count=real_tokens,
        unit="tokens",
        eval_batch=held_out(data.batch),
    )


def mlp(num_segments: int, *, seed: int = 0, segments: Sequence[int] | None = None) -> RunModel:
    """`mlp_segments` learning `TeacherData` (MSE); the floor is the noise variance."""
    data = TeacherData(seed=seed)
    built = mlp_segments(num_segments, width=data.width, seed=seed, segments=segments)
    return RunModel(
        built,
        F.mse_loss,
        data.batch,
        floor=data.entropy,
        floor_name="noise floor",
        eval_batch=held_out(data.batch),
    )


#: The step from which `held_out` draws: no training run comes near it.
HELD_OUT = 2**40


def held_out(batch: Callable[[int, int], Any]) -> Callable[[int, int], Any]:
    """An `eval_batch` for data drawn by step: batch `k` is step `HELD_OUT + k`'s, which
    training never draws (for a `batch` whose steps draw independent samples)."""

    def eval_batch(batch_size: int, k: int):
        return batch(batch_size, HELD_OUT + k)

    return eval_batch


#: The models `--model` knows by name.
BUILT_IN: dict[str, Callable[..., RunModel]] = {"tiny-gpt": tiny_gpt, "mlp": mlp}


class TeacherData:
    """Inputs `x ~ N(0, 1)` and targets `x @ W + noise`; `entropy` here is the MSE floor."""

    def __init__(self, width: int = 32, seed: int = 0, noise: float = 0.1):
        gen = torch.Generator().manual_seed(seed)
        self.weight = torch.randn(width, width, generator=gen, dtype=torch.float64) / width**0.5
        self.width, self.seed, self.noise = width, seed, noise

    @property
    def entropy(self) -> float:
        """The noise variance: the lowest mean squared error any model can reach."""
        return self.noise**2

    def batch(self, batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(x, y)`, each `(batch_size, width)` in the default dtype; a pure function of `step`."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        x = torch.randn(batch_size, self.width, generator=gen, dtype=torch.float64)
        noise = torch.randn(batch_size, self.width, generator=gen, dtype=torch.float64)
        y = x @ self.weight + self.noise * noise
        dtype = torch.get_default_dtype()
        return x.to(dtype), y.to(dtype)


def split_evenly(layers: list[nn.Module], num_segments: int) -> list[nn.Module]:
    """`layers` cut into `num_segments` contiguous `nn.Sequential`s, sizes differing by <= 1.

    Raises:
        ValueError: fewer layers than segments.
    """
    return [nn.Sequential(*layers[lo:hi]) for lo, hi in _even_ranges(len(layers), num_segments)]


def _even_ranges(num_layers: int, num_segments: int) -> list[tuple[int, int]]:
    """Each segment's `(lo, hi)` layers, sizes differing by <= 1, the larger first."""
    if num_segments > num_layers:
        raise ValueError(
            f"cannot cut {num_layers} layers into {num_segments} segments; "
            "use fewer stages/chunks or a deeper model"
        )
    base, extra = divmod(num_layers, num_segments)
    ranges, start = [], 0
    for k in range(num_segments):
        size = base + (1 if k < extra else 0)
        ranges.append((start, start + size))
        start += size
    return ranges


def mlp_segments(
    num_segments: int,
    *,
    width: int = 32,
    num_layers: int | None = None,
    seed: int = 0,
    segments: Sequence[int] | None = None,
) -> Any:
    """An MLP of `Linear(width, width)` + `Tanh` layers (the last without), cut evenly.

    Layer `i` is initialised as `nn.Linear` is (uniform within `1/sqrt(width)`) from a generator
    seeded by `seed` and `i`, so with `segments` (indices) only those are built, as
    `{k: nn.Sequential}`, with the values they have in the whole MLP.
    """
    torch.manual_seed(seed)  # the global RNG as callers have known it
    num_layers = num_layers or max(4, num_segments)
    ranges = _even_ranges(num_layers, num_segments)

    def layer(index: int) -> nn.Module:
        linear = nn.Linear(width, width)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
        bound = 1 / width**0.5
        with torch.no_grad():
            linear.weight.uniform_(-bound, bound, generator=gen)
            linear.bias.uniform_(-bound, bound, generator=gen)
        return linear if index == num_layers - 1 else nn.Sequential(linear, nn.Tanh())

    def segment(k: int) -> nn.Module:
        lo, hi = ranges[k]
        return nn.Sequential(*(layer(i) for i in range(lo, hi)))

    if segments is None:
        return [segment(k) for k in range(num_segments)]
    return {k: segment(k) for k in segments}
