"""The stage's optimizer and its learning-rate schedule, built from the user's factories.

`StageRuntime` builds both over what its stage trains (the views' parameters, or under ZeRO the
shards), and `backends.runtime.memory` builds a throwaway optimizer to measure its state's
bytes. A factory runs through the user-code guard and what it returns is checked, so a factory
that returns the wrong thing fails here, naming the fix, rather than at the first step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from schedcc.errors import ScheduleConfigError, call_user, name_of

__all__ = ["build_lr_scheduler", "build_optimizer"]


def build_optimizer(
    factory: Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer], params: list
) -> torch.optim.Optimizer:
    """`factory(params)`, through the user-code guard, checked to be an optimizer.

    Raises:
        UserCodeError: the factory raised.
        ScheduleConfigError: it returned something other than a `torch.optim.Optimizer`.
    """
    name = name_of(factory)
    optimizer = call_user(f"the optimizer factory {name}", lambda: factory(params))
    if not isinstance(optimizer, torch.optim.Optimizer):
        got = "None" if optimizer is None else f"a {type(optimizer).__name__}"
        raise ScheduleConfigError(
            f"the optimizer factory {name} returned {got}, not a torch.optim.Optimizer: return "
            "one built over the parameters it is given, e.g. lambda params: "
            "torch.optim.SGD(params, lr=0.1)"
        )
    return optimizer


def build_lr_scheduler(
    factory: Callable[[torch.optim.Optimizer], Any], optimizer: torch.optim.Optimizer
) -> torch.optim.lr_scheduler.LRScheduler:
    """`factory(optimizer)`, through the user-code guard, checked to be a learning-rate
    scheduler that steps without a metric.

    Raises:
        UserCodeError: the factory raised.
        ScheduleConfigError: it returned something other than a
            `torch.optim.lr_scheduler.LRScheduler`, or a `ReduceLROnPlateau` (whose step needs
            a metric the engines do not have).
    """
    name = name_of(factory)
    scheduler = call_user(f"the lr_scheduler factory {name}", lambda: factory(optimizer))
    plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    if plateau or not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        got = "None" if scheduler is None else f"a {type(scheduler).__name__}"
        why = ", whose step needs a metric" if plateau else ""
        raise ScheduleConfigError(
            f"the lr_scheduler factory {name} returned {got}{why}, not a "
            "torch.optim.lr_scheduler.LRScheduler stepped once per optimizer step: return one "
            "built over the optimizer it is given, e.g. lambda opt: "
            "torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 100))"
        )
    return scheduler
