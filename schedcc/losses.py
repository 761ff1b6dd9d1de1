"""`TokenLoss`: a `(loss_sum, count)` loss whose count is a function of the targets alone.

A plain `(loss_sum, count)` loss learns a batch's count only from its forwards, so the engines
divide the gradients by it at the step ([Note: the count divides at the step] in
`schedcc.backends.runtime.losses`). A `TokenLoss` says how to count from the targets, which the
last segment holds for the whole batch before any backward: each microbatch's `loss_sum` is then
divided by the batch's count before its backward, as non-pipelined training of the ratio does,
and nothing is divided at the step ([Note: a count known up front] there). It matters for a model
that computes in float32 inside (an RMSNorm that upcasts): the gradients it backpropagates are
those of the ratio, rounded as the reference rounds them, not ones `count` times larger.

    >>> loss = TokenLoss(lambda out, y: sum(abs(o - t) for o, t in zip(out, y)), len)
    >>> loss([1.0, 2.0], [1.5, 1.0])
    (1.5, 2)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

__all__ = ["TokenLoss"]


@attrs.frozen
class TokenLoss:
    """A `(loss_sum, count)` loss whose count the engines compute from the targets up front.

    Called as any `loss_fn`, `TokenLoss(sum_fn, count_fn)(output, targets)` returns
    `(sum_fn(output, targets), count_fn(targets))`.

    Args:
        sum_fn: `sum_fn(output, targets) -> scalar tensor`, the loss summed over the counted
            items of the microbatch (e.g. `cross_entropy(..., reduction="sum")`).
        count_fn: `count_fn(targets) -> int or integer tensor`, how many items `sum_fn` sums
            (e.g. `(targets != -100).sum()`); a pure function of the targets.

    Raises:
        TypeError: either is not callable.

    Example:

        loss_fn = schedcc.TokenLoss(
            lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum"),
            lambda y: (y != -100).sum(),
        )
    """

    sum_fn: Callable[[Any, Any], Any]
    count_fn: Callable[[Any], Any]

    def __attrs_post_init__(self) -> None:
        for name in ("sum_fn", "count_fn"):
            if not callable(getattr(self, name)):
                got = type(getattr(self, name)).__name__
                raise TypeError(f"TokenLoss.{name} must be a callable, got {got}")

    def __call__(self, output: Any, targets: Any) -> tuple[Any, Any]:
        return self.sum_fn(output, targets), self.count_fn(targets)
