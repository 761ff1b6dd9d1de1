"""Recomputing every N layers inside a segment: `Engine(..., recompute_layers=N)`.

Each `nn.Sequential` segment keeps only every N-th layer boundary and replays each group of N
layers in the backward. Training is unchanged (float64, on the local engine and on gloo ranks,
with full and split backwards, stashed weights and tied copies), and the measured activation
bytes go down.
"""

from __future__ import annotations

import copy
import re
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _cli import run_cli
from _models import largest_difference, tanh_batches
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import schedcc
from schedcc.backends.distributed.engine import Engine as DistEngine
from schedcc.backends.local import Engine
from schedcc.backends.reference import train_reference
from schedcc.backends.run.launch import spawn
from schedcc.backends.runtime.memory import measure_memory
from schedcc.errors import ScheduleConfigError

WIDTH = 4
#: schedules with full backwards, split backwards (I/W) and two chunks per stage
SCHEDULES = [("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2)]


def _layered(num_segments: int, num_layers: int = 4, *, seed: int = 0, dropout: float = 0.0):
    """`num_segments` float64 `nn.Sequential`s of `num_layers` layers each (Linear, GELU,
    Linear, Dropout: each layer saves more than its input)."""
    torch.manual_seed(seed)

    def layer() -> nn.Module:
        return nn.Sequential(
            nn.Linear(WIDTH, 2 * WIDTH, dtype=torch.float64),
            nn.GELU(),
            nn.Linear(2 * WIDTH, WIDTH, dtype=torch.float64),
            nn.Dropout(dropout),
        )

    return [nn.Sequential(*(layer() for _ in range(num_layers))) for _ in range(num_segments)]


def _adam(params):
    return torch.optim.Adam(params, lr=0.02)


def _trained(name: str, v: int, every: int | None, *, recompute=False, num_layers: int = 4):
    """The engine and its losses after 3 steps of `name` on p=2, m=4."""
    program = schedcc.compile(schedcc.get_schedule(name)(2, 4, v), recompute=recompute)
    segments = _layered(2 * v, num_layers)
    engine = Engine(program, segments, F.mse_loss, _adam, recompute_layers=every)
    return engine, list(engine.train(tanh_batches(3)))


@pytest.mark.parametrize(("name", "v"), SCHEDULES)
@pytest.mark.parametrize("every", [1, 3])
def test_recomputing_every_n_layers_trains_exactly(name, v, every):
    """With full and split backwards, training with every N-th layer boundary kept equals
    non-pipelined training at 1e-12 (losses and every parameter)."""
    engine, losses = _trained(name, v, every)
    reference = _layered(2 * v)
    expected = train_reference(reference, F.mse_loss, _adam, tanh_batches(3))
    assert largest_difference(losses, expected, engine.segments, reference) < 1e-12


@given(
    schedule=st.sampled_from(SCHEDULES),
    num_layers=st.integers(1, 5),
    every=st.integers(1, 6),
    recompute=st.booleans(),
)
def test_any_group_size_trains_like_the_plain_engine(schedule, num_layers, every, recompute):
    """Any group size (larger than the segment too), with or without whole-segment recompute,
    trains as the engine without layer recomputation does, to 1e-12."""
    name, v = schedule
    engine, losses = _trained(name, v, every, recompute=recompute, num_layers=num_layers)
    plain, expected = _trained(name, v, None, num_layers=num_layers)
    assert largest_difference(losses, expected, engine.segments, plain.segments) < 1e-12


def test_fewer_boundaries_kept_hold_fewer_activation_bytes():
    """The measured peak activation bytes of every stage fall as the groups grow: all layers
    in one group < one layer per group < no layer recomputation."""
    peaks = {every: _trained("1f1b", 1, every)[0].peak_activation_bytes for every in (None, 1, 4)}
    for stage in range(2):
        assert peaks[4][stage] < peaks[1][stage] < peaks[None][stage], peaks


@pytest.mark.parametrize(("name", "v"), [*SCHEDULES, ("2bw", 1)])
@pytest.mark.parametrize("recompute", [False, True])
def test_simulated_activation_bytes_equal_the_measured_ones(name, v, recompute):
    """With a memory model measured with the same `recompute_layers`, the simulator's peak
    activation bytes per stage are exactly what the engine measures."""
    program = schedcc.compile(schedcc.get_schedule(name)(2, 4, v), recompute=recompute)
    x, y = tanh_batches(1)[0]
    memory = measure_memory(_layered(2 * v), x[:2], y[:2], F.mse_loss, recompute_layers=3)
    engine = Engine(program, _layered(2 * v), F.mse_loss, _adam, recompute_layers=3)
    list(engine.train(tanh_batches(program.schedule.num_batches)))
    timeline = schedcc.simulate(program, schedcc.CostModel(memory=memory))
    assert list(timeline.peak_activation_bytes) == engine.peak_activation_bytes


def test_a_replayed_group_draws_the_same_dropout_masks():
    """With dropout, a group replayed in the backward draws the masks its forward drew: the
    run equals the same run without layer recomputation, from the same RNG state."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4))
    runs = []
    for every in (None, 2):
        segments = _layered(2, dropout=0.3)
        torch.manual_seed(7)
        engine = Engine(program, segments, F.mse_loss, _adam, recompute_layers=every)
        runs.append((list(engine.train(tanh_batches(3))), segments))
    (losses, segments), (expected, plain) = runs[1], runs[0]
    assert largest_difference(losses, expected, segments, plain) < 1e-12


@pytest.mark.parametrize("name", ["2bw", "1f1b"])
def test_stashed_weights_and_tied_copies_are_replayed_on_what_the_forward_used(name):
    """Under weight stashing (2BW) and for a tied parameter's private copy, a group is
    replayed on the tensors its forward ran on, not on the live parameters: the run equals
    the one without layer recomputation."""
    results = []
    for every in (None, 1):
        segments = _layered(2)
        segments[1][-1][0].weight = segments[0][0][0].weight  # one Parameter in both
        program = schedcc.compile(
            schedcc.get_schedule(name)(2, 4, num_batches=3), tied=schedcc.tied_groups(segments)
        )
        engine = Engine(program, segments, F.mse_loss, _adam, recompute_layers=every)
        results.append((list(engine.train(tanh_batches(3))), segments))
    (losses, segments), (expected, plain) = results[1], results[0]
    assert largest_difference(losses, expected, segments, plain) < 1e-12


@pytest.mark.parametrize(
    ("segment", "why"),
    [
        (nn.Linear(WIDTH, WIDTH), "segment 1 is a Linear"),
        (nn.Sequential(), "segment 1 is an empty nn.Sequential"),
    ],
)
def test_a_segment_without_layers_to_group_is_refused(segment, why):
    """A segment that is not an `nn.Sequential` of layers is refused, naming it and the way
    to recompute it whole."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 2))
    segments = [_layered(1)[0], segment]
    with pytest.raises(ScheduleConfigError, match=why) as info:
        Engine(program, segments, F.mse_loss, _adam, recompute_layers=2)
    assert "recompute=" in str(info.value)


@pytest.mark.parametrize("every", [0, -1, 1.5, "2", True])
def test_a_group_size_that_is_not_a_positive_int_is_refused(every):
    """`recompute_layers` is None or a positive int; anything else is refused by name."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 2))
    with pytest.raises(ScheduleConfigError, match="recompute_layers must be"):
        Engine(program, _layered(2), F.mse_loss, _adam, recompute_layers=every)


# -- on gloo ranks --------------------------------------------------------------------------------


def gloo_worker(rank: int, world_size: int, name: str, options: dict) -> int:
    """Rank `rank` of 2 trains `_layered(2)` with `name` on an engine given `options`, and
    checks it against non-pipelined training at 1e-12."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    program = schedcc.compile(schedcc.get_schedule(name)(2, 4))
    segments = _layered(2)
    reference = copy.deepcopy(segments)
    engine = DistEngine(program, segments, F.mse_loss, _adam, timeout=50, **options)
    losses = list(engine.train(tanh_batches(3)))
    expected = train_reference(reference, F.mse_loss, _adam, tanh_batches(3))
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-12, (losses, expected)
    for a, b in zip(engine.modules[0].parameters(), reference[engine.stage].parameters()):
        assert (a - b).abs().max().item() < 1e-12, rank
    dist.destroy_process_group()
    return 0


@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_on_gloo_ranks_recomputing_every_two_layers_trains_exactly(name):
    """On 2 gloo ranks, 1f1b and zb-h1 (split backwards) with every 2nd layer boundary kept
    equal non-pipelined training at 1e-12."""
    options = {"recompute_layers": 2}
    assert spawn(gloo_worker, 2, (name, options), grace=60, threads=1) == 0


# -- schedcc run ----------------------------------------------------------------------------------


def test_schedcc_run_recompute_layers_passes_its_check():
    """`schedcc run --model mlp --recompute-layers 1 --check` trains exactly."""
    result = run_cli("--model", "mlp", "--recompute-layers", "1", "--steps", "3", "--check")
    assert result.returncode == 0, result.stderr
    assert re.search(r"check: .*: ok", result.stdout), result.stdout


def test_schedcc_run_refuses_recompute_layers_for_a_model_without_layers():
    """The built-in GPT's segments are not `nn.Sequential`s: one line, exit 2."""
    result = run_cli("--model", "tiny-gpt", "--recompute-layers", "2", "--steps", "1")
    assert result.returncode == 2
    assert "no layers to group" in result.stderr
    assert "Traceback" not in result.stderr
