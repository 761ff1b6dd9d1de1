"""A per-step metrics stream: one record per optimizer step, to JSONL or TensorBoard.

`engine.train(batches, on_step=writer)` (and `train_step(..., on_step=writer)`) calls `on_step`
with each step's record, a dict (see `step_records`), on the one process that writes: the local
engine's, or global rank 0 of the distributed engine. A writer is any callable taking the
record; `JsonlWriter(path)` appends one JSON line per step and `TensorBoardWriter(directory)`
one scalar per number; `open_metrics("run.jsonl")` or `open_metrics("tb:DIR")` picks one, as
`schedcc run --metrics` does.

    >>> # with open_metrics("run.jsonl") as writer:
    >>> #     for loss in engine.train(batches, on_step=writer): ...

[Note: metrics without host syncs] A record holds only what the engine already has on the host
after a run ([Note: host syncs] in `backends.runtime.syncs`): the losses and their named parts
(read once at the run's end), the gradient norm (read by `GradNorm` to decide the step), the loss
scale and skipped-step count (Python numbers), the learning rate (the optimizer's
`param_groups[0]["lr"]`, a Python number) and wall-clock times. Building and writing records
reads no device tensor. A record holds the loss as a number, so `on_step` needs the run to read
it: with `train(..., read_loss=False)`, which reads nothing, it is refused
(`backends.engine.BaseEngine.train`).
"""

from __future__ import annotations

import abc
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from schedcc.errors import ScheduleConfigError

__all__ = [
    "TENSORBOARD_PREFIX",
    "JsonlWriter",
    "MetricsWriter",
    "OnStep",
    "StepRecord",
    "TensorBoardWriter",
    "open_metrics",
    "spec_problem",
    "step_records",
    "tensorboard_available",
]

#: One optimizer step's record (see `step_records` for its keys).
StepRecord = dict[str, Any]
#: What `train(..., on_step=)` calls with each step's record.
OnStep = Callable[[StepRecord], None]
#: `open_metrics`' prefix for a TensorBoard log directory.
TENSORBOARD_PREFIX = "tb:"


def step_records(
    losses: list[tuple[float, dict[str, float]]],
    *,
    first_step: int,
    seconds: float,
    lr: float | None,
    grad_norm: float | None,
    loss_scale: float | None,
    skipped_steps: int,
) -> list[StepRecord]:
    """The records of one run's steps, from what the engine holds on the host after it.

    Keys: `step` (optimizer steps taken once this one is: 1 for the first, as `engine.steps`),
    `loss`, `parts` (the loss's named parts: a dict loss's, else `{"loss": ...}`; the
    distributed engine's parts are its last stage's, so rank 0 of a pipeline of several stages
    has only `{"loss": ...}` there), `time_s` (the run's wall time over its steps), `lr` (the
    rate the step used), `grad_norm` (before clipping; None without `GradNorm`), `loss_scale`
    (float16's, else None) and `skipped_steps` (the count so far). A run covers `num_batches`
    steps and the rate, norm, scale and count are read between runs: with `num_batches=1`
    (every flush schedule's default) each record has its own step's; with more, `lr` is on the
    run's first record and the others on its last, None on the rest of the run.
    """
    count = len(losses)
    records = []
    for k, (loss, parts) in enumerate(losses):
        last = k == count - 1
        records.append(
            {
                "step": first_step + k + 1,
                "loss": loss,
                "parts": dict(parts),
                "time_s": seconds / count,
                "lr": lr if k == 0 else None,
                "grad_norm": grad_norm if last else None,
                "loss_scale": loss_scale if last else None,
                "skipped_steps": skipped_steps if last else None,
            }
        )
    return records


