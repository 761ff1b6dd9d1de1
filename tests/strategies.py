"""Hypothesis strategies shared by the project's tests; the shape ones are schedcc.testing's,
the boundary-value ones (nestings of tensors and constants) are here."""

from __future__ import annotations

import math

import attrs
import torch
from _builtin_schedules import names
from hypothesis import strategies as st

import schedcc
from schedcc import CostModel
from schedcc.testing import Shape, schedules, shapes

__all__ = [
    "BUILTIN_SCHEDULES",
    "PLAIN_BUILTINS",
    "Shape",
    "assert_same",
    "boundary_values",
    "constants",
    "keys",
    "lengths_and_microbatches",
    "microbatch_sizes",
    "nestings",
    "schedules",
    "shapes",
    "stage_costs",
    "tensors",
]

#: Every built-in schedule's name (one per class; aliases left out): tests/_builtin_schedules.py.
BUILTIN_SCHEDULES = names()
#: Every registered name whose schedule trains plain segments: all but those that split
#: microbatches into sequence parts, whose segments take a carry (tests/engine/test_seq_parts.py
#: trains those).
PLAIN_BUILTINS = tuple(
    name
    for name in schedcc.available_schedules()
    if schedcc.get_schedule(name).default_num_parts == 1
)


_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.int64, torch.int32, torch.bool)

constants = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.lists(st.integers(0, 9), max_size=3).map(torch.Size),
)
keys = st.one_of(st.text(max_size=6), st.integers(-3, 3), st.booleans(), st.none())


@st.composite
def tensors(draw, batch_size: int | None = None):
    """A small tensor of a random dtype; dim 0 is `batch_size` when given."""
    dtype = draw(st.sampled_from(_DTYPES))
    rest = draw(st.lists(st.integers(0, 3), max_size=2))
    shape = rest if batch_size is None else [batch_size, *rest]
    seed = draw(st.integers(0, 2**16))
    data = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (data * 10).to(dtype)


def nestings(leaves):
    """Random nestings of tuples, lists and dicts over `leaves`."""
    return st.recursive(
        leaves,
        lambda inner: st.one_of(
            st.lists(inner, max_size=3).map(tuple),
            st.lists(inner, max_size=3),
            st.dictionaries(keys, inner, max_size=3),
        ),
        max_leaves=8,
    )


def assert_same(a, b):
    """`a` and `b` are the same value: same types, constants bit-equal, tensors equal."""
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        assert torch.equal(a, b)
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for x, y in zip(a.values(), b.values()):
            assert_same(x, y)
    elif isinstance(a, float):
        assert a.hex() == b.hex() or (math.isnan(a) and math.isnan(b))
    else:
        assert a == b


def boundary_values():
    """Random boundary values: nestings of tuples, lists and dicts of tensors and constants."""
    return nestings(st.one_of(tensors(), constants))


@st.composite
def lengths_and_microbatches(draw, max_samples: int = 40, max_length: int = 64):
    """`(lengths, m)`: the token counts of a batch's samples (some 0: all padding) and a number
    of microbatches they can fill (`1 <= m <= len(lengths)`)."""
    lengths = draw(st.lists(st.integers(0, max_length), min_size=1, max_size=max_samples))
    return lengths, draw(st.integers(1, len(lengths)))


def microbatch_sizes(num_microbatches: int, max_size: int = 5):
    """`num_microbatches` sizes of 1 to `max_size` samples (`train_step`'s `microbatch_sizes`)."""
    return st.lists(st.integers(1, max_size), min_size=num_microbatches, max_size=num_microbatches)


_COST = st.floats(0.1, 3.0)


@st.composite
def stage_costs(draw, num_stages: int, *, updates: bool = True) -> CostModel:
    """Costs of every kind drawn per stage (B from half to 1.5x I + W), comm above 0, a
    receive's take or none ([Note: a receive's take]), a recompute cost of its own or not, a
    fixed part of each compute or none ([Note: a compute's fixed time]: kept whole at v = 2), an
    optimizer step and a gradient norm that cost something or nothing (what follows the last
    compute: `schedcc.search_bound.closing`; none without `updates`),
    and sometimes each of 2p segments' computes of their own
    (`per_segment`, [Note: segment costs]: orders at v = 2 read them where they lie, at v = 1
    summed, less the fixed parts they merge): what the search's bounds must hold under."""
    fixed = st.just(0.0) | st.floats(0.0, 0.5)
    per_stage = {}
    for s in range(num_stages):
        per_stage[s] = attrs.evolve(
            _computes(draw),
            comm=draw(st.floats(0.01, 2.0)),
            receive=draw(fixed),
            overlap=draw(st.floats(0.0, 1.0)),
            fixed_forward=draw(fixed),
            fixed_backward=draw(fixed),
            step=draw(fixed) if updates else 0.0,
            norm=draw(fixed) if updates else 0.0,
        )
    segments = [_computes(draw) for _ in range(2 * num_stages)] if draw(st.booleans()) else ()
    return CostModel(per_stage=per_stage, per_segment=segments)


@st.composite
def warmed_up(draw, costs: CostModel) -> CostModel:
    """`costs` with each stage's first forward and backward of a step, and its first take of a
    message, warmed up by a drawn amount, 0 included ([Note: a step's first computes], [Note: a
    receive's take])."""
    warm = st.sampled_from([0.0, 0.25]) | st.floats(0.0, 2.0)
    per_stage = {
        s: attrs.evolve(
            model,
            warmup_forward=draw(warm),
            warmup_backward=draw(warm),
            warmup_receive=draw(warm),
        )
        for s, model in costs.per_stage.items()
    }
    return attrs.evolve(costs, per_stage=per_stage)


def _computes(draw) -> CostModel:
    backward_input, backward_weight = draw(_COST), draw(_COST)
    return CostModel(
        forward=draw(_COST),
        backward=draw(st.floats(0.5, 1.5)) * (backward_input + backward_weight),
        backward_input=backward_input,
        backward_weight=backward_weight,
        recompute=draw(st.none() | _COST),
    )
