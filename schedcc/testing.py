"""Test helpers for schedule authors: hypothesis strategies for shapes, and `check_schedule`.

Use them in your own test suite (needs `hypothesis`, in the `test` extra; no torch):

    from schedcc.testing import check_schedule
    from my_package.schedules import MySchedule

    def test_my_schedule_is_valid_for_every_shape():
        check_schedule(MySchedule, max_examples=200)

`check_schedule` compiles, validates and simulates the schedule over many shapes
`(p, m, v, batches)`; on a failure hypothesis shrinks to the smallest failing shape, which the
`ScheduleCheckError` names together with the validator's explanation. The chunk count v is drawn
from the schedule's own `chunks`, and shapes its constructor rejects (`ScheduleConfigError`) are
skipped, so each schedule is tried only where it claims to work.

With `numerics=True` it also trains a tiny float64 model with each compiled program on the local
backend (two batches, SGD) and compares losses and weights with non-pipelined training (tolerance
1e-10); that needs torch, imported only then. A schedule with sequence parts trains segments
whose carry is a running sum over the sequence, against the reference on the whole sequences.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from hypothesis.errors import Unsatisfiable
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "schedcc.testing needs hypothesis: pip install 'schedcc[test]' (or hypothesis)"
    ) from error

from schedcc.compiler import compile as compile_schedule
from schedcc.errors import ScheduleConfigError, ScheduleError
from schedcc.program import Program
from schedcc.registry import build_schedule
from schedcc.schedule import Schedule

__all__ = ["ScheduleCheckError", "Shape", "check_schedule", "schedules", "shapes"]


@attrs.frozen(slots=True)
class Shape:
    """A schedule shape: the four constructor arguments of every `Schedule`."""

    num_stages: int
    num_microbatches: int
    num_chunks: int = 1
    num_batches: int = 1

    def build(self, schedule_cls: type[Schedule]) -> Schedule:
        """`schedule_cls` at this shape (raises its `ScheduleConfigError` if it rejects it, a
        `ScheduleCodeError` if its constructor fails otherwise)."""
        return build_schedule(
            schedule_cls,
            self.num_stages,
            self.num_microbatches,
            num_chunks=self.num_chunks,
            num_batches=self.num_batches,
        )

    def accepted_by(self, schedule_cls: type[Schedule]) -> bool:
        """Whether `schedule_cls`'s constructor accepts this shape."""
        try:
            self.build(schedule_cls)
        except ScheduleConfigError:
            return False
        return True

    def __str__(self) -> str:
        return (
            f"p={self.num_stages}, m={self.num_microbatches}, v={self.num_chunks}, "
            f"batches={self.num_batches}"
        )


class ScheduleCheckError(AssertionError):
    """`check_schedule` found a shape where the schedule fails; `shape` is the smallest found.

    Attributes:
        schedule_cls: the schedule checked.
        shape: the failing shape.
        cause: the error the compiler or validator raised there.
    """

    def __init__(self, schedule_cls: type[Schedule], shape: Shape, cause: BaseException):
        super().__init__(
            f"{schedule_cls.__name__} fails at {shape} (the smallest failing shape found): "
            f"{type(cause).__name__}: {cause}"
        )
        self.schedule_cls = schedule_cls
        self.shape = shape
        self.cause = cause


def shapes(
    schedule_cls: type[Schedule] | None = None,
    *,
    max_stages: int = 8,
    max_microbatches: int = 32,
    max_chunks: int = 4,
    max_batches: int = 3,
) -> st.SearchStrategy[Shape]:
    """Shapes within the bounds that `schedule_cls`'s constructor accepts (all, if None).

    `num_chunks` is drawn from the class's `chunks` up to `max_chunks` (1 for 1F1B, 2 for
    ZB-V), so no draw is wasted on a count it does not run. Every field shrinks toward its
    smallest value.

    Raises:
        ScheduleConfigError: none of the class's `chunks` is at most `max_chunks`.

    >>> from hypothesis import given
    >>> from schedcc.schedules.one_f_one_b import OneFOneB
    >>> @given(shapes(OneFOneB, max_stages=4))
    ... def test_1f1b_shapes(shape):
    ...     assert shape.num_chunks == 1 and shape.num_stages <= 4
    >>> test_1f1b_shapes()
    """
    chunks = st.integers(1, max_chunks)
    if schedule_cls is not None:
        counts = schedule_cls.chunk_counts(max_chunks)
        if not counts:
            raise ScheduleConfigError(
                f"{schedule_cls.__name__} runs none of v <= max_chunks = {max_chunks} (its "
                f"chunks = {schedule_cls.chunks!r}); raise max_chunks"
            )
        chunks = st.sampled_from(counts)
    strategy = st.builds(
        Shape,
        num_stages=st.integers(1, max_stages),
        num_microbatches=st.integers(1, max_microbatches),
        num_chunks=chunks,
        num_batches=st.integers(1, max_batches),
    )
    if schedule_cls is None:
        return strategy
    return strategy.filter(lambda shape: shape.accepted_by(schedule_cls))


