"""The local backend: pipelined training equals non-pipelined training exactly (float64)."""

from __future__ import annotations

import copy

import pytest
import torch
from _models import batches, make_segments, mse, sgd
from _orders import random_orders
from _written import CLASS_A, written
from hypothesis import given
from hypothesis import strategies as st

import schedcc
from schedcc.backends.local import Engine
from schedcc.backends.reference import assert_matches_reference, train_reference
from schedcc.errors import ScheduleConfigError, ScheduleError
from schedcc.ir import Comm


def _schedule(name: str, p: int, m: int, v: int = 1, num_batches: int = 2):
    cls = schedcc.get_schedule(name)
    try:
        return cls(p, m, num_chunks=v, num_batches=num_batches)
    except ScheduleConfigError as error:
        pytest.skip(f"{name} does not take p={p} m={m} v={v}: {error}")


def _adam(params):
    return torch.optim.Adam(params, lr=0.05)


# (p, m, v): m < p, m = p, m >> p; v = 1, 2, 3.
SHAPES = [(3, 2, 1), (2, 2, 1), (2, 8, 1), (2, 4, 2), (3, 3, 2), (2, 4, 3), (1, 3, 1)]


def _accepted(names, shapes):
    """The (name, p, m, v) combinations a registered schedule accepts."""
    cases = []
    for name in names:
        if name not in schedcc.available_schedules():
            continue
        for p, m, v in shapes:
            try:
                schedcc.get_schedule(name)(p, m, num_chunks=v)
            except ScheduleConfigError:
                continue
            cases.append((name, p, m, v))
    return cases


@pytest.mark.parametrize(
    ("name", "p", "m", "v"),
    _accepted(["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v"], SHAPES),
)
def test_flush_schedules_equal_non_pipelined_training(name, p, m, v):
    """Every flush schedule's weights and losses after 2 SGD steps equal non-pipelined training."""
    schedule = _schedule(name, p, m, v)
    program = schedcc.compile(schedule)
    segments = make_segments(schedule.num_segments, seed=p * 100 + m * 10 + v)
    assert_matches_reference(program, segments, mse, sgd, batches(2, 2 * m))


@pytest.mark.parametrize(("p", "m"), [(2, 2), (3, 2), (2, 5), (4, 8)])
def test_2bw_follows_the_delayed_update_rule(p, m):
    """2BW equals W[b+1] = W[b] - lr * grad(loss_b at W[b-1]) over three steps."""
    schedule = _schedule("2bw", p, m, num_batches=3)
    program = schedcc.compile(schedule)
    assert_matches_reference(program, make_segments(p, seed=m), mse, sgd, batches(3, m))


def test_2bw_differs_from_flush_training():
    """2BW's weights after three steps are not those of flush (GPipe) training."""
    schedule = _schedule("2bw", 2, 4, num_batches=3)
    delayed = make_segments(2)
    flushed = copy.deepcopy(delayed)
    list(Engine(schedcc.compile(schedule), delayed, mse, sgd).train(batches(3, 4)))
    train_reference(flushed, mse, sgd, batches(3, 4))
    params = zip(
        torch.nn.Sequential(*delayed).parameters(), torch.nn.Sequential(*flushed).parameters()
    )
    assert max((a - b).abs().max().item() for a, b in params) > 1e-4


@given(random_orders(max_stages=3, max_microbatches=4, max_chunks=2))
def test_random_valid_orders_equal_non_pipelined_training(schedule):
    """Any dependency-respecting compute order (split backward, V-shape) trains exactly."""
    program = schedcc.compile(schedule)
    segments = make_segments(schedule.num_segments)
    data = batches(schedule.num_batches, schedule.num_microbatches)
    assert_matches_reference(program, segments, mse, sgd, data)


@given(random_orders(weight_delay=1, max_stages=3, max_microbatches=3, max_chunks=2))
def test_random_weight_delayed_orders_follow_the_delayed_rule(schedule):
    """Any valid order with weight_delay=1 (stashed versions) follows the 2BW update rule."""
    program = schedcc.compile(schedule)
    data = batches(schedule.num_batches, 2 * schedule.num_microbatches)
    assert_matches_reference(program, make_segments(schedule.num_segments), mse, sgd, data)


# -- the rendezvous model: a comm group is posted whole ----------------------------------------


