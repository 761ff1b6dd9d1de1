"""User code goes through one guard (see [Note: the user-code guard] in `schedcc/errors.py`):
whatever a schedule's methods, a segment's forward, `loss_fn` or an optimizer factory raise,
`SystemExit` and `GeneratorExit` included, is one typed error naming the function, and an
optimizer factory that returns no optimizer is refused, on the local and the distributed engine.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _models import batches, make_segments, mse, sgd
from torch import nn

import schedcc
from schedcc import Backward, Forward, Schedule
from schedcc.backends.distributed.engine import Engine as DistributedEngine
from schedcc.backends.local import Engine
from schedcc.backends.run.launch import spawn
from schedcc.errors import (
    RankFailure,
    ScheduleCodeError,
    ScheduleConfigError,
    UserCodeError,
    call_user,
)


def _raise(exc: BaseException):
    def call():
        raise exc

    return call


@pytest.mark.parametrize(
    "exc", [SystemExit(0), SystemExit(1), GeneratorExit(), KeyError("k"), StopIteration()]
)
def test_the_guard_turns_whatever_user_code_raises_into_one_typed_error(exc):
    """SystemExit(0), GeneratorExit, an ordinary exception: the error names the function and the
    exception, and holds it as `__cause__`."""
    with pytest.raises(
        UserCodeError, match=rf"^ctx: loss_fn f raised {type(exc).__name__}"
    ) as info:
        call_user("loss_fn f", _raise(exc), where="ctx")
    assert info.value.__cause__ is exc


@pytest.mark.parametrize(
    "exc", [KeyboardInterrupt(), ScheduleConfigError("says the fix"), RankFailure("lost a peer")]
)
def test_the_guard_lets_an_interrupt_and_schedccs_own_errors_through(exc):
    """An interrupt, a ScheduleError the user's code raised to say the fix, a lost peer."""
    with pytest.raises(type(exc)) as info:
        call_user("f", _raise(exc))
    assert info.value is exc


class _ExitingOrder(Schedule):
    def order(self, stage):
        raise SystemExit(0)
        yield


class _ExitingCheck(Schedule):
    def check(self):
        raise SystemExit(0)

    def order(self, stage):
        yield Forward(0)
        yield Backward(0)


class _ClosingPlacement(Schedule):
    def placement(self, segment):
        raise GeneratorExit

    def order(self, stage):
        yield Forward(0)


def test_a_schedule_that_exits_is_a_schedule_code_error():
    """order() raising SystemExit(0), check() too, placement() raising GeneratorExit: each is a
    ScheduleCodeError naming the class and the method, never an exit."""
    with pytest.raises(ScheduleCodeError, match=r"_ExitingOrder.order\(0\) raised SystemExit: 0"):
        schedcc.compile(_ExitingOrder(2, 2))
    with pytest.raises(ScheduleCodeError, match=r"_ExitingCheck.check\(\) raised SystemExit: 0"):
        _ExitingCheck(2, 2)
    with pytest.raises(ScheduleCodeError, match=r"placement\(0\) raised GeneratorExit"):
        schedcc.compile(_ClosingPlacement(2, 2))


def _program():
    return schedcc.compile(schedcc.get_schedule("1f1b")(2, 2))


def _returns_none(params):
    return None


def test_an_optimizer_factory_returning_none_is_refused_on_the_local_engine():
    """A factory that returns None (it trains nothing) is a ScheduleConfigError naming it."""
    with pytest.raises(
        ScheduleConfigError, match=r"_returns_none returned None, not a torch\.optim"
    ):
        Engine(_program(), make_segments(2), mse, _returns_none)
    with pytest.raises(ScheduleConfigError, match=r"returned a list, not a torch\.optim"):
        Engine(_program(), make_segments(2), mse, lambda params: list(params))


def test_an_optimizer_factory_that_raises_names_the_factory():
    """A factory raising SystemExit is a UserCodeError naming it, not an exit."""

    def exits(params):
        raise SystemExit(3)

    with pytest.raises(UserCodeError, match=r"optimizer factory .*exits raised SystemExit: 3"):
        Engine(_program(), make_segments(2), mse, exits)


class _Failing(nn.Module):
    def forward(self, x):
        raise SystemExit(0)


def test_a_forward_or_loss_that_exits_names_the_segment_or_the_loss():
    """A segment's forward and loss_fn raising SystemExit(0) mid-training: UserCodeError naming
    the segment and its class, or the loss function and both shapes."""
    x, y = batches(1, 4)[0]
    segments = [*make_segments(1), _Failing()]
    engine = Engine(_program(), segments, mse, sgd)
    with pytest.raises(UserCodeError, match=r"forward of segment 1 \(_Failing\) raised SystemExit"):
        engine.train_step(x, y)

    def loss(out, target):
        raise SystemExit(0)

    engine = Engine(_program(), make_segments(2), loss, sgd)
    with pytest.raises(UserCodeError, match=r"loss_fn .*loss\(output of shape \(2, 3\), target"):
        engine.train_step(x, y)


def _refusing_worker(rank: int, world_size: int) -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=30))
    with pytest.raises(
        ScheduleConfigError, match=r"_returns_none returned None, not a torch\.optim"
    ):
        DistributedEngine(_program(), make_segments(2), mse, _returns_none, timeout=30)
    dist.destroy_process_group()
    return 0


def test_an_optimizer_factory_returning_none_is_refused_on_the_distributed_engine():
    """Every rank refuses the factory that returns None (2 gloo ranks)."""
    assert spawn(_refusing_worker, 2, grace=30.0) == 0


def test_a_recompute_policy_that_exits_names_the_policy():
    """compile(..., recompute=policy) with a policy raising SystemExit: a UserCodeError naming
    the policy and the (stage, chunk) it was asked about."""

    def policy(stage, chunk):
        raise SystemExit(0)

    with pytest.raises(UserCodeError, match=r"recompute policy .*policy\(0, 0\) raised SystemExit"):
        schedcc.compile(schedcc.get_schedule("1f1b")(2, 2), recompute=policy)


def test_measure_memory_checks_the_optimizer_factory_too():
    """`measure_memory` builds the optimizer as the engines do: None is refused, naming it."""
    from schedcc.backends.runtime.memory import measure_memory

    x, y = batches(1, 2)[0]
    with pytest.raises(ScheduleConfigError, match="_returns_none returned None"):
        measure_memory(make_segments(2), x, y, mse, _returns_none)
