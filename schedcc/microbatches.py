"""Microbatches of unequal size: `balance` groups variable-length samples by tokens.

A batch of padded sequences of lengths `l_0..l_{n-1}` cut into `m` microbatches of equal sample
counts gives microbatches of unequal work (DynaPipe reports up to 4.4x between them). `balance`
groups the samples instead so that each microbatch holds about the same number of tokens; the
engines train such microbatches exactly with `train_step(..., microbatch_sizes=...)`, and
`CostModel(per_microbatch=...)` lets the simulators and `tune` see what imbalance is left.

    >>> from schedcc.microbatches import balance
    >>> groups = balance([5, 1, 9, 3, 4, 2, 8, 7], 3)
    >>> groups
    [[2, 3, 5], [6, 4, 1], [7, 0]]
    >>> [sum([5, 1, 9, 3, 4, 2, 8, 7][i] for i in g) for g in groups]
    [14, 13, 12]

Pure Python: no torch.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from schedcc.errors import ScheduleConfigError

__all__ = ["balance", "order_and_sizes"]


def balance(lengths: Sequence[int], num_microbatches: int) -> list[list[int]]:
    """The sample indices of `num_microbatches` microbatches whose token counts (the sums of
    their samples' `lengths`) differ by at most the longest sequence.

    Greedy by length, longest first (Graham's LPT rule): each sample joins the microbatch with
    the fewest tokens so far (ties: the one with fewer samples, then the lower index). Every
    microbatch gets a sample, and the spread stays within one sample's length: adding a
    sample of length `l <= max(lengths)` to the lightest microbatch either leaves the heaviest
    as it was or makes the new heaviest at most `l` above the old lightest. Deterministic; the
    microbatches are listed in the order of their first (longest) sample.

    Args:
        lengths: each sample's token count (its sequence length without padding), `>= 0`.
        num_microbatches: `m`, at most `len(lengths)`.

    Returns:
        `m` lists of indices into `lengths`; each index appears once in all.

    Raises:
        ScheduleConfigError: a length that is not a non-negative int, `m` not a positive int,
            or fewer samples than `m`.
    """
    m = num_microbatches
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ScheduleConfigError(f"balance: num_microbatches must be an int >= 1, got {m!r}")
    lengths = list(lengths)
    for i, length in enumerate(lengths):
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            raise ScheduleConfigError(
                f"balance: lengths[{i}] is {length!r}; each length is a sample's token count, "
                "an int >= 0"
            )
    if len(lengths) < m:
        raise ScheduleConfigError(
            f"balance: {len(lengths)} samples cannot fill m={m} microbatches; give at least "
            f"{m} samples or fewer microbatches"
        )
    groups: list[list[int]] = [[] for _ in range(m)]
    lightest = [(0, 0, g) for g in range(m)]  # (tokens, samples, group): a heap
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        tokens, count, g = heapq.heappop(lightest)
        groups[g].append(i)
        heapq.heappush(lightest, (tokens + lengths[i], count + 1, g))
    return groups


def order_and_sizes(groups: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """`(order, sizes)` of `balance`'s groups: the sample indices microbatch by microbatch (to
    reorder the batch with, `x[order]`) and each microbatch's size (`microbatch_sizes`).

    >>> order_and_sizes([[2, 0], [1]])
    ([2, 0, 1], [2, 1])
    """
    return [i for group in groups for i in group], [len(group) for group in groups]