@pytest.mark.parametrize(
    "stages",
    [
        CLASS_A,
        ("F0 SA0 RG0 B0 Step", "RA0 F0 B0 SG0 Step"),  # the same group, send first
        ("F0 F1 SA0 SA1 RG1 RG0 B1 B0 Step", "RA0 F0 RA1 F1 B1 SG1 B0 SG0 Step"),
    ],
)
def test_a_comm_group_posted_whole_trains_exactly(stages):
    """Issue 16's class A: a hand-written program whose group receives before it sends (and one
    group meeting four of its peer's) validates and trains to non-pipelined training's numbers;
    waiting on each receive before posting the group's send deadlocked."""
    schedule = written(*stages, num_microbatches=stages[0].count("F"))
    program = schedcc.compile(schedule)
    m = schedule.num_microbatches
    assert_matches_reference(program, make_segments(2), mse, sgd, batches(2, 2 * m))


def _receives_first(program):
    """`program` with the receives of every comm group moved before its sends (each channel's
    FIFO order is kept: a send and a receive never share a channel)."""
    stages = []
    for ops in program.stages:
        out: list = []
        group: list = []
        for op in [*ops, None]:
            if isinstance(op, Comm):
                group.append(op)
                continue
            out += [o for o in group if not o.is_send] + [o for o in group if o.is_send]
            group = []
            if op is not None:
                out.append(op)
        stages.append(tuple(out))
    return program.evolve(stages=tuple(stages))


@given(random_orders(max_stages=3, max_microbatches=4, max_chunks=2))
def test_the_order_inside_a_comm_group_does_not_matter(schedule):
    """A group is posted whole: with every group's receives first, any valid order still
    validates and trains exactly."""
    program = _receives_first(schedcc.compile(schedule))
    data = batches(schedule.num_batches, schedule.num_microbatches)
    assert_matches_reference(program, make_segments(schedule.num_segments), mse, sgd, data)


@pytest.mark.parametrize("zero", [0, 1, 2])
@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b"])
def test_data_parallel_equals_training_on_the_concatenated_batch(name, zero):
    """dp=2 with ZeRO 0/1/2 equals non-pipelined training on the concatenated local batches."""
    schedule = _schedule(name, 2, 4, v=2 if name == "interleaved-1f1b" else 1)
    program = schedcc.compile(schedule, data_parallel=2, zero=zero)
    local = [list(zip(batches(2, 4, seed=1), batches(2, 4, seed=2)))][0]
    assert_matches_reference(program, make_segments(schedule.num_segments), mse, sgd, local)


@pytest.mark.parametrize("zero", [0, 1])
def test_data_parallel_adam_and_2bw_equal_the_reference(zero):
    """Adam (elementwise, so ZeRO-1 sharding is exact) with 2BW and dp=3 matches the reference."""
    schedule = _schedule("2bw", 2, 2, num_batches=3)
    program = schedcc.compile(schedule, data_parallel=3, zero=zero)
    assert_matches_reference(program, make_segments(2), mse, _adam, batches(3, 6))


def test_a_global_batch_is_split_into_local_batches_in_order():
    """With dp=2 one (inputs, targets) batch trains like the two halves given per replica."""
    program = schedcc.compile(_schedule("1f1b", 2, 2, num_batches=1), data_parallel=2)
    whole, halves = make_segments(2), make_segments(2)
    (x, y) = batches(1, 8)[0]
    loss = Engine(program, whole, mse, sgd).train_step(x, y)
    (same,) = Engine(program, halves, mse, sgd).train([[(x[:4], y[:4]), (x[4:], y[4:])]])
    assert loss == pytest.approx(same, abs=1e-12)
    for a, b in zip(
        torch.nn.Sequential(*whole).parameters(), torch.nn.Sequential(*halves).parameters()
    ):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_train_reruns_the_program_for_more_batches():
    """A one-batch program trained on three batches equals three non-pipelined steps."""
    program = schedcc.compile(_schedule("gpipe", 2, 2, num_batches=1))
    assert_matches_reference(program, make_segments(2), mse, sgd, batches(3, 4))


def test_train_step_returns_the_batch_loss():
    """train_step's loss is the non-pipelined loss of the same batch."""
    program = schedcc.compile(_schedule("1f1b", 2, 4, num_batches=1))
    segments = make_segments(2)
    (x, y) = batches(1, 8)[0]
    expected = mse(torch.nn.Sequential(*copy.deepcopy(segments))(x), y).item()
    assert Engine(program, segments, mse, sgd).train_step(x, y) == pytest.approx(
        expected, abs=1e-12
    )


