"""Boundary values: the calling convention, flatten, the wire encoding, microbatch split/concat."""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import assert_same, constants, nestings, tensors

from schedcc.backends.runtime import values
from schedcc.backends.runtime.values import (
    TensorMeta,
    call,
    concat,
    decode_meta,
    decode_spec,
    empty_tensors,
    encode_meta,
    encode_spec,
    flatten,
    grad_tensors,
    split,
    tensor_meta,
    unflatten,
)
from schedcc.errors import ScheduleConfigError


@given(nestings(st.one_of(tensors(), constants)))
def test_flatten_unflatten_round_trips(value):
    """Any nesting of tensors and constants comes back from its tensors and spec unchanged."""
    flat, spec = flatten(value)
    assert all(isinstance(t, torch.Tensor) for t in flat)
    assert_same(unflatten(flat, spec), value)
    hash(spec)
    assert pickle.loads(pickle.dumps(spec)) == spec


@given(nestings(st.one_of(tensors(), constants)))
def test_spec_and_meta_round_trip_through_int64(value):
    """The spec and the meta survive their int64 wire encoding, equal to the originals."""
    flat, spec = flatten(value)
    words = encode_spec(spec)
    assert words.dtype == torch.int64
    assert words.dim() == 1
    assert decode_spec(words) == spec
    meta = tensor_meta(flat)
    assert decode_meta(encode_meta(meta)) == meta
    received = unflatten(
        [b.copy_(t) for b, t in zip(empty_tensors(meta), flat)], decode_spec(words)
    )
    assert_same(received, value)


@given(st.integers(1, 4), st.integers(1, 4), st.data())
def test_split_then_concat_is_the_identity(num_microbatches, size, data):
    """A batch splits into equal microbatches along dim 0 and concat joins them back exactly."""
    batch_size = num_microbatches * size
    value = data.draw(nestings(st.one_of(tensors(batch_size), constants)))
    pieces = split(value, num_microbatches)
    assert len(pieces) == num_microbatches
    for index, piece in enumerate(pieces):
        mine, spec = flatten(piece)
        whole, whole_spec = flatten(value)
        assert spec == whole_spec
        for part, full in zip(mine, whole):
            assert torch.equal(part, full[index * size : (index + 1) * size])
    if flatten(value)[0]:
        assert_same(concat(pieces), value)


def test_call_follows_the_calling_convention():
    """A tuple is positional arguments, a dict keyword arguments, anything else one argument."""

    def seg(*args, **kwargs):
        return args, kwargs

    assert call(seg, (1, 2)) == ((1, 2), {})
    assert call(seg, {"a": 1}) == ((), {"a": 1})
    assert call(seg, [1, 2]) == (([1, 2],), {})
    assert call(seg, None) == ((None,), {})
    with pytest.raises(ScheduleConfigError, match="keys must be strings"):
        call(seg, {1: 2})


def test_a_tensor_off_the_batch_size_is_named_by_its_path():
    """A tensor whose dim 0 is not the batch size is refused with its path in the nesting."""
    value = (torch.ones(4, 2), {"mask": torch.ones(3, dtype=torch.bool)})
    with pytest.raises(ScheduleConfigError, match=r"inputs\[1\]\['mask'\] has 3 rows"):
        split(value, 2)
    with pytest.raises(ScheduleConfigError, match=r"targets\[1\] is a 0-dim tensor"):
        split([torch.ones(4), torch.tensor(1.0)], 2, name="targets")


def test_an_uneven_batch_is_refused_with_its_sizes():
    """A batch that the microbatch count does not divide says both numbers."""
    with pytest.raises(ScheduleConfigError, match=r"batch of 10.*into 4 equal microbatches"):
        split(torch.ones(10), 4)
    with pytest.raises(ScheduleConfigError, match=">= 1"):
        split(torch.ones(4), 0)


def test_constants_only_values_repeat_in_every_microbatch():
    """A value without tensors (e.g. no targets) is the same in every microbatch."""
    assert split({"t": None}, 3) == [{"t": None}] * 3


def test_unsupported_leaves_are_named():
    """Objects that cannot cross a stage are refused with their path, never pickled silently."""
    with pytest.raises(ScheduleConfigError, match=r"value\[0\]\['k'\] is a object"):
        flatten(({"k": object()},))
    with pytest.raises(ScheduleConfigError, match="does not fit in int64"):
        flatten([2**70])
    with pytest.raises(ScheduleConfigError, match="dict keys"):
        flatten({(1, 2): torch.ones(1)})


def test_constants_keep_their_type_in_the_spec():
    """True, 1 and 1.0 have different specs, so 'same as the last header' is never fooled."""
    specs = {flatten(c)[1] for c in (True, 1, 1.0, "1", None, 0.0, -0.0)}
    assert len(specs) == 7
    assert flatten(float("nan"))[1] == flatten(float("nan"))[1]


def test_grad_tensors_are_floating_and_requiring_grad():
    """Only floating tensors that require grad travel a gradient back; the meta agrees."""
    x = torch.ones(2, dtype=torch.float64, requires_grad=True)
    flat = [x * 2, torch.ones(2), torch.ones(2, dtype=torch.long), x]
    picked = grad_tensors(flat)
    assert [id(t) for t in picked] == [id(flat[0]), id(flat[3])]
    assert [m.requires_grad for m in tensor_meta(flat)] == [True, False, False, True]


def test_meta_equality_tells_same_as_last():
    """Two microbatches of one shape have equal meta; a shorter sequence does not."""
    a = tensor_meta(flatten((torch.ones(2, 5), torch.ones(2, 5, dtype=torch.bool)))[0])
    b = tensor_meta(flatten((torch.zeros(2, 5), torch.zeros(2, 5, dtype=torch.bool)))[0])
    c = tensor_meta(flatten((torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.bool)))[0])
    assert a == b
    assert a != c
    assert a[0] == TensorMeta(torch.float32, (2, 5), False)


def test_concat_refuses_what_it_cannot_join():
    """Microbatches whose constants differ, or scalar tensors, are refused with the path."""
    with pytest.raises(ScheduleConfigError, match=r"outputs\['n'\]: 1 vs 2"):
        concat([{"y": torch.ones(1), "n": 1}, {"y": torch.ones(1), "n": 2}])
    with pytest.raises(ScheduleConfigError, match=r"join outputs\[1\]"):
        concat([(torch.ones(1), torch.tensor(0.0))] * 2)


def test_all_names_are_public_and_documented():
    """Every public name has a docstring."""
    for name in values.__all__:
        if name != "Spec":
            assert getattr(values, name).__doc__, name
