"""`schedcc run --check` compares the objective the run trains: padded per-microbatch means, a
`schedcc.TokenLoss` whose count is known up front (exact on a model that rounds in float32
inside), and a model with dropout (turned off for the comparison, and said so)."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from _cli import run_cli
from _objective_models import TOKEN_LOSS, batch, padded_mean, plain_ratio, token_loss, tokens

import schedcc
from schedcc.backends.batches import local_batches
from schedcc.backends.reference import (
    UP_FRONT,
    Chain,
    assert_matches_reference,
    reference_loss,
    train_reference,
    without_dropout,
)
from schedcc.backends.run.launch import spawn
from schedcc.errors import UserCodeError

MODELS = "tests/_objective_models.py"
SHAPE = ("-p", "2", "-m", "2", "--microbatch-size", "2", "--steps", "3")


def _adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def _difference(stdout: str) -> float:
    """The largest parameter difference the `--check` line reports."""
    found = re.search(
        r"check: largest parameter difference from non-pipelined training (\S+)", stdout
    )
    assert found, stdout
    return float(found.group(1))


# -- schedcc run --check ------------------------------------------------------------------------


def test_check_passes_with_a_padded_per_microbatch_mean_loss():
    """A mean cross-entropy (ignore_index=-100) over microbatches holding different numbers of
    real tokens passes: the reference averages the microbatch means, as the run does."""
    result = run_cli("--model", f"{MODELS}:padded_mean", *SHAPE, "--check")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "objective: per-microbatch means): ok" in result.stdout
    assert _difference(result.stdout) < 1e-12


def test_check_passes_with_a_token_loss_on_a_float32_norm_over_two_replicas():
    """A `TokenLoss` on blocks whose RMSNorm computes in float32 passes at 1e-9 with `--dp 2`:
    each microbatch's sum is divided by the whole batch's count before its backward."""
    result = run_cli("--model", f"{MODELS}:token_loss", *SHAPE, "--dp", "2", "--check")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"objective: {UP_FRONT}): ok" in result.stdout
    assert _difference(result.stdout) < 1e-12


def test_check_sets_dropout_to_zero_and_says_so():
    """A model with dropout 0.1 is compared with its dropout off, run and reference alike, and
    the output names every dropout it turned off."""
    result = run_cli("--model", f"{MODELS}:dropout", *SHAPE, "--check")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "dropout set to 0 for the run and the reference in 2 place(s)" in result.stdout
    assert "segment 0 1.drop (p=0.1), segment 1 0.drop (p=0.1)" in result.stdout
    assert _difference(result.stdout) < 1e-12


# -- the engines against the reference ----------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "dp", "options"),
    [
        ("1f1b", 1, {}),
        ("1f1b", 2, {"zero": 1}),
        ("1f1b", 1, {"recompute": True}),
        ("zb-h1", 2, {}),
        ("interleaved-1f1b", 1, {"grad_norm": True}),
    ],
)
def test_a_token_loss_on_float32_internals_equals_the_reference(float64, name, dp, options):
    """The local engine trains a `TokenLoss` exactly as non-pipelined training of the token
    ratio, on blocks that round in float32 inside (recompute, ZeRO, split backwards, clipping)."""
    schedule = schedcc.get_schedule(name)(2, 4)
    program = schedcc.compile(schedule, data_parallel=dp, **options)
    model = token_loss(schedule.num_segments, seed=1)
    data = [batch(8 * dp, step) for step in range(3)]
    clip = 0.5 if options.get("grad_norm") else None
    diff = assert_matches_reference(
        program, model.segments, model.loss_fn, _adam, data, atol=1e-12, rtol=0, max_grad_norm=clip
    )
    assert diff < 1e-12


def test_a_token_loss_trains_exactly_on_dualpipes_two_replicas(float64):
    """Under DualPipe each replica's last stage counts every microbatch's targets of the batch,
    so both divide by the same whole count."""
    schedule = schedcc.get_schedule("dualpipe")(2, 4)
    program = schedcc.compile(schedule)
    model = token_loss(schedule.num_segments // 2, seed=2)
    data = [batch(8, step) for step in range(2)]
    parts = list(model.segments)
    diff = assert_matches_reference(program, parts + parts, TOKEN_LOSS, _adam, data, atol=1e-12)
    assert diff < 1e-12


def _distributed_worker(rank: int, world_size: int) -> int:
    from _ranks import init

    from schedcc.backends.distributed.engine import Engine
    from schedcc.backends.local import Engine as LocalEngine

    init(rank, world_size)  # gloo, float64, one thread
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4), data_parallel=2)
    segments = token_loss(2, seed=3).segments
    oracle = copy.deepcopy(segments)
    batches = [batch(16, step) for step in range(2)]
    local = [local_batches(b, step, 2)[rank // 2] for step, b in enumerate(batches)]
    engine = Engine(program, segments, TOKEN_LOSS, _adam, timeout=30)
    losses = list(engine.train(local))
    expected = list(LocalEngine(program, oracle, TOKEN_LOSS, _adam).train(batches))
    assert losses == expected, (rank, losses, expected)
    k = engine.stage
    for got, want in zip(segments[k].parameters(), oracle[k].parameters()):
        assert torch.equal(got, want), (rank, k)
    return 0


def test_a_token_loss_trains_distributed_as_on_the_local_engine():
    """On 4 gloo ranks (p = 2, dp = 2) a `TokenLoss` trains bit for bit as on the local engine:
    the count all-reduced at the first forward, each sum divided before its backward."""
    assert spawn(_distributed_worker, 4, grace=60, threads=1) == 0


def test_a_ratio_divided_at_the_step_misses_on_float32_internals(float64):
    """The same model with a plain `(loss_sum, count)` loss differs by more than `--check`'s
    tolerance: dividing float32-rounded gradients of the sum at the step is what `TokenLoss`
    avoids."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4))
    model = plain_ratio(2, seed=1)
    data = [batch(8, step) for step in range(3)]
    with pytest.raises(AssertionError, match="differs from non-pipelined training"):
        assert_matches_reference(program, model.segments, model.loss_fn, _adam, data, atol=1e-9)