class MetricsWriter(abc.ABC):
    """A sink for step records: call it with each, `close()` it after (or use `with`)."""

    @abc.abstractmethod
    def __call__(self, record: StepRecord) -> None:
        """Write one step's record."""

    @abc.abstractmethod
    def close(self) -> None:
        """Flush and close what the writer holds."""

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class JsonlWriter(MetricsWriter):
    """One JSON object per line per step, flushed after each (a NaN or inf loss is written as
    JSON's `NaN`/`Infinity`, which Python's `json` reads back).

    Args:
        path: the file; created, or truncated unless `append`.
        append: add to an existing file (a resumed run continues its stream).

    Raises:
        ScheduleConfigError: the file cannot be opened for writing (the reason named).
    """

    def __init__(self, path: str | os.PathLike, *, append: bool = False) -> None:
        self.path = Path(path)
        try:
            self._file = open(self.path, "a" if append else "w", encoding="utf-8")  # noqa: SIM115
        except OSError as exc:
            raise ScheduleConfigError(
                f"metrics file {path}: cannot write it ({exc.strerror or exc}); give a file in a "
                "directory you can write to"
            ) from None

    def __call__(self, record: StepRecord) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardWriter(MetricsWriter):
    """One scalar per number of each record (`train/loss`, `train/parts/<name>`, `train/lr`,
    ...), at the record's step, through `torch.utils.tensorboard.SummaryWriter`.

    Raises:
        ScheduleConfigError: the `tensorboard` package is not installed.
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        if not tensorboard_available():
            raise ScheduleConfigError(
                f"metrics {TENSORBOARD_PREFIX}{directory}: TensorBoard logs need the "
                "`tensorboard` package (pip install tensorboard); or write JSONL with a file "
                "name instead"
            )
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(directory))

    def __call__(self, record: StepRecord) -> None:
        step = record["step"]
        for name, value in _scalars(record):
            self._writer.add_scalar(f"train/{name}", value, step)

    def close(self) -> None:
        self._writer.close()


def _scalars(record: StepRecord) -> list[tuple[str, float]]:
    """`(name, value)` of every number in `record` but the step (parts as `parts/<name>`)."""
    out = [(f"parts/{name}", value) for name, value in record.get("parts", {}).items()]
    out += [
        (name, value)
        for name, value in record.items()
        if name not in ("step", "parts")
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
    ]
    return [(name, float(value)) for name, value in out if not math.isnan(float(value))]


def tensorboard_available() -> bool:
    """Whether the `tensorboard` package (which `SummaryWriter` needs) is installed."""
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None


def spec_problem(spec: str) -> str | None:
    """What makes `spec` (`open_metrics`' argument, `schedcc run --metrics`) unusable before
    anything is written, in words that follow the spec, or None."""
    if spec.startswith(TENSORBOARD_PREFIX):
        if not spec[len(TENSORBOARD_PREFIX) :]:
            prefix = TENSORBOARD_PREFIX
            return f"{prefix} needs a log directory, e.g. {prefix}runs/first"
        if not tensorboard_available():
            return (
                f"{spec}: TensorBoard logs need the tensorboard package (pip install "
                "tensorboard); or give a .jsonl file name"
            )
        return None
    if not spec:
        return f"needs a file name, e.g. run.jsonl, or {TENSORBOARD_PREFIX}DIR"
    if os.path.isdir(spec):
        return (
            f"{spec} is a directory; give a file name, e.g. {spec}/metrics.jsonl, or "
            f"{TENSORBOARD_PREFIX}{spec} for TensorBoard"
        )
    return None


def open_metrics(spec: str, *, append: bool = False) -> MetricsWriter:
    """The writer `spec` names: `"tb:DIR"` a `TensorBoardWriter` logging to DIR, anything else a
    `JsonlWriter` to that file (`append` as its).

    Raises:
        ScheduleConfigError: an empty spec, a path that is a directory, a file that cannot be
            written, or `tb:` without the `tensorboard` package.
    """
    problem = spec_problem(spec)
    if problem is not None:
        raise ScheduleConfigError(f"metrics {problem}")
    if spec.startswith(TENSORBOARD_PREFIX):
        return TensorBoardWriter(spec[len(TENSORBOARD_PREFIX) :])
    return JsonlWriter(spec, append=append)
