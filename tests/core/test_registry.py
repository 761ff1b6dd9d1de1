"""Finding schedules: registered names, aliases, module:Class and path/file.py:Class."""

from __future__ import annotations

import textwrap

import pytest

import schedcc
from schedcc import Schedule, UnknownScheduleError, available_schedules, get_schedule
from schedcc.schedules.gpipe import GPipe
from schedcc.schedules.one_f_one_b import OneFOneB


def test_registered_names_resolve():
    """The built-in names resolve to their classes through the entry points."""
    assert get_schedule("gpipe") is GPipe
    assert get_schedule("1f1b") is OneFOneB


def test_alias_resolves_to_same_class():
    """`pipedream-flush` is an alias of `1f1b`."""
    assert get_schedule("pipedream-flush") is get_schedule("1f1b")


def test_module_colon_class():
    """`module:Class` imports the module and returns the class."""
    assert get_schedule("schedcc.schedules.gpipe:GPipe") is GPipe


def test_file_colon_class(tmp_path):
    """`path/file.py:Class` loads a schedule from a file that is not on sys.path."""
    path = tmp_path / "my_schedule.py"
    path.write_text(
        textwrap.dedent(
            """
            from schedcc import Schedule, Forward, Backward

            class Mine(Schedule):
                '''All forwards, then all backwards.'''
                def order(self, stage):
                    yield from (Forward(i) for i in range(self.num_microbatches))
                    yield from (Backward(i) for i in range(self.num_microbatches))
            """
        )
    )
    cls = get_schedule(f"{path}:Mine")
    assert issubclass(cls, Schedule)
    assert cls.description() == "All forwards, then all backwards."
    schedcc.compile(cls(2, 3))


def test_unknown_name_lists_registered():
    """An unknown name raises UnknownScheduleError listing every registered name."""
    with pytest.raises(UnknownScheduleError) as info:
        get_schedule("no-such-schedule")
    for name in available_schedules():
        assert name in str(info.value)
    assert isinstance(info.value, LookupError)


def test_not_a_schedule_class():
    """A target that is not a Schedule subclass is rejected with the reason."""
    with pytest.raises(UnknownScheduleError, match=r"not a subclass of schedcc\.Schedule"):
        get_schedule("schedcc.ir:Forward")


def test_missing_attribute():
    """A module without the named class says which attribute is missing."""
    with pytest.raises(UnknownScheduleError, match="no attribute 'Nope'"):
        get_schedule("schedcc.schedules.gpipe:Nope")


def test_missing_file(tmp_path):
    """A file that does not exist is named in the error."""
    with pytest.raises(UnknownScheduleError, match="does not exist"):
        get_schedule(f"{tmp_path / 'absent.py'}:X")


def test_missing_module():
    """A module that cannot be imported is an UnknownScheduleError, not an ImportError."""
    with pytest.raises(UnknownScheduleError, match="cannot import no_such_module_xyz"):
        get_schedule("no_such_module_xyz:X")


def test_module_raising_on_import(tmp_path):
    """A user file that raises while importing is reported with its exception, and not cached."""
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('boom at import')\n")
    for _ in range(2):
        with pytest.raises(UnknownScheduleError, match="RuntimeError: boom at import"):
            get_schedule(f"{path}:X")


def test_available_schedules_sorted():
    """available_schedules() is sorted and holds the built-in names and aliases."""
    names = available_schedules()
    assert names == sorted(names)
    assert {"gpipe", "1f1b", "pipedream-flush"} <= set(names)


def test_a_name_that_is_not_a_string_is_an_unknown_schedule():
    """get_schedule(3) raises UnknownScheduleError saying a schedule is named by a string."""
    with pytest.raises(UnknownScheduleError, match="named by a string"):
        get_schedule(3)


def test_registered_classes_fold_aliases():
    """registered_classes maps each registered class once, under its own name, sorted."""
    from schedcc.registry import registered_classes

    classes = registered_classes()
    assert list(classes) == sorted(classes)
    assert classes["1f1b"] is OneFOneB
    assert classes["gpipe"] is GPipe
    assert "pipedream-flush" not in classes
    assert len(set(classes.values())) == len(classes)


def test_a_package_installed_while_running_is_found(tmp_path, monkeypatch):
    """The entry points are read again when a folder on the import path changes: a package
    installed into it (its dist-info written there) registers its schedule at once, though the
    table was read before ([Note: reading the entry points])."""
    (tmp_path / "late_plugin.py").write_text(
        "from schedcc.schedules.gpipe import GPipe\n\nclass Late(GPipe):\n    name = 'late'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "late" not in available_schedules()  # read with the folder empty of metadata
    info = tmp_path / "late_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: late-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[schedcc.schedules]\nlate = late_plugin:Late\n")
    assert "late" in available_schedules()
    assert get_schedule("late").name == "late"
