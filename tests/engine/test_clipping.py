"""Global gradient-norm clipping: the compiler's `GradNorm`, and both engines' `max_grad_norm`
equal to `torch.nn.utils.clip_grad_norm_` on the non-pipelined model."""

from __future__ import annotations

import copy

import pytest
import torch
from _models import batches, make_segments, mse
from _orders import random_orders
from _tied_models import adam, tied_segments
from _tied_models import batches as tied_batches
from hypothesis import given, settings

import schedcc
from schedcc.backends.local import Engine
from schedcc.backends.reference import train_reference
from schedcc.errors import ScheduleConfigError, UpdateOrderError
from schedcc.ir import GradNorm, OptimizerStep, parse

#: small enough that every step of these models is clipped
MAX_NORM = 0.05


def _sgd(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def _check_local(program, segments, loss_fn, optimizer, data, replicas=None):
    """Train locally with clipping and without a pipeline with clip_grad_norm_; compare."""
    piped, plain = copy.deepcopy(segments), copy.deepcopy(segments)
    engine = Engine(program, piped, loss_fn, optimizer, max_grad_norm=MAX_NORM)
    norms: list[float] = []
    got = []
    for batch in replicas or data:
        got.extend(engine.train([batch]))
        norms.append(engine.last_grad_norm)
    want_norms: list[float] = []
    want = train_reference(
        plain, loss_fn, optimizer, data, max_grad_norm=MAX_NORM, grad_norms=want_norms
    )
    assert got == pytest.approx(want, abs=1e-10, rel=1e-10)
    assert norms == pytest.approx(want_norms, abs=1e-10, rel=1e-10)
    assert min(want_norms) > MAX_NORM  # clipping acted on every step
    with engine.unsharded():  # ZeRO-3: the weights are whole only inside
        for mine, theirs in zip(piped, plain):
            for p, q in zip(mine.parameters(), theirs.parameters()):
                assert torch.allclose(p, q, atol=1e-10, rtol=1e-10)
    return engine


def test_compile_places_one_norm_before_every_step():
    """`grad_norm=True` puts a GradNorm right before each stage's step, after its reductions;
    the printed program round-trips."""
    schedule = schedcc.get_schedule("interleaved-1f1b")(2, 4, 2)
    program = schedcc.compile(schedule, data_parallel=2, zero=1, grad_norm=True)
    for ops in program.stages:
        at = [pos for pos, op in enumerate(ops) if type(op) is GradNorm]
        assert len(at) == 1
        assert type(ops[at[0] + 1]) is OptimizerStep
        assert str(ops[at[0] - 1]).startswith("Reduce")
    assert parse("Norm") == GradNorm()
    assert "Norm" not in schedcc.compile(schedule).to_text()


def test_simulator_costs_the_norm_as_an_all_stage_rendezvous():
    """A norm of cost 1 adds exactly 1 to a flush schedule's makespan: every stage waits for
    the last one to arrive, then all pay it together."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(3, 4), grad_norm=True)
    plain = schedcc.simulate(program).makespan
    for eager in (False, True):
        costed = schedcc.simulate(program, costs=schedcc.CostModel(norm=1.0), eager=eager)
        assert costed.makespan == plain + 1.0
        ends = {e.end for e in costed.events if type(e.instruction) is GradNorm}
        assert len(ends) == 1  # the collective ends at one time on every stage


def test_validator_refuses_a_misplaced_or_missing_norm():
    """A GradNorm before the last backward, or on one stage only, is an UpdateOrderError."""
    program = schedcc.compile(schedcc.get_schedule("gpipe")(2, 2), grad_norm=True)
    stages = [list(ops) for ops in program.stages]
    norm = stages[0].pop(stages[0].index(GradNorm()))
    stages[0].insert(stages[0].index(parse("B0")), norm)
    with pytest.raises(UpdateOrderError, match="before B0"):
        schedcc.validate(program.evolve(stages=tuple(map(tuple, stages))))
    lone = [list(ops) for ops in program.stages]
    lone[1].remove(GradNorm())
    with pytest.raises(UpdateOrderError, match="no partner on stage 1"):
        schedcc.validate(program.evolve(stages=tuple(map(tuple, lone))))


def test_engine_refuses_clipping_without_the_norm():
    """max_grad_norm on a program without GradNorm names the fix; a bad value is refused."""
    schedule = schedcc.get_schedule("1f1b")(2, 2)
    with pytest.raises(ScheduleConfigError, match="grad_norm=True"):
        Engine(schedcc.compile(schedule), make_segments(2), mse, _sgd, max_grad_norm=1.0)
    program = schedcc.compile(schedule, grad_norm=True)
    with pytest.raises(ScheduleConfigError, match="positive number"):
        Engine(program, make_segments(2), mse, _sgd, max_grad_norm=-1.0)


@pytest.mark.parametrize(("name", "p", "v"), [("1f1b", 3, 1), ("interleaved-1f1b", 2, 2)])
def test_clipping_equals_clip_grad_norm_on_the_whole_model(name, p, v):
    """Local 1f1b p=3 and interleaved p=2 v=2: losses, norms and weights as clip_grad_norm_."""
    schedule = schedcc.get_schedule(name)(p, 4, v)
    program = schedcc.compile(schedule, grad_norm=True)
    _check_local(program, make_segments(p * v), mse, _sgd, batches(3, 8))


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_clipping_with_data_parallel_zero_counts_every_shard_once(zero):
    """dp=2 under ZeRO-1, 2 and 3: the norm sums the shards of both replicas, after averaging
    (under ZeRO-2 and 3 the whole gradients are gone by then: only the shards are left)."""
    schedule = schedcc.get_schedule("1f1b")(2, 4)
    program = schedcc.compile(schedule, data_parallel=2, zero=zero, grad_norm=True)
    data = batches(3, 8)
    replicas = [list(zip(x.chunk(2), y.chunk(2))) for x, y in data]
    _check_local(program, make_segments(2), mse, _sgd, data, replicas)


def test_clipping_counts_a_tied_parameter_once():
    """A tied embedding and head (segments 0 and 3 on stages 0 and 1 of interleaved-1f1b,
    ZeRO-1 over two replicas): the norm counts the shared weight once, as the model has it."""
    schedule = schedcc.get_schedule("interleaved-1f1b")(2, 4, 2)
    for dp, zero in ((1, 0), (2, 1), (2, 2)):
        program = schedcc.compile(
            schedule, tied=[(0, 3)], grad_norm=True, data_parallel=dp, zero=zero
        )
        data = tied_batches(3, 8)
        replicas = [list(zip(x.chunk(dp), y.chunk(dp))) for x, y in data] if dp > 1 else None
        _check_local(program, tied_segments(4), mse, adam, data, replicas)


def test_a_token_loss_is_divided_by_the_batch_count_before_the_norm():
    """A `(loss_sum, count)` GPT loss with very uneven valid tokens per microbatch, dp = 2:
    the clipped gradient is that of sum / count over the whole batch, as non-pipelined."""
    from schedcc.backends.run.gpt import GPT, GPTConfig, PaddedBigramData, gpt_segments, token_loss

    config = GPTConfig(vocab=16, max_len=12, d_model=16, num_heads=2, num_blocks=2)
    model = GPT(config, seed=0).double()
    model.head.weight = torch.nn.Parameter(model.tok.weight.detach().clone())  # untied
    data = PaddedBigramData(config.vocab, config.max_len, seed=3)
    local = []
    for step in range(4):
        inputs, targets = data.batch(4, step)
        targets = targets.clone()
        targets[: 1 + step % 2, 1:] = -100  # one microbatch keeps a token per row, others all
        local.append((inputs, targets))
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 2), data_parallel=2, grad_norm=True)
    pairs = [[local[0], local[1]], [local[2], local[3]]]
    _check_local(program, gpt_segments(model, 2), token_loss, adam, pairs)


@settings(max_examples=10)
@given(random_orders(max_stages=3, max_microbatches=3, max_chunks=2))
def test_random_orders_with_a_norm_validate_and_clip_exactly(schedule):
    """Every dependency-respecting compute order, with its ends tied, compiles with grad_norm
    (or is refused with a ScheduleConfigError that names grad_norm), and the program clips
    exactly as clip_grad_norm_ on the non-pipelined model, batch by batch."""
    n = schedule.num_segments
    if n < 2:
        return
    try:
        program = schedcc.compile(schedule, tied=[(0, n - 1)], grad_norm=True)
    except ScheduleConfigError as error:
        refused = str(error)
        assert "grad_norm" in refused
        return
    m, runs = schedule.num_microbatches, schedule.num_batches
    piped, plain = tied_segments(n), tied_segments(n)
    data = tied_batches(runs, 2 * m)
    got = list(Engine(program, piped, mse, adam, max_grad_norm=MAX_NORM).train(data))
    want = train_reference(plain, mse, adam, data, max_grad_norm=MAX_NORM)
    assert got == pytest.approx(want, abs=1e-10, rel=1e-10)
    for mine, theirs in zip(piped, plain):
        for p, q in zip(mine.parameters(), theirs.parameters()):
            assert torch.allclose(p, q, atol=1e-10, rtol=1e-10)