def test_the_reference_averages_microbatch_means(float64):
    """With `num_microbatches=m` the reference's mean loss is the mean of the microbatches'
    means, not one mean over the batch's real tokens (they differ on padded rows)."""
    model = padded_mean(2, seed=0)
    chain = Chain(model.segments)
    with torch.no_grad():
        x, y = batch(4, 0)
        whole = float(reference_loss(chain, model.loss_fn, [(x, y)]))
        halves = [float(model.loss_fn(chain(x[r : r + 2]), y[r : r + 2])) for r in (0, 2)]
        split = float(reference_loss(chain, model.loss_fn, [(x, y)], num_microbatches=2))
    assert split == pytest.approx(sum(halves) / 2, abs=1e-15)
    assert abs(split - whole) > 1e-3


def test_train_reference_names_the_objective(float64):
    """`train_reference(objectives=...)` says what it trained, batch by batch."""
    objectives: list[str] = []
    model = token_loss(2, seed=0)
    train_reference(
        model.segments, TOKEN_LOSS, _adam, [batch(4, 0)], num_microbatches=2, objectives=objectives
    )
    assert objectives == [UP_FRONT]


def test_a_count_fn_that_returns_no_count_is_named(float64):
    """A `TokenLoss` whose `count_fn` returns a vector fails as one `UserCodeError` naming it."""
    from schedcc.backends.local import Engine

    loss = schedcc.TokenLoss(TOKEN_LOSS.sum_fn, lambda y: y != -100)
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 2))
    engine = Engine(program, token_loss(2, seed=0).segments, loss, _adam)
    with pytest.raises(UserCodeError, match=r"count_fn .* returned .* not a count"):
        list(engine.train([batch(4, 0)]))


def test_a_token_loss_evaluates_as_its_ratio(float64):
    """`evaluate` with a `TokenLoss` returns the batch's sum over its count (no up-front
    division in a forward-only run)."""
    from schedcc.backends.local import Engine

    model = token_loss(2, seed=0)
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 2))
    engine = Engine(program, model.segments, TOKEN_LOSS, _adam)
    x, y = batch(4, 5)
    chain = Chain(model.segments)
    with torch.no_grad():
        expected = float(TOKEN_LOSS.sum_fn(chain(x), y) / tokens(y))
    assert engine.evaluate(x, y) == pytest.approx(expected, rel=1e-12)


def test_token_loss_refuses_what_is_not_callable():
    """`TokenLoss` takes two callables; anything else is a `TypeError` naming the field."""
    with pytest.raises(TypeError, match=r"TokenLoss\.count_fn must be a callable, got int"):
        schedcc.TokenLoss(TOKEN_LOSS.sum_fn, 3)


def test_without_dropout_turns_off_modules_and_float_attributes():
    """`without_dropout` zeroes `nn.Dropout`'s `p` and float `*dropout*` attributes (as
    `MultiheadAttention.dropout`), and names each; a model without dropout is left as it is."""
    attention = torch.nn.MultiheadAttention(4, 2, dropout=0.2)
    block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1))
    assert without_dropout([block, attention]) == [
        "segment 0 1 (p=0.1)",
        "segment 1 MultiheadAttention.dropout (0.2)",
    ]
    assert block[1].p == 0.0
    assert attention.dropout == 0.0
    assert without_dropout([block, attention]) == []
