"""The `schedcc` command as a user starts it, and the rows of `schedcc verify`'s table.

[Note: a command in a fresh process] `schedcc(...)` runs the command in a process of its own
(its own pid, session, environment, working directory, stdout, stderr and exit code) that
starts with nothing of the test session's state. It is forked from a server process
(multiprocessing's forkserver) that imported torch, torch.distributed and schedcc's CLI once
and has run nothing: a fresh `python -m schedcc` spends about 3.5 s of CPU importing those
before it does anything, and the suite starts the command some sixty times. What a test checks
(output, exit code, files, the ranks the command forks) is the same; only the imports are
shared. Tests about the interpreter itself (what `import schedcc` loads, the console script)
start a real `python` instead.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: What the server process imports before it forks a command (what every command imports).
_PRELOAD = [
    "torch", "torch._dynamo", "torch.distributed", "schedcc.cli", "schedcc.backends.run.job"
]  # fmt: skip
_LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def schedcc(
    *argv: str,
    timeout: float = 180,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike = ROOT,
) -> subprocess.CompletedProcess:
    """`schedcc ARGV` in a fresh process from `cwd` (default the repository root), one thread a
    rank, output captured as text. `env`: the whole environment (default this one's without a
    launcher's variables). Raises `subprocess.TimeoutExpired` after `timeout` seconds, once
    the command and every process it started are ended."""
    return start_cli(*argv, env=env, cwd=cwd).finish(timeout)


class Command:
    """A `schedcc` command started by `start_cli`, running until `finish`."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: str) -> None:
        self.argv = ["schedcc", *argv]
        self._folder = tempfile.TemporaryDirectory(prefix="schedcc-cli-")
        self._out = os.path.join(self._folder.name, "stdout")
        self._err = os.path.join(self._folder.name, "stderr")
        target, args = _command, (argv, cwd, env, self._out, self._err)
        self._process = _server().Process(target=target, args=args)
        self._process.start()

    def finish(self, timeout: float = 180) -> subprocess.CompletedProcess:
        """Wait for the command (ending it and what it started after `timeout` seconds, then
        raising `subprocess.TimeoutExpired`); its exit code and output."""
        process = self._process
        try:
            process.join(timeout)
            if process.exitcode is None:
                _end_session(process.pid)
                process.join()
                raise subprocess.TimeoutExpired(self.argv, timeout)
            _end_session(process.pid)  # ranks it left behind, if any
            out, err = Path(self._out).read_text(), Path(self._err).read_text()
        finally:
            self._folder.cleanup()
        return subprocess.CompletedProcess(self.argv, process.exitcode, out, err)


def start_cli(
    *argv: str, env: dict[str, str] | None = None, cwd: str | os.PathLike = ROOT
) -> Command:
    """`schedcc ARGV` started as `schedcc` starts it, not waited for (`Command.finish`)."""
    if env is None:
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER}
    env = {**env, "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")}
    return Command(list(argv), env, str(cwd))


def run_cli(*args: str, timeout: float = 180, env: dict[str, str] | None = None):
    """`schedcc run --no-progress ARGS` (see `schedcc`)."""
    return schedcc("run", "--no-progress", *args, timeout=timeout, env=env)


def verify_rows(out: str) -> list[list[str]]:
    """The rows of `schedcc verify`'s table in `out`: p, m, v, batches, the result, ..."""
    rows = [line.split() for line in out.splitlines()]
    return [cells for cells in rows if len(cells) > 4 and all(c.isdigit() for c in cells[:4])]


_CONTEXT = None


def _server():
    """The forkserver context, its server preloaded ([Note: a command in a fresh process])."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(_PRELOAD)
    return _CONTEXT


def _command(argv: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    """In the forked process: become `python -m schedcc ARGV` run from `cwd` and exit."""
    os.setsid()  # its own session: a timeout ends it and every rank it forked together
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # the server's may be another TMPDIR's
    os.chdir(cwd)
    sys.path.insert(0, cwd)  # as `python -m` puts the working directory first
    sys.argv = ["schedcc", *argv]
    from schedcc.cli import main

    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code or 0))


def _end_session(pid: int) -> None:
    """End every process left in the command's session (it is the session's leader)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
