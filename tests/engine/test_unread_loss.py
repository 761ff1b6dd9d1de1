"""`read_loss=False`: a step reads nothing on the host, its loss is a 0-dim float64 device tensor
holding exactly the float a reading run returns, and what needs the number is refused or still
reads it ([Note: host syncs], [Note: one run ahead] in `backends/runtime/syncs.py`). The NCCL
path's count is in tests/distributed/test_nccl_path.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _models import batches as make_batches
from _models import make_segments

import schedcc
from schedcc.backends.local import Engine
from schedcc.backends.runtime.syncs import HostSyncs, RunEnds, read_within
from schedcc.errors import ScheduleConfigError


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _parts(output, target):
    """A dict loss: the objective's parts, each reported."""
    return {"mse": F.mse_loss(output, target), "size": 0.1 * output.abs().mean()}


def _ratio(output, target):
    """A `(loss_sum, count)` loss with a Python count."""
    return (output - target).pow(2).sum(), target.numel()


def _engine(name: str, shape: tuple, loss_fn, *, data_parallel: int = 1, **compiled) -> Engine:
    cls = schedcc.get_schedule(name)
    schedule = cls(*shape)
    program = schedcc.compile(schedule, data_parallel=data_parallel, **compiled)
    segments = make_segments(schedule.num_segments // cls.num_replicas, seed=2) * cls.num_replicas
    return Engine(program, segments, loss_fn, _sgd)


def _counted(step) -> list[int]:
    counts = []
    for _ in range(3):
        before = HostSyncs.count
        step()
        counts.append(HostSyncs.count - before)
    return counts


def test_a_step_reads_the_host_once_for_its_loss_and_never_without():
    """On the local engine a steady step of a program without `GradNorm` or ties makes one
    counted host read when its loss is read, none when it is not."""
    engine = _engine("1f1b", (2, 4), F.mse_loss)
    ((x, y),) = make_batches(1, 8)
    assert _counted(lambda: engine.train_step(x, y)) == [1, 1, 1]
    assert _counted(lambda: engine.train_step(x, y, read_loss=False)) == [0, 0, 0]


def test_a_grad_norm_step_still_reads_its_norm_alone():
    """`GradNorm` decides the step (skip, clip, loss scale) on the host: each stage's read of
    the norm stays (the local engine holds both stages), the loss's goes."""
    engine = _engine("1f1b", (2, 4), F.mse_loss, grad_norm=True)
    ((x, y),) = make_batches(1, 8)
    assert _counted(lambda: engine.train_step(x, y)) == [3, 3, 3]
    assert _counted(lambda: engine.train_step(x, y, read_loss=False)) == [2, 2, 2]


@pytest.mark.parametrize(
    ("name", "shape", "loss_fn", "data_parallel"),
    [
        ("1f1b", (2, 4), _parts, 1),
        ("1f1b", (2, 2), _ratio, 2),
        ("dualpipe", (2, 4, 2), _parts, 1),
        ("2bw", (2, 4, 1, 2), F.mse_loss, 1),
    ],
    ids=["dict-loss", "ratio-dp2", "dualpipe-two-last-stages", "2bw-two-batches-a-run"],
)
def test_unread_losses_hold_the_read_floats_exactly(name, shape, loss_fn, data_parallel):
    """Each yielded tensor and `last_metrics` value is 0-dim float64 and equals, bit for bit,
    the float a reading run of the same training returns; the weights end the same."""
    reading, unread = (_engine(name, shape, loss_fn, data_parallel=data_parallel) for _ in "ab")
    batches = make_batches(4, 8 * data_parallel, seed=3)
    floats = list(reading.train(batches))
    tensors = list(unread.train(batches, read_loss=False))
    assert all(type(f) is float for f in floats)
    assert all(t.dtype == torch.float64 and t.dim() == 0 for t in tensors)
    assert [t.item() for t in tensors] == floats
    assert {k: v.item() for k, v in unread.last_metrics.items()} == reading.last_metrics
    assert len(reading.last_metrics) == (3 if loss_fn is _parts else 1)
    for got, want in zip(unread.segments, reading.segments):
        for p, q in zip(got.parameters(), want.parameters()):
            assert torch.equal(p, q)


def test_an_unread_loss_with_on_step_is_refused():
    """A step record holds the loss as a number: `on_step` with `read_loss=False` is refused
    before anything runs, naming both, and so is a `read_loss` that is not a bool."""
    engine = _engine("1f1b", (2, 2), F.mse_loss)
    ((x, y),) = make_batches(1, 4)
    with pytest.raises(ScheduleConfigError, match=r"on_step .* read_loss=False"):
        engine.train_step(x, y, read_loss=False, on_step=print)
    with pytest.raises(ScheduleConfigError, match=r"on_step .* read_loss=False"):
        next(engine.train([(x, y)], read_loss=False, on_step=print))
    with pytest.raises(ScheduleConfigError, match=r"read_loss must be True .* got 'no'"):
        engine.train_step(x, y, read_loss="no")
    assert engine.steps == 0


class _Event:
    """A stand-in for `torch.cuda.Event`: passed after `pending` queries."""

    def __init__(self, pending: float) -> None:
        self.pending = pending
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.queries > self.pending


def test_a_run_that_reads_nothing_waits_for_the_previous_run_only():
    """`RunEnds.pace` marks each CUDA device at a run's end and waits for the previous run's
    mark alone (this run's stays queued); nothing on the CPU; a mark that never passes ends the
    wait by the timeout."""
    marks: list[_Event] = []

    def record(device):
        marks.append(_Event(pending=2 if len(marks) == 0 else float("inf")))
        return marks[-1]

    ends = RunEnds(record)
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert ends.pace([cpu], 1.0)
    assert marks == []
    assert ends.pace([gpu, cpu], 1.0)  # the first run's end: nothing before it
    assert [m.queries for m in marks] == [0]
    assert ends.pace([gpu], 1.0)  # waits until the first mark passes, not for its own
    assert [m.queries for m in marks] == [3, 0]
    assert not ends.pace([gpu], 0.01)  # the second mark never passes: the timeout
    assert marks[1].queries > 1
    assert marks[2].queries == 0


def test_a_bounded_read_on_the_cpu_is_one_counted_read():
    before = HostSyncs.count
    assert read_within(torch.tensor([1.5, 2.0], dtype=torch.float64), 0.0) == [1.5, 2.0]
    assert HostSyncs.count == before + 1
