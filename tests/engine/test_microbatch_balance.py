"""`schedcc.microbatches.balance`: token-balanced microbatches for variable-length batches, and
random unequal sizes training exactly on the local engine."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import lengths_and_microbatches, microbatch_sizes

from schedcc import ScheduleConfigError
from schedcc.microbatches import balance, order_and_sizes


@given(lengths_and_microbatches())
def test_balance_spreads_tokens_within_the_longest_sequence(case):
    """Every sample lands in exactly one of m non-empty microbatches, and their token counts
    differ by at most the longest sequence."""
    lengths, m = case
    groups = balance(lengths, m)
    assert len(groups) == m
    assert all(groups)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    tokens = [sum(lengths[i] for i in g) for g in groups]
    assert max(tokens) - min(tokens) <= max(lengths)


@given(lengths_and_microbatches())
def test_balance_is_no_worse_than_equal_counts_in_order(case):
    """balance's heaviest microbatch holds no more tokens than the heaviest of the same
    microbatch sizes cut in the batch's order would, when those are equal counts."""
    lengths, m = case
    if len(lengths) % m:
        return
    size = len(lengths) // m
    in_order = max(sum(lengths[j * size : (j + 1) * size]) for j in range(m))
    groups = balance(lengths, m)
    heaviest = max(sum(lengths[i] for i in g) for g in groups)
    assert heaviest <= in_order + max(lengths)


def test_order_and_sizes_reorder_a_batch():
    """order_and_sizes gives the reordering and train_step's microbatch_sizes."""
    groups = balance([5, 1, 9, 3], 2)
    order, sizes = order_and_sizes(groups)
    assert sorted(order) == [0, 1, 2, 3]
    assert sizes == [len(g) for g in groups]
    assert [order[: sizes[0]], order[sizes[0] :]] == groups


@pytest.mark.parametrize(
    ("lengths", "m", "words"),
    [
        ([3, 1], 3, "2 samples cannot fill m=3"),
        ([3, -1], 1, r"lengths\[1\] is -1"),
        ([3, 1.5], 1, r"lengths\[1\] is 1.5"),
        ([3, 1], 0, "num_microbatches must be an int >= 1"),
    ],
)
def test_bad_lengths_are_refused(lengths, m, words):
    """Fewer samples than m, negative or non-int lengths and m < 1: a ScheduleConfigError."""
    with pytest.raises(ScheduleConfigError, match=words):
        balance(lengths, m)


#: Flush schedules (train_step) of one and two chunks, split backwards and V shapes among them.
_FLUSH = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-v", 2)]


@given(microbatch_sizes(4), st.sampled_from(_FLUSH))
def test_random_unequal_sizes_train_exactly(sizes, schedule):
    """Flush schedules (p = 2, m = 4) on random sizes equal non-pipelined training of the
    whole batch to 1e-10 in float64 (a mean loss), on the real local engine."""
    import torch
    import torch.nn.functional as F
    from _models import make_segments, sgd

    import schedcc
    from schedcc.backends.local import Engine
    from schedcc.backends.reference import Chain

    name, v = schedule
    program = schedcc.compile(schedcc.get_schedule(name)(2, 4, v))
    segments = make_segments(2 * v)
    plain = Chain(copy.deepcopy(segments))
    engine = Engine(program, segments, F.mse_loss, sgd)
    gen = torch.Generator().manual_seed(sum(sizes))
    x = torch.randn(sum(sizes), 3, generator=gen, dtype=torch.float64)
    y = torch.sin(x)
    got = engine.train_step(x, y, microbatch_sizes=sizes)
    opt = sgd(plain.parameters())
    want = F.mse_loss(plain(x), y)
    want.backward()
    opt.step()
    assert abs(got - want.item()) < 1e-10
    for a, b in zip(segments, plain.segments):
        for p, q in zip(a.parameters(), b.parameters()):
            assert (p - q).abs().max().item() < 1e-10
