"""The instruction table (`schedcc.ir.INSTRUCTIONS`): one row spells each instruction class, and
`str`, `parse`, the error messages, the drawings and the docs all read it."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

import schedcc
from schedcc import ir
from schedcc.draw import ascii as ascii_draw
from schedcc.ir import INSTRUCTIONS, Spelling, parse, spelling

_BASES = (ir.Instruction, ir.OnMicrobatch, ir.Compute, ir.Comm, ir.Copy, ir.Update)
#: every instruction class `schedcc.ir` defines, found by looking, not by reading the table
_CLASSES = tuple(
    cls
    for _, cls in inspect.getmembers(ir, inspect.isclass)
    if issubclass(cls, ir.Instruction) and cls not in _BASES
)
_INDEX = st.integers(0, 10**6)


def _instances_of(cls: type[ir.Instruction]) -> st.SearchStrategy[ir.Instruction]:
    return st.builds(cls, **{field.name: _INDEX for field in attrs.fields(cls)})


#: an instruction of any kind, with any indices
instructions = st.sampled_from(_CLASSES).flatmap(_instances_of)


def test_every_instruction_class_has_one_row():
    """Each instruction class of `schedcc.ir` has exactly one row, and no two rows share a code."""
    rows = [row.cls for row in INSTRUCTIONS]
    assert sorted(rows, key=str) == sorted(_CLASSES, key=str)
    assert len({row.code for row in INSTRUCTIONS}) == len(INSTRUCTIONS)


@given(instructions)
def test_parse_inverts_str_for_every_kind(op):
    """`parse(str(op)) == op`, of the same class, for an instruction of every kind."""
    text = str(op)
    assert parse(text) == op
    assert type(parse(text)) is type(op)
    assert text.startswith(type(op).code)


@given(instructions)
def test_str_is_the_rows_printed_form(op):
    """`str(op)` is the code, then each plain field, then `.field` for a nonzero dotted one."""
    row = spelling(type(op))
    expected = row.code
    for name, dotted in row.fields:
        value = getattr(op, name)
        expected += (f".{value}" if value else "") if dotted else str(value)
    assert str(op) == expected


def test_every_row_falls_in_one_group():
    """Each row's class is a compute, a comm, a copy or an update, so `COMPUTE`, `COMM`, `COPY`
    and `UPDATE` (read off the table) hold every instruction once."""
    groups = ir.COMPUTE + ir.COMM + ir.COPY + ir.UPDATE
    assert sorted(groups, key=str) == sorted((row.cls for row in INSTRUCTIONS), key=str)
    assert all(issubclass(cls, ir.Compute) for cls in ir.COMPUTE)
    assert all(issubclass(cls, ir.Comm) for cls in ir.COMM)
    assert all(issubclass(cls, ir.Copy) for cls in ir.COPY)
    assert all(issubclass(cls, ir.Update) for cls in ir.UPDATE)


@pytest.mark.parametrize("text", ["X3", "Tied", "Norm0", "F3.1.2", "Reduce3"])
def test_the_parse_error_lists_every_code(text):
    """A text that is no instruction gets an error naming every row's form, so a new
    instruction is listed once it has its row."""
    with pytest.raises(ValueError, match="cannot parse instruction") as info:
        parse(text)
    listed = str(info.value).split("expected one of ", 1)[1].split(", ")
    assert listed == [row.example for row in INSTRUCTIONS]
    assert [parse(example).code for example in listed] == [row.code for row in INSTRUCTIONS]


def test_a_new_row_spells_a_new_instruction():
    """A class and its row are all an instruction needs to be written and read back."""

    @attrs.frozen(slots=True)
    class Prefetch(ir.Update):
        microbatch: int
        chunk: int = 0

    row = Spelling(Prefetch, "Pf", "{microbatch}[.{chunk}]")
    assert row.write(Prefetch(3, chunk=1)) == "Pf3.1"
    assert row.write(Prefetch(3)) == "Pf3"
    assert row.read("Pf3.1") == Prefetch(3, chunk=1)
    assert row.read("Pf3.0x") is None
    assert row.example == "Pf1.1"


def test_a_subclass_is_spelled_as_its_class():
    """A subclass the table does not name prints as the class it extends."""

    @attrs.frozen(slots=True)
    class Tagged(ir.Forward):
        pass

    assert str(Tagged(2, chunk=1)) == "F2.1"


def test_error_messages_speak_the_printed_form():
    """The validator names the instruction to add in its printed form (`F1.1`, not a class)."""
    schedule = schedcc.get_schedule("interleaved-1f1b")(2, 2, num_chunks=2)
    program = schedcc.compile(schedule, validate=False)
    stages = [list(ops) for ops in program.stages]
    stages[1].remove(ir.Forward(1, chunk=1))
    broken = program.evolve(stages=tuple(map(tuple, stages)))
    messages = " ".join(str(error) for error in schedcc.validate(broken, collect=True))
    assert "F1.1" in messages


def test_the_ascii_drawing_prints_the_table_form():
    """A drawn block wide enough shows the instruction exactly as `str` prints it."""
    blocks = (ir.Forward(2, chunk=1), ir.BackwardWeight(7), ir.OverlappedBackward(4, chunk=3))
    for op in (*blocks, ir.Offload(3, chunk=1)):
        assert ascii_draw._block_text(op, 8, color=False).strip() == str(op)
    assert ascii_draw._block_text(ir.ReduceTied(0), 4, color=False) == "Tied"


def test_the_glossary_names_every_code():
    """docs/design.md's glossary entry for instructions names exactly the table's codes."""
    design = Path(__file__).parents[2] / "docs" / "design.md"
    line = next(ln for ln in design.read_text().splitlines() if ln.startswith("| instruction |"))
    assert re.findall(r"`([^`]+)`", line.split(":", 1)[1]) == [row.code for row in INSTRUCTIONS]