# -- bad input: a clear error, raised before any weight changes ----------------------------------


def _weights(segments):
    return [p.detach().clone() for s in segments for p in s.parameters()]


def _unchanged(segments, before):
    return all(torch.equal(a, b) for a, b in zip(_weights(segments), before))


@pytest.fixture
def engine_1f1b():
    segments = make_segments(2)
    program = schedcc.compile(_schedule("1f1b", 2, 4, num_batches=1))
    return Engine(program, segments, mse, sgd), segments


def test_wrong_number_of_segments_is_refused():
    """Engine names p*v when given the wrong number of segments."""
    program = schedcc.compile(_schedule("1f1b", 2, 4, num_batches=1))
    with pytest.raises(ScheduleConfigError, match=r"p\*v = 2\*1 = 2 segments, got 3"):
        Engine(program, make_segments(3), mse, sgd)


def test_a_program_that_does_not_validate_is_refused():
    """Engine re-validates: a program with a receive removed raises its ScheduleError."""
    program = schedcc.compile(_schedule("1f1b", 2, 2, num_batches=1))
    stages = list(program.stages)
    stages[1] = tuple(op for op in stages[1] if str(op) != "RA1")
    broken = program.evolve(stages=tuple(stages))
    with pytest.raises(ScheduleError):
        Engine(broken, make_segments(2), mse, sgd)


@pytest.mark.parametrize(
    ("inputs", "targets", "message"),
    [
        (torch.zeros(6, 3), torch.zeros(6, 3), "6 samples cannot be split into m=4"),
        (torch.zeros(8, 3), torch.zeros(4, 3), "targets must have the same batch size"),
        (torch.zeros(8, 3), torch.tensor(1.0), "targets must be a tensor with a batch dim"),
    ],
)
def test_bad_batches_raise_before_weights_change(engine_1f1b, inputs, targets, message):
    """Indivisible batches and mismatched targets raise a named error; weights stay as they were."""
    engine, segments = engine_1f1b
    before = _weights(segments)
    with pytest.raises(ScheduleConfigError, match=message):
        engine.train_step(inputs.double(), targets.double())
    assert _unchanged(segments, before)


def test_a_bad_batch_later_in_the_list_raises_before_the_group_runs():
    """train() checks a whole program's batches before running it."""
    program = schedcc.compile(_schedule("gpipe", 2, 2, num_batches=2))
    segments = make_segments(2)
    before = _weights(segments)
    data = [*batches(1, 4), (torch.zeros(3, 3).double(), torch.zeros(3, 3).double())]
    with pytest.raises(ScheduleConfigError, match="batch 1"):
        list(Engine(program, segments, mse, sgd).train(data))
    assert _unchanged(segments, before)


def test_a_loss_that_is_not_a_scalar_is_refused(engine_1f1b):
    """loss_fn returning a vector raises a ScheduleConfigError, weights unchanged."""
    _, segments = engine_1f1b
    program = schedcc.compile(_schedule("1f1b", 2, 4, num_batches=1))
    before = _weights(segments)

    def unreduced(out, target):
        return torch.nn.functional.mse_loss(out, target, reduction="none")

    engine = Engine(program, segments, unreduced, sgd)
    with pytest.raises(ScheduleConfigError, match="must return a scalar"):
        engine.train_step(*batches(1, 8)[0])
    assert _unchanged(segments, before)


def test_targets_of_the_wrong_shape_are_named():
    """A loss_fn that rejects the targets' shape surfaces as a ScheduleConfigError naming it."""
    program = schedcc.compile(_schedule("1f1b", 2, 2, num_batches=1))
    segments = make_segments(2)
    before = _weights(segments)

    def strict(out, target):
        return torch.nn.functional.cross_entropy(out, target)

    with pytest.raises(ScheduleConfigError, match="target of shape"):
        Engine(program, segments, strict, sgd).train_step(
            torch.zeros(4, 3).double(), torch.zeros(4, 5).double()
        )
    assert _unchanged(segments, before)


def test_data_parallel_errors_stop_every_replica():
    """A failure in data-parallel training raises once and leaves no thread hanging."""
    program = schedcc.compile(_schedule("1f1b", 2, 2, num_batches=1), data_parallel=2)
    engine = Engine(program, make_segments(2), lambda out, t: out.sum(0), sgd)
    with pytest.raises(ScheduleConfigError, match="scalar"):
        engine.train_step(*batches(1, 8)[0])


