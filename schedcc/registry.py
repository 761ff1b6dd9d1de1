"""Finding schedules by name (registered entry points, `module:Class` or `path/file.py:Class`)
and building the class a user named (`build_schedule`).

Built-in schedules register through the entry-point group `schedcc.schedules`, exactly as a
third-party package adds its own:

    [project.entry-points."schedcc.schedules"]
    my-schedule = "my_package.schedules:MySchedule"
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from importlib.metadata import entry_points
from pathlib import Path

from schedcc.errors import (
    USER_FILE_MODULE,
    ScheduleCodeError,
    UnknownScheduleError,
    call_user_code,
)
from schedcc.schedule import Schedule

__all__ = [
    "available_schedules",
    "build_schedule",
    "get_schedule",
    "load_object",
    "registered_classes",
    "registered_schedules",
]

GROUP = "schedcc.schedules"


def registered_schedules() -> dict[str, str]:
    """Every registered name (aliases included) mapped to its `module:Class` target.

    [Note: reading the entry points] Finding a group's entry points reads the metadata of every
    installed distribution (about 10 ms here), and a test run or a search asks for schedules by
    name thousands of times. The table is read again only when the import path, or the
    modification time of a folder on it, has changed: what `importlib.metadata` itself checks
    before it looks a folder up again, so a package installed while the process runs is seen.
    """
    global _TABLE
    seen = _path_state()
    if _TABLE is None or _TABLE[0] != seen:
        _TABLE = seen, {ep.name: ep.value for ep in entry_points(group=GROUP)}
    return dict(_TABLE[1])


#: `(the import path's state, the table)` of the last reading ([Note: reading the entry points]).
_TABLE: tuple[tuple, dict[str, str]] | None = None


def _path_state() -> tuple:
    """Each folder on the import path with its modification time (None where it is none)."""
    state = []
    for folder in sys.path:
        try:
            state.append((folder, os.stat(folder or ".").st_mtime_ns))
        except OSError:
            state.append((folder, None))
    return tuple(state)


def registered_classes() -> dict[str, type[Schedule]]:
    """Each registered schedule class once, aliases folded, by its own name, sorted.

    The name is the class's `name` where that is registered, else its first registered name.

    Raises:
        UnknownScheduleError: a registered entry does not load (e.g. a plugin that fails to
            import); the message names it.

    >>> "pipedream-flush" in registered_classes(), "1f1b" in registered_classes()
    (False, True)
    """
    by_target: dict[str, list[str]] = {}
    for name, target in sorted(registered_schedules().items()):
        by_target.setdefault(target, []).append(name)
    found = {}
    for target, names in by_target.items():
        cls = _load(target, names[0])  # the entry points read once, not once a name
        found[cls.name if cls.name in names else names[0]] = cls
    return dict(sorted(found.items()))


def available_schedules() -> list[str]:
    """The sorted registered schedule names, aliases included.

    >>> "1f1b" in available_schedules()
    True
    """
    return sorted(registered_schedules())


def get_schedule(name: str) -> type[Schedule]:
    """The schedule class for a registered name, `module:Class` or `path/to/file.py:Class`.

    Raises:
        UnknownScheduleError: nothing by that name (or not a string), or it is not a `Schedule`
            subclass.

    >>> get_schedule("gpipe").__name__
    'GPipe'
    """
    if not isinstance(name, str):
        raise UnknownScheduleError(f"a schedule is named by a string, got {name!r}")
    registered = registered_schedules()
    if name in registered:
        return _load(registered[name], name)
    if ":" in name:
        return _load(name, name)
    raise UnknownScheduleError(
        f"unknown schedule {name!r}; registered: {', '.join(sorted(registered))} "
        "(or give module:Class or path/to/file.py:Class)"
    )


def build_schedule(
    schedule_cls: type[Schedule],
    num_stages: int,
    num_microbatches: int,
    *,
    num_chunks: int | None = None,
    num_batches: int = 1,
    num_parts: int | None = None,
) -> Schedule:
    """`schedule_cls` at this shape, where a failure of the class's own code is a typed error.

    `num_chunks=None` keeps the class's own `default_num_chunks` (the smallest of its `chunks`
    unless it says otherwise: 1, or 2 for ZB-V), and `num_parts=None` its `default_num_parts`
    (sequence parts: 1, or 2 for seq1f1b). Used wherever a class a user named is built
    (the CLI, `schedcc.tune`, `schedcc.testing`).

    Raises:
        ScheduleConfigError: the schedule rejects the shape (a `num_chunks` outside its
            `chunks`, or its `check()` says why).
        ScheduleCodeError: the constructor does not take the standard arguments, or raised
            something else; the message names the class.

    >>> build_schedule(get_schedule("zb-v"), 4, 8)
    ZBV(p=4, m=8, v=2)
    """
    kwargs = {"num_stages": num_stages, "num_microbatches": num_microbatches}
    if num_chunks is not None:
        kwargs["num_chunks"] = num_chunks
    kwargs["num_batches"] = num_batches
    if num_parts is not None:
        kwargs["num_parts"] = num_parts
    name = getattr(schedule_cls, "__name__", repr(schedule_cls))
    shape = ", ".join(f"{key}={value}" for key, value in kwargs.items())
    schedule = call_user_code(
        name,
        "__init__()",
        lambda: schedule_cls(**kwargs),
        where=f"{name}({shape})",
        hint="a schedule's constructor takes (num_stages, num_microbatches, num_chunks=1, "
        "num_batches=1), as schedcc.Schedule's does",
    )
    if not isinstance(schedule, Schedule):
        raise ScheduleCodeError(f"{name}(...) made {schedule!r}, not a schedcc.Schedule")
    return schedule


def _load(target: str, name: str) -> type[Schedule]:
    cls = load_object(target, what=f"schedule {name!r}", kind="Class")
    if not (isinstance(cls, type) and issubclass(cls, Schedule)):
        raise UnknownScheduleError(
            f"schedule {name!r}: {target} is not a subclass of schedcc.Schedule"
        )
    return cls


def load_object(target: str, *, what: str, kind: str = "name", error=UnknownScheduleError):
    """The object `target` names: `module:attr` or `path/to/file.py:attr`.

    Args:
        target: where the object is.
        what: names it at the start of every message (e.g. `"schedule 'x'"`).
        kind: what `attr` is called in the message for a target without a colon.
        error: the exception class raised.

    Raises:
        error: no colon, a module or file that does not import (the reason in one line), or
            no such attribute.

    >>> load_object("schedcc.registry:load_object", what="test").__name__
    'load_object'
    """
    where, _, attr = target.rpartition(":")
    if not where or not attr:
        raise error(f"{what}: expected module:{kind} or path/to/file.py:{kind}")
    try:
        if where.endswith(".py"):
            module = _import_file(where, what, error)
        else:
            module = importlib.import_module(where)
    except (error, KeyboardInterrupt):
        raise
    except BaseException as exc:  # a user's module may fail in any way, sys.exit() included
        raise error(f"{what}: cannot import {where}: {type(exc).__name__}: {exc}") from exc
    obj = getattr(module, attr, None)
    if obj is None:
        raise error(f"{what}: {where} has no attribute {attr!r}")
    return obj


def _import_file(path: str, what: str, error):
    """The module of the file `path`, imported with its folder first on `sys.path`, so that it
    imports the modules beside it as `python path` would (in every process that loads it:
    `schedcc run`'s ranks too)."""
    file = Path(path)
    if not file.is_file():
        raise error(f"{what}: file {path!r} does not exist")
    module_name = f"{USER_FILE_MODULE}{abs(hash(str(file.resolve())))}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, file)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    folder = str(file.resolve().parent)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    finally:
        sys.path.remove(folder)  # the first entry equal to it: the one put there
    return module
