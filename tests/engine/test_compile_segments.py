"""Compiled segments: `Engine(..., compile=True | backend)` runs each segment through
`torch.compile`.

`aot_eager` (traced by dynamo and AOTAutograd, run by eager kernels) equals eager training in
float64 at 1e-12, with whole-segment and layer recompute, stashed weights and tied copies, on
the local engine and on gloo ranks; one small inductor case (code-generated C++, which may
reorder sums) equals it at 1e-10. A program with split backwards and an unknown backend are
refused.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from _cli import run_cli
from _models import largest_difference, tanh_batches
from test_layer_recompute import gloo_worker
from torch import nn
from torch._dynamo.utils import counters

import schedcc
from schedcc.backends.local import Engine
from schedcc.backends.reference import train_reference
from schedcc.backends.run.launch import spawn
from schedcc.errors import ScheduleConfigError

WIDTH = 4


def _layered(num_segments: int, num_layers: int = 2, *, seed: int = 0) -> list[nn.Module]:
    """`num_segments` float64 `nn.Sequential`s of `num_layers` (Linear, Tanh) layers."""
    torch.manual_seed(seed)
    return [
        nn.Sequential(
            *(
                nn.Sequential(nn.Linear(WIDTH, WIDTH, dtype=torch.float64), nn.Tanh())
                for _ in range(num_layers)
            )
        )
        for _ in range(num_segments)
    ]


def _adam(params):
    return torch.optim.Adam(params, lr=0.02)


def _run(name: str, v: int, backend, *, recompute=False, every=None, tie=False):
    """Losses and segments after 3 steps of `name` (p=2, m=4), each segment through
    `backend` (False: eager)."""
    segments = _layered(2 * v)
    if tie:
        segments[-1][-1][0].weight = segments[0][0][0].weight
    schedule = schedcc.get_schedule(name)(2, 4, v, 3)
    program = schedcc.compile(
        schedule, recompute=recompute, tied=schedcc.tied_groups(segments) if tie else ()
    )
    engine = Engine(program, segments, F.mse_loss, _adam, compile=backend, recompute_layers=every)
    return list(engine.train(tanh_batches(3))), segments


@pytest.mark.parametrize(
    ("name", "v", "options"),
    [
        ("1f1b", 1, {}),
        ("interleaved-1f1b", 2, {}),
        ("1f1b", 1, {"recompute": True}),
        ("1f1b", 1, {"every": 1}),
        ("interleaved-1f1b", 2, {"recompute": True, "every": 1}),
        ("2bw", 1, {"tie": True}),
        ("1f1b", 1, {"tie": True, "every": 1}),
    ],
)
def test_aot_eager_segments_train_as_eager_ones(name, v, options):
    """Compiled with `aot_eager`, a run equals the same run in eager mode at 1e-12: plain,
    interleaved, with whole-segment or layer recompute, on stashed weights (2BW) and on a tied
    parameter's copies (called through `functional_call`)."""
    losses, segments = _run(name, v, "aot_eager", **options)
    expected, plain = _run(name, v, False, **options)
    assert largest_difference(losses, expected, segments, plain) < 1e-12


def test_compiled_training_equals_non_pipelined_training():
    """A compiled 1F1B run equals non-pipelined eager training at 1e-12."""
    losses, segments = _run("1f1b", 1, "aot_eager")
    reference = _layered(2)
    expected = train_reference(reference, F.mse_loss, _adam, tanh_batches(3))
    assert largest_difference(losses, expected, segments, reference) < 1e-12


@pytest.mark.distributed  # inductor compiles its C++ in worker processes
def test_inductor_segments_train_within_float_rounding_of_eager():
    """`compile=True` (inductor, C++ on the CPU) equals eager at 1e-10 in float64: it may fuse
    and reorder sums, so not bit for bit."""
    losses, segments = _run("1f1b", 1, True)
    expected, plain = _run("1f1b", 1, False)
    assert largest_difference(losses, expected, segments, plain) < 1e-10


@pytest.mark.parametrize("every", [None, 1])
def test_evaluation_through_compiled_segments_equals_eager_evaluation(every):
    """`evaluate` and `predict` run the compiled segments without autograd (and without layer
    recompute) and give eager's loss and outputs to 1e-12."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4))
    x, y = tanh_batches(1)[0]
    results = []
    for backend in ("aot_eager", False):
        engine = Engine(
            program, _layered(2), F.mse_loss, _adam, compile=backend, recompute_layers=every
        )
        results.append((engine.evaluate(x, y), engine.predict(x)))
    (loss, out), (eager_loss, eager_out) = results
    assert abs(loss - eager_loss) < 1e-12
    assert (out - eager_out).abs().max().item() < 1e-12


def test_the_callers_modules_are_not_compiled_in_place():
    """The engine compiles wrappers: the caller's segments still run eagerly."""
    _, segments = _run("1f1b", 1, "aot_eager")
    assert all(m._compiled_call_impl is None for segment in segments for m in segment.modules())


def test_split_backwards_are_refused():
    """A program with `BackwardInput`/`BackwardWeight` (zb-h1) is refused, naming the
    instruction and what to do."""
    program = schedcc.compile(schedcc.get_schedule("zb-h1")(2, 4))
    with pytest.raises(ScheduleConfigError, match=r"splits its backwards \(I0\).*1f1b"):
        Engine(program, _layered(2), F.mse_loss, _adam, compile="aot_eager")


@pytest.mark.parametrize("backend", ["no-such-backend", 3, "Inductor"])
def test_an_unknown_backend_is_refused(backend):
    """`compile` is a bool or a registered backend's name; anything else is refused, listing
    the usual ones."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4))
    with pytest.raises(ScheduleConfigError, match=r"compile must be .*inductor"):
        Engine(program, _layered(2), F.mse_loss, _adam, compile=backend)


# -- on gloo ranks --------------------------------------------------------------------------------


def test_on_gloo_ranks_compiled_segments_train_exactly():
    """On 2 gloo ranks, `aot_eager` segments recomputing every layer equal non-pipelined
    training at 1e-12."""
    options = {"compile": "aot_eager", "recompute_layers": 1}
    assert spawn(gloo_worker, 2, ("1f1b", options), grace=60, threads=1) == 0


def test_schedcc_run_compile_passes_its_check():
    """`schedcc run --model mlp --compile aot_eager --check` trains exactly."""
    result = run_cli(
        "--model", "mlp", "--compile", "aot_eager", "--steps", "2", "--check", timeout=400
    )
    assert result.returncode == 0, result.stderr
    assert re.search(r"check: .*: ok", result.stdout), result.stdout


def test_schedcc_run_refuses_compile_with_split_backwards():
    """`--compile` with zb-h1: one line, exit 2, no traceback."""
    result = run_cli("--schedule", "zb-h1", "--model", "mlp", "--compile", "--steps", "1")
    assert result.returncode == 2
    assert "splits its backwards" in result.stderr
    assert "Traceback" not in result.stderr


def test_layers_of_one_structure_share_compiled_graphs():
    """Each layer is compiled, so 12 layers of one structure (in groups of one) reuse dynamo's
    graphs: at most 2 are made (the first layer's input takes no gradient, the others' do),
    not one per group, which past dynamo's recompile limit would run eagerly."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4))
    segments = _layered(2, num_layers=6)
    engine = Engine(program, segments, F.mse_loss, _adam, compile="aot_eager", recompute_layers=1)
    counters.clear()
    list(engine.train(tanh_batches(1)))
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
