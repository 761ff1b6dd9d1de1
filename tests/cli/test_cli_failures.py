"""What the commands say when the user's code fails: a schedule calling `sys.exit(0)` is one line
and exit 2 in every command (never a silent pass); `schedcc run` with a `--model` whose loss
raises is one line naming the rank, the function and the exception, exit 1, however the ranks
race (see [Note: one line per failure] in `backends/run/failures.py`); more ranks than cores
is refused before any rank starts (see [Note: one core a rank] in `backends/run/launch.py`)."""

from __future__ import annotations

import re
import subprocess
import textwrap
from pathlib import Path

import pytest
from _cli import Command, start_cli

from schedcc.backends.run import launch
from schedcc.cli import main
from schedcc.errors import UserError

EXITS = """
from schedcc import Schedule


class Exits(Schedule):
    def order(self, stage):
        raise SystemExit(0)
        yield
"""

COMMANDS = {
    "show": ["show", "-p", "2", "-m", "2"],
    "verify": ["verify"],
    "tune": ["tune", "-p", "2", "-m", "2"],
    "run": ["run", "--no-progress", "--steps", "1"],
}


def _code_and_err(argv, capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # what a schedule's sys.exit(0) did to every command
        code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("command", COMMANDS)
def test_a_schedule_that_exits_is_one_line_and_exit_2_in_every_command(
    tmp_path, monkeypatch, capsys, command
):
    """order() raising SystemExit(0): show, verify, tune and run exit 2 with one line naming
    the method, not 0 with nothing said."""
    (tmp_path / "exits.py").write_text(EXITS)
    monkeypatch.chdir(tmp_path)
    code, err = _code_and_err([*COMMANDS[command], "--schedule", "exits.py:Exits"], capsys)
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert "Exits.order(0) raised SystemExit: 0" in line


MODEL = textwrap.dedent(
    """
    import torch
    from torch import nn
    from schedcc.backends.run.models import RunModel

    def batch(batch_size, step):
        x = torch.randn(batch_size, 4, generator=torch.Generator().manual_seed(step))
        return x, x.flip(1)

    def segments(num_segments):
        torch.manual_seed(0)
        return [nn.Linear(4, 4) for _ in range(num_segments)]

    def raising_loss(output, targets):
        raise KeyError("no loss today")

    def make(num_segments, *, seed):
        return RunModel(segments(num_segments), raising_loss, batch)

    def make_text_loss(num_segments, *, seed):
        return RunModel(segments(num_segments), lambda output, targets: "nope", batch)
    """
)


def _start(tmp_path, factory: str, *flags: str) -> Command:
    """`schedcc run --model model.py:FACTORY --steps 1 -m 2 FLAGS` started as `run_cli` runs
    it (a fresh process outside any torchrun, one thread a rank), output captured."""
    model = tmp_path / "model.py"
    if not model.exists():  # written once: runs started before may be importing it
        model.write_text(MODEL)
    argv = ["--model", f"{model}:{factory}", "--steps", "1", "-m", "2", *flags]
    return start_cli("run", "--no-progress", *argv)


def _finish(run: Command) -> subprocess.CompletedProcess:
    return run.finish(timeout=180)


def _run_model(tmp_path, factory: str, *flags: str) -> subprocess.CompletedProcess:
    return _finish(_start(tmp_path, factory, *flags))


def test_a_loss_that_raises_is_one_line_and_exit_1_however_the_ranks_race(tmp_path):
    """Five runs at once (so the ranks race differently) whose loss raises: each exits 1 with
    one line naming the rank, loss_fn and the KeyError, no traceback (it is in the log file the
    line names)."""
    runs = [_start(tmp_path, "make") for _ in range(5)]
    for result in map(_finish, runs):
        assert result.returncode == 1, result.stderr
        assert "Traceback" not in result.stderr, result.stderr
        (line,) = result.stderr.strip().splitlines()
        pattern = (
            r"schedcc: rank 1 \(stage 1, dp 0\): loss_fn model\.py:raising_loss\(output of "
            r"shape \(2, 4\), target of shape \(2, 4\)\) raised KeyError: 'no loss today' "
            r"\(traceback in (\S+); --debug prints it\)"
        )
        match = re.fullmatch(pattern, line)
        assert match, line
        log = Path(match.group(1))
        assert 'raise KeyError("no loss today")' in log.read_text()
        log.unlink()


def test_debug_prints_the_traceback_once_above_the_line(tmp_path):
    """`--debug`: the failed rank's traceback, once, then the same line without a log file."""
    result = _run_model(tmp_path, "make", "--debug")
    assert result.returncode == 1, result.stderr
    assert result.stderr.count('raise KeyError("no loss today")') == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("schedcc: rank 1 (stage 1, dp 0): loss_fn model.py:raising_loss"), last
    assert last.endswith("raised KeyError: 'no loss today'"), last


def test_a_bad_loss_on_two_replicas_is_one_line_and_exit_2(tmp_path):
    """dp = 2: both last stages' loss returns text (a broken contract, exit 2); one line, once,
    whichever rank the launcher saw first; --debug adds no traceback to a user's mistake."""
    result = _run_model(tmp_path, "make_text_loss", "--dp", "2", "--debug")
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert re.match(r"schedcc: rank [13] \(stage 1, dp [01]\): error: .*loss_fn must return", line)


def test_more_ranks_than_cores_is_refused_before_any_rank_starts(monkeypatch, capsys):
    """`schedcc run -p 64` on a machine with fewer cores: exit 2, one line saying the fix, and
    nothing spawned."""
    monkeypatch.delenv(launch.OVERSUBSCRIBE, raising=False)
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda pid: {0, 1})

    def no_spawn(*args, **kwargs):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(launch, "spawn", no_spawn)
    code, err = _code_and_err(["run", "-p", "64", "-m", "64", "--steps", "1"], capsys)
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert "64 ranks (p * dp * tp) would share the 2 core(s)" in line
    assert "--oversubscribe" in line


def test_oversubscribing_is_allowed_when_asked(monkeypatch):
    """Two ranks a core start; more need `--oversubscribe`, or SCHEDCC_OVERSUBSCRIBE=1."""
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.delenv(launch.OVERSUBSCRIBE, raising=False)
    launch.check_cores(4)
    launch.check_cores(64, oversubscribe=True)
    with pytest.raises(UserError, match=r"5 ranks .* at most 4 ranks"):
        launch.check_cores(5)
    monkeypatch.setenv(launch.OVERSUBSCRIBE, "1")
    launch.check_cores(64)
