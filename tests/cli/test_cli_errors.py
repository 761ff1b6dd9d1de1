"""Bad input never gives a traceback: a user's schedule that fails in any way, absurd costs or
shapes, and torch base classes are one line on stderr and exit 2, in every command."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

from schedcc.cli import main

BROKEN = """
from schedcc import Backward, Forward, Schedule


class Raises(Schedule):
    def order(self, stage):
        raise RuntimeError("boom\\nsecond line")
        yield


class ReturnsNone(Schedule):
    def order(self, stage):
        return None


class YieldsText(Schedule):
    def order(self, stage):
        yield "F0"


class OtherSignature(Schedule):
    def __init__(self, stages):
        super().__init__(stages, 1)

    def order(self, stage):
        yield Forward(0)


class CheckRaises(Schedule):
    def check(self):
        raise KeyError("num_chunks")

    def order(self, stage):
        yield Forward(0)


class NoOrder(Schedule):
    pass


class PlacementRaises(Schedule):
    def placement(self, segment):
        raise IndexError("no such segment")

    def order(self, stage):
        yield Forward(0)


class Forever(Schedule):
    def order(self, stage):
        op = Forward(0)
        while True:
            yield op
"""

#: (class, what the one line must say: the class and the method it came from)
CASES = [
    ("Raises", "Raises.order(0) raised RuntimeError: boom"),
    ("ReturnsNone", "ReturnsNone.order(0) returned None, which is not iterable"),
    ("YieldsText", "YieldsText.order(0) yielded 'F0', which is not a schedcc instruction"),
    ("OtherSignature", "OtherSignature.__init__() raised TypeError"),
    ("CheckRaises", "CheckRaises.check() raised KeyError"),
    ("NoOrder", "NoOrder does not define order(stage)"),
    ("PlacementRaises", "PlacementRaises.placement(0) raised IndexError: no such segment"),
]
COMMANDS = {
    "show": ["show", "-p", "2", "-m", "2"],
    "verify": ["verify"],
    "tune": ["tune", "-p", "2", "-m", "2"],
    "run": ["run", "--no-progress", "--steps", "1"],
}


@pytest.fixture
def broken(tmp_path, monkeypatch):
    """The directory holding broken.py, made the working directory."""
    (tmp_path / "broken.py").write_text(BROKEN)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _one_line_exit_2(argv, capsys) -> str:
    """Run `schedcc argv` in this process; assert exit 2 and one line on stderr; return it."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors exit from inside main
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(("cls", "says"), CASES)
def test_a_failing_schedule_is_one_line_in_every_command(broken, capsys, command, cls, says):
    """order() raising, returning None or yielding text, another constructor signature, check()
    or placement() raising, no order(): one line naming the class and method, exit 2."""
    argv = [*COMMANDS[command], "--schedule", f"broken.py:{cls}"]
    assert says in _one_line_exit_2(argv, capsys)


def _limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def _schedcc(*argv: str, cwd=None) -> str:
    """Run `schedcc argv` in a process with 2 GiB and 60 s (an unbounded command runs out of
    one or the other); assert exit 2 and one line on stderr; return that line."""
    result = subprocess.run(
        [sys.executable, "-m", "schedcc", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        preexec_fn=_limit_memory,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    return line


@pytest.mark.parametrize("command", ["show", "verify", "tune"])
def test_a_generator_that_never_ends_is_one_line(broken, command):
    """order() that never returns hits collect's limit: one line naming the stage and limit."""
    line = _schedcc(*COMMANDS[command], "--schedule", "broken.py:Forever", cwd=broken)
    assert "Forever.order(0) yielded more than" in line
    assert "for stage 0" in line


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["show", "--schedule", "1f1b", "--costs", "comm=1e308,F=1e308"], "overflows"),
        (["tune", "-p", "4", "--costs", "F=1e308,B=1e308"], "overflows"),
        (["verify", "--schedule", "gpipe", "-v", "99999"], "at most 64 chunks per stage"),
        (["verify", "--schedule", "gpipe", "-p", "99999"], "at most 1024 stages"),
        (["show", "--schedule", "gpipe", "-m", "1000000"], "at most 65536 microbatches"),
        (["show", "--schedule", "gpipe", "-p", "1024", "-m", "4096"], "segment-microbatches"),
        (["tune", "-p", "8", "-m", "65536", "-v", "1,64"], "segment-microbatches"),
    ],
)
def test_absurd_costs_and_shapes_are_one_line(argv, says):
    """Costs whose makespan overflows and shapes past a sane bound: one line, exit 2."""
    assert says in _schedcc(*argv)


def test_a_torch_base_class_is_one_line(capsys):
    """verify --torch PipelineScheduleSingle (an abstract base, not a schedule): one line."""
    pytest.importorskip("torch")
    err = _one_line_exit_2(["verify", "--torch", "PipelineScheduleSingle"], capsys)
    assert "PipelineScheduleSingle is a base class" in err
    assert "Schedule1F1B" in err
