"""The instruction IR: printable forms, parsing, value semantics."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from schedcc import ir
from schedcc.ir import COMM, COMPUTE, UPDATE, Forward, OptimizerStep, parse

_INDEX = st.integers(0, 10_000)

_ON_MICROBATCH = st.builds(
    lambda cls, i, c: cls(i, c), st.sampled_from(COMPUTE + COMM), _INDEX, _INDEX
)
_ON_CHUNK = st.builds(
    lambda cls, c: cls(c), st.sampled_from((ir.ReduceGrads, ir.GatherParams)), _INDEX
)
instructions = st.one_of(_ON_MICROBATCH, _ON_CHUNK, st.just(OptimizerStep()))


@given(instructions)
def test_parse_inverts_str(op):
    """`parse(str(op)) == op` for every instruction class and index."""
    assert parse(str(op)) == op
    assert type(parse(str(op))) is type(op)


def test_every_class_has_a_distinct_code():
    """Every concrete instruction class prints with its own code, so parsing is unambiguous."""
    classes = COMPUTE + COMM + UPDATE
    assert len({cls.code for cls in classes}) == len(classes)
    assert {cls.group for cls in COMPUTE} == {"compute"}
    assert {cls.group for cls in COMM} == {"comm"}
    assert {cls.group for cls in UPDATE} == {"update"}


def test_short_forms():
    """Chunk 0 is left out of the printed form; other chunks follow a dot."""
    assert str(Forward(3, chunk=1)) == "F3.1"
    assert str(Forward(3)) == "F3"
    assert str(ir.SendGrad(2)) == "SG2"
    assert str(ir.ReduceGrads(1)) == "Reduce.1"
    assert str(ir.GatherParams()) == "Gather"
    assert str(OptimizerStep()) == "Step"


@pytest.mark.parametrize(
    "text",
    ["", "X3", "F", "F-1", "F3.", "F3.1.2", "Reduce3", "Step.1", "f3", "F 3", "SA", "3F", "Fx"],
)
def test_parse_rejects_garbage(text):
    """Anything that is not an instruction's printed form raises ValueError naming it."""
    with pytest.raises(ValueError, match="cannot parse instruction"):
        parse(text)


@given(st.text(max_size=8))
def test_parse_raises_only_value_error(text):
    """Arbitrary text either parses to an instruction that prints back, or raises ValueError."""
    try:
        op = parse(text)
    except ValueError:
        return
    assert parse(str(op)) == op


@given(instructions)
def test_instructions_are_hashable_and_frozen(op):
    """Instructions are values: equal ones hash alike, and no field can be assigned."""
    assert hash(op) == hash(parse(str(op)))
    assert len({op, parse(str(op))}) == 1
    fields = attrs.fields(type(op))
    if fields:
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            setattr(op, fields[0].name, 1)
    with pytest.raises((AttributeError, TypeError)):
        op.extra = 1  # slots: no new attributes


def test_equality_distinguishes_classes():
    """Two instructions with the same fields but different classes are different values."""
    same_fields = [cls(1, 2) for cls in COMPUTE + COMM]
    assert len(set(same_fields)) == len(same_fields)
    for a in same_fields:
        for b in same_fields:
            assert (a == b) is (a is b or type(a) is type(b))
    assert ir.ReduceGrads(1) != ir.GatherParams(1)
