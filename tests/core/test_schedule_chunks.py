"""`Schedule.chunks`: the chunk counts a schedule declares are read, never probed; and `order`'s
old name `steps` still works for one release, with one DeprecationWarning."""

from __future__ import annotations

import ast
import inspect
import warnings
from pathlib import Path

import pytest
from _cli import verify_rows
from hypothesis import given
from hypothesis import strategies as st

import schedcc
from schedcc import Backward, Forward, Schedule, ScheduleConfigError
from schedcc.cli import main
from schedcc.registry import build_schedule, get_schedule, registered_classes
from schedcc.schedules.gpipe import GPipe
from schedcc.testing import check_schedule, shapes


class NeedsFour(Schedule):
    """GPipe over exactly four chunks per stage; `order` raises at any other count, so anything
    that compiled it at another v to find out would fail."""

    name = "needs-four"
    chunks = (4,)

    def order(self, stage):
        if self.num_chunks != 4:
            raise RuntimeError(f"probed at v={self.num_chunks}")
        for batch in range(self.num_batches):
            mbs = self.microbatches(batch)
            for chunk in range(4):
                yield from (Forward(i, chunk) for i in mbs)
            for chunk in reversed(range(4)):
                yield from (Backward(i, chunk) for i in reversed(mbs))


class OneChunk(Schedule):
    """GPipe's order in a schedule that never mentions chunks."""

    order = GPipe.order


def test_a_schedule_needing_four_chunks_defaults_to_four():
    """With no num_chunks a schedule gets the smallest of its chunks."""
    assert NeedsFour(2, 4).num_chunks == 4
    assert build_schedule(NeedsFour, 2, 4).num_segments == 8


def test_check_schedule_draws_v_from_chunks():
    """check_schedule checks a v = 4 schedule at v = 4 (never compiling it at another v)."""
    check_schedule(NeedsFour, max_examples=10, max_stages=3, max_microbatches=4, max_batches=2)


@given(shapes(NeedsFour, max_stages=3, max_microbatches=4))
def test_shapes_of_a_v4_schedule_all_have_v4(shape):
    """`schedcc.testing.shapes` draws only the declared chunk count."""
    assert shape.num_chunks == 4


def test_check_schedule_refuses_bounds_below_every_declared_count():
    """max_chunks below every count in `chunks`: a config error naming chunks and the bound."""
    with pytest.raises(ScheduleConfigError, match=r"chunks = \(4,\).*raise max_chunks"):
        check_schedule(NeedsFour, max_chunks=2)


def test_verify_checks_a_v4_schedule_at_v4(tmp_path, monkeypatch, capsys):
    """`schedcc verify` with no -v tries the schedule's own chunk count: every row at v = 4."""
    (tmp_path / "four.py").write_text(_source(NeedsFour))
    monkeypatch.chdir(tmp_path)
    assert main(["verify", "--schedule", "four.py:NeedsFour", "-p", "2", "--batches", "1"]) == 0
    rows = verify_rows(capsys.readouterr().out)
    assert len(rows) == 6  # m in 1, 2, 3, 4, 8, 16
    assert {(cells[2], cells[4]) for cells in rows} == {("4", "pass")}


def test_tune_draws_v_from_chunks():
    """`tune` with no num_chunks ranks each schedule at its own counts: NeedsFour at v = 4 only,
    1F1B at 1, ZB-V at 2, interleaved-1F1B at 1 and 2; nothing skipped for its chunk count."""
    result = schedcc.tune(
        {
            "needs-four": NeedsFour,
            "1f1b": get_schedule("1f1b"),
            "zb-v": get_schedule("zb-v"),
            "interleaved-1f1b": get_schedule("interleaved-1f1b"),
        },
        num_stages=2,
        num_microbatches=4,
    )
    tried = {(c.schedule, c.num_chunks) for c in result.ranked}
    assert tried == {
        ("needs-four", 4),
        ("1f1b", 1),
        ("zb-v", 2),
        ("interleaved-1f1b", 1),
        ("interleaved-1f1b", 2),
    }
    assert result.skipped == ()