def test_train_step_refuses_weight_delayed_schedules():
    """train_step is for flush schedules; 2BW must use train()."""
    program = schedcc.compile(_schedule("2bw", 2, 2, num_batches=2))
    with pytest.raises(ScheduleConfigError, match="use train"):
        Engine(program, make_segments(2), mse, sgd).train_step(*batches(1, 4)[0])


def test_a_short_last_group_of_batches_is_refused():
    """A program over 2 batches trained on 3 says to pass a multiple of 2."""
    program = schedcc.compile(_schedule("gpipe", 2, 2, num_batches=2))
    engine = Engine(program, make_segments(2), mse, sgd)
    with pytest.raises(ScheduleConfigError, match="multiple of 2"):
        list(engine.train(batches(3, 4)))


@given(st.integers(1, 3))
def test_data_parallel_replicas_stay_identical(steps):
    """After any number of ZeRO-1 steps every replica holds the same weights."""
    program = schedcc.compile(_schedule("1f1b", 2, 2, num_batches=1), data_parallel=2, zero=1)
    engine = Engine(program, make_segments(2), mse, sgd)
    list(engine.train(batches(steps, 8)))
    for mine, theirs in zip(engine.runtimes[0], engine.runtimes[1]):
        for a, b in zip(mine.modules, theirs.modules):
            for p, q in zip(a.parameters(), b.parameters()):
                assert torch.equal(p, q)


@pytest.mark.parametrize("zero", [0, 1])
def test_a_segment_without_parameters_trains(zero):
    """A pipeline whose middle stage holds only an activation matches the reference."""
    program = schedcc.compile(_schedule("1f1b", 3, 2, num_batches=1), data_parallel=2, zero=zero)
    first, last = make_segments(2)
    segments = [first, torch.nn.Tanh(), last]
    assert_matches_reference(program, segments, mse, sgd, batches(2, 8))


def test_a_first_segment_without_parameters_trains():
    """A first stage with nothing to train (its output needs no gradient) is skipped in backward."""
    program = schedcc.compile(_schedule("1f1b", 2, 2, num_batches=1))
    segments = [torch.nn.Tanh(), make_segments(1)[0]]
    assert_matches_reference(program, segments, mse, sgd, batches(2, 4))


def test_inputs_that_require_grad_are_not_backpropagated_into():
    """A batch that needs a gradient trains as any other and gets none: the pipeline's backward
    stops at the batch, as each stage's does at its received input."""
    program = schedcc.compile(_schedule("1f1b", 2, 4, num_batches=1))
    data = batches(2, 8)
    segments, expected = make_segments(2), make_segments(2)
    list(Engine(program, segments, mse, sgd).train([(x.requires_grad_(True), y) for x, y in data]))
    assert all(x.grad is None for x, _ in data)
    train_reference(expected, mse, sgd, [(x.detach(), y) for x, y in data])
    for a, b in zip(_weights(segments), _weights(expected)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_unequal_local_batches_are_refused():
    """Data-parallel local batches of different sizes raise before training."""
    program = schedcc.compile(_schedule("1f1b", 2, 2, num_batches=1), data_parallel=2)
    engine = Engine(program, make_segments(2), mse, sgd)
    (x, y) = batches(1, 6)[0]
    with pytest.raises(ScheduleConfigError, match="same local batch size"):
        list(engine.train([[(x[:4], y[:4]), (x[4:], y[4:])]]))


@given(
    random_orders(weight_delay=1, max_stages=2, max_microbatches=3, max_chunks=2)
    | random_orders(max_stages=2, max_microbatches=3, max_chunks=2),
    st.sampled_from([0, 1, 2]),
)
def test_random_orders_with_data_parallelism_equal_the_reference(schedule, zero):
    """Any valid order (flush or delayed) with dp=2 and ZeRO 0/1/2 follows the reference."""
    program = schedcc.compile(schedule, data_parallel=2, zero=zero)
    m, num_batches = schedule.num_microbatches, schedule.num_batches
    local = list(zip(batches(num_batches, m, seed=3), batches(num_batches, m, seed=4)))
    assert_matches_reference(program, make_segments(schedule.num_segments), mse, sgd, local)