def schedules(schedule_cls: type[Schedule], **bounds: int) -> st.SearchStrategy[Schedule]:
    """Instances of `schedule_cls` at shapes from `shapes(schedule_cls, **bounds)`."""
    return shapes(schedule_cls, **bounds).map(lambda shape: shape.build(schedule_cls))


def _check_simulates(schedule: Schedule, program: Program) -> None:
    """The program simulates, finishing after its busiest stage, with at most d + 1 versions."""
    from schedcc.simulate import simulate

    timeline = simulate(program)
    if timeline.makespan < max(timeline.busy):
        raise ScheduleError(
            f"simulated makespan {timeline.makespan} is shorter than a stage's busy time "
            f"{max(timeline.busy)}"
        )
    if max(timeline.peak_versions) > schedule.weight_delay + 1:
        raise ScheduleError(
            f"a stage keeps {max(timeline.peak_versions)} weight versions; weight_delay "
            f"{schedule.weight_delay} allows {schedule.weight_delay + 1}"
        )


def _check_numerics(schedule: Schedule, program: Program) -> None:
    """Train a tiny float64 model with `program`; it must equal non-pipelined training."""
    import torch

    from schedcc.backends.reference import assert_matches_reference

    width = 3
    gen = torch.Generator().manual_seed(0)
    segments = []
    replicas = type(schedule).num_replicas  # each replica holds the same modules again
    for _ in range(schedule.num_segments // replicas):
        layer = torch.nn.Linear(width, width, dtype=torch.float64)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(width, width, generator=gen, dtype=torch.float64))
            layer.bias.copy_(torch.randn(width, generator=gen, dtype=torch.float64))
        segments.append(torch.nn.Sequential(layer, torch.nn.Tanh()))
    segments *= replicas
    parts = schedule.num_parts
    rows = schedule.num_microbatches // parts * program.data_parallel
    shape = (rows, width) if parts == 1 else (rows, 2 * parts, width)  # (batch, seq, width)
    if parts > 1:  # the sequence parts' calling convention: a running sum is the carry
        segments = _prefix_sums(segments)
    batches = [
        (
            torch.randn(shape, generator=gen, dtype=torch.float64),
            torch.randn(shape, generator=gen, dtype=torch.float64),
        )
        for _ in range(schedule.num_batches)
    ]
    assert_matches_reference(
        program,
        segments,
        torch.nn.functional.mse_loss,
        lambda params: torch.optim.SGD(params, lr=0.1),
        batches,
        atol=1e-10,
    )


def _prefix_sums(segments: list) -> list:
    """`segments` taking sequence parts: each position sees the sum over the positions up to it
    (`seq_dim` 1), the parts before its own arriving as the carry."""
    import torch

    class PrefixSum(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x, carry=None):
            total = self.inner(x).cumsum(dim=1)
            if carry is not None:
                total = total + carry
            return total.tanh(), total[:, -1:]

    return [PrefixSum(segment) for segment in segments]


def _per_shape_checks(numerics: bool) -> list[Callable[[Schedule, Program], None]]:
    checks = [_check_simulates]
    if numerics:
        checks.append(_check_numerics)
    return checks


def check_schedule(
    schedule_cls: type[Schedule],
    *,
    max_examples: int = 100,
    max_stages: int = 8,
    max_microbatches: int = 32,
    max_chunks: int = 4,
    max_batches: int = 3,
    data_parallel: int = 1,
    zero: int = 0,
    numerics: bool = False,
) -> None:
    """Compile, validate and simulate `schedule_cls` over many shapes; fail with the smallest bad
    shape.

    Args:
        schedule_cls: the `Schedule` subclass to check.
        max_examples: shapes hypothesis tries (more find rarer failures).
        max_stages, max_microbatches, max_chunks, max_batches: bounds of the shapes tried.
        data_parallel, zero: passed to `schedcc.compile` (checks the update placement too).
        numerics: also train a tiny float64 model on the local backend per shape and compare
            it with non-pipelined training (needs torch; slower, so use fewer examples).

    Raises:
        ScheduleCheckError: an `AssertionError` naming the smallest failing shape and the
            compiler's or validator's explanation.
        ScheduleConfigError: the constructor accepts no shape within the bounds.

    >>> from schedcc.schedules.gpipe import GPipe
    >>> check_schedule(GPipe, max_examples=5, max_stages=3, max_microbatches=4)
    """
    checks = _per_shape_checks(numerics)
    bounds = {
        "max_stages": max_stages,
        "max_microbatches": max_microbatches,
        "max_chunks": max_chunks,
        "max_batches": max_batches,
    }

    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        report_multiple_bugs=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(shapes(schedule_cls, **bounds))
    def check_one(shape: Shape) -> None:
        schedule = shape.build(schedule_cls)
        try:
            program = compile_schedule(schedule, data_parallel=data_parallel, zero=zero)
            for check in checks:
                check(schedule, program)
        except Exception as error:
            raise ScheduleCheckError(schedule_cls, shape, error) from error

    try:
        check_one()
    except Unsatisfiable as error:
        raise ScheduleConfigError(
            f"check_schedule: {schedule_cls.__name__}'s constructor rejects every shape tried "
            f"within p <= {max_stages}, m <= {max_microbatches}, v <= {max_chunks}, "
            f"batches <= {max_batches}; widen the bounds"
        ) from error