def test_tune_skips_a_count_outside_chunks_with_a_line_naming_chunks():
    """Asked for v = 1 and 4, NeedsFour is ranked at 4 and skipped at 1 with the reason."""
    result = schedcc.tune([NeedsFour], num_stages=2, num_microbatches=4, num_chunks=[1, 4])
    assert [(c.schedule, c.num_chunks) for c in result.ranked] == [("needs-four", 4)]
    (skipped,) = result.skipped
    assert skipped.num_chunks == 1
    assert "chunks = (4,)" in skipped.reason


def test_a_one_chunk_schedule_asked_for_two_is_refused_naming_chunks():
    """A schedule declaring nothing runs v = 1; v = 2 is one line naming `chunks` and the fix."""
    with pytest.raises(ScheduleConfigError) as info:
        OneChunk(2, 4, num_chunks=2)
    message = str(info.value)
    assert len(message.splitlines()) == 1
    assert "chunks = (1,)" in message
    assert "pass num_chunks=1" in message


def test_the_cli_refuses_a_count_outside_chunks_in_one_line(tmp_path, monkeypatch, capsys):
    """`schedcc show -v 2` of a one-chunk schedule: exit 2, one line naming chunks."""
    (tmp_path / "one.py").write_text(_source(OneChunk))
    monkeypatch.chdir(tmp_path)
    assert main(["show", "--schedule", "one.py:OneChunk", "-p", "2", "-m", "4", "-v", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "chunks = (1,)" in err


def test_the_compiler_reads_chunks_too():
    """A schedule whose class stops declaring its count after it was built is refused by
    `compile` (collect) with a config error naming chunks, before its order runs."""
    cls = type("Changing", (NeedsFour,), {})
    schedule = cls(2, 4)
    cls.chunks = (1,)
    with pytest.raises(ScheduleConfigError, match=r"num_chunks=4 is not one of Changing\.chunks"):
        schedcc.compile(schedule)


def test_the_schedule_module_needs_no_compiler():
    """Nothing is probed, so `schedcc/schedule.py` imports no pass, not even lazily (the circle
    with collect is gone): only the errors and the instructions."""
    tree = ast.parse((Path(schedcc.__file__).parent / "schedule.py").read_text())
    nodes = list(ast.walk(tree))
    imported = {node.module for node in nodes if isinstance(node, ast.ImportFrom)}
    imported |= {a.name for node in nodes if isinstance(node, ast.Import) for a in node.names}
    assert {name for name in imported if name and name.startswith("schedcc")} == {
        "schedcc.errors",
        "schedcc.ir",
    }


@pytest.mark.parametrize(
    "chunks", [(), (0,), (1, "2"), "some", 2, [1, 2], (True,), range(3), range(3, 3)]
)
def test_a_malformed_chunks_is_a_config_error_naming_it(chunks):
    """`chunks` that is not a tuple or range of positive ints, or "any": a typed error."""
    cls = type("Bad", (OneChunk,), {"chunks": chunks})
    with pytest.raises(ScheduleConfigError, match=r"Bad\.chunks must be"):
        cls(2, 2)


@given(st.sets(st.integers(1, 6), min_size=1), st.integers(1, 6))
def test_declared_counts_are_exactly_the_accepted_ones(counts, v):
    """A class accepts num_chunks = v iff v is in its chunks, and lists them in order."""
    cls = type("Declared", (OneChunk,), {"chunks": tuple(counts)})
    assert cls.chunk_counts(6) == tuple(sorted(counts))
    assert cls.supports_chunks(v) is (v in counts)
    if v in counts:
        assert cls(1, 1, num_chunks=v).num_chunks == v
    else:
        with pytest.raises(ScheduleConfigError, match="chunks"):
            cls(1, 1, num_chunks=v)


@given(st.integers(1, 5), st.integers(1, 5), st.integers(1, 3))
def test_ranges_and_any(start, length, step):
    """A range's counts are its members; "any" is every count up to the limit."""
    counts = range(start, start + length * step, step)
    cls = type("Ranged", (OneChunk,), {"chunks": counts})
    assert cls.chunk_counts(64) == tuple(counts)
    assert cls.chunk_counts(64, first=2) == tuple(counts)[:2]
    assert cls(1, 1).num_chunks == start
    assert type("Any", (OneChunk,), {"chunks": "any"}).chunk_counts(start) == tuple(
        range(1, start + 1)
    )


def test_every_builtin_declares_chunks_it_compiles_at():
    """Each registered schedule compiles at the first two of its own chunk counts (p = 2, m = 4;
    m = 8 for dualpipe)."""
    for name, cls in registered_classes().items():
        counts = cls.chunk_counts(8, first=2)
        assert counts, name
        for v in counts:
            schedule = build_schedule(cls, 2, 8 if name.startswith("dualpipe") else 4, num_chunks=v)
            assert schedcc.compile(schedule).schedule.num_chunks == v, name


# -- the old name, steps ------------------------------------------------------------------------


def _define_old():
    class OldGPipe(Schedule):
        chunks = "any"

        def steps(self, stage):
            for chunk in range(self.num_chunks):
                yield from (Forward(i, chunk) for i in range(self.num_microbatches))
            for chunk in reversed(range(self.num_chunks)):
                yield from (Backward(i, chunk) for i in reversed(range(self.num_microbatches)))

    return OldGPipe


def test_a_steps_only_subclass_warns_once_naming_the_fix():
    """Defining a class with only `steps` emits exactly one DeprecationWarning saying to rename
    it to `order`; compiling it twice warns no more."""
    with pytest.warns(DeprecationWarning, match=r"rename it to order\(stage\)") as record:
        old = _define_old()
    assert len(record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        schedcc.compile(old(2, 3, num_chunks=2))
        schedcc.compile(old(3, 2))


@pytest.mark.parametrize(("p", "m", "v"), [(1, 1, 1), (2, 3, 2), (4, 8, 1), (3, 4, 3)])
def test_a_steps_only_subclass_compiles_as_gpipe(p, m, v):
    """The old-style GPipe compiles to exactly the program of the built-in GPipe."""
    with pytest.warns(DeprecationWarning, match="rename it to order"):
        old = _define_old()
    gpipe = get_schedule("gpipe")
    assert schedcc.compile(old(p, m, v)).to_text() == schedcc.compile(gpipe(p, m, v)).to_text()


def test_steps_overriding_a_builtin_order_is_what_runs():
    """A subclass of a built-in that overrides only `steps` runs its `steps`, not the parent's
    `order`."""
    with pytest.warns(DeprecationWarning, match="rename it to order"):

        class Reordered(get_schedule("1f1b")):
            def steps(self, stage):
                yield from get_schedule("gpipe")(self.num_stages, self.num_microbatches).order(
                    stage
                )

    text = schedcc.compile(Reordered(2, 3)).to_text()
    assert text == schedcc.compile(get_schedule("gpipe")(2, 3)).to_text()
    assert text != schedcc.compile(get_schedule("1f1b")(2, 3)).to_text()


def test_calling_steps_on_a_new_schedule_warns_and_gives_order():
    """`schedule.steps(stage)`, the old call, warns and yields what `order(stage)` does."""
    schedule = get_schedule("1f1b")(2, 4)
    with pytest.warns(DeprecationWarning, match="order"):
        old = list(schedule.steps(0))
    assert old == list(schedule.order(0))


def test_defining_order_does_not_warn():
    """A class that defines `order` (also beside a `steps` of its own) warns nothing, and its
    `order` is what runs."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")

        class Both(Schedule):
            def order(self, stage):
                yield from OneChunk.order(self, stage)

            def steps(self, stage):
                raise AssertionError("steps is not called when order is defined")

        program = schedcc.compile(Both(2, 3))
    assert program.to_text() == schedcc.compile(OneChunk(2, 3)).to_text()


def _source(cls: type) -> str:
    """A module defining `cls` alone, as a user's file would."""
    header = [
        "from schedcc import Backward, Forward, Schedule",
        "from schedcc.schedules.gpipe import GPipe",
    ]
    return "\n".join(header) + "\n\n\n" + inspect.getsource(cls)
