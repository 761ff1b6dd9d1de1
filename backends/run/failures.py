"""How a rank of `schedcc run` failed, and the launcher's one line for it.

[Note: one line per failure] A spawned rank does not print its failure: it writes a
`RankReport` (code, one line, whether the failure is its own) to a file of the launcher's and
exits at once. Once every rank has ended, the launcher prints the earliest *cause*, a failure
the rank met by itself (the user's code raised, a user's mistake, a bug), as one line naming
the rank; the failures it set off in the other ranks (they lost a peer) are not printed, so one
bad `loss_fn` is one line and one exit code however the ranks race. With no cause (a rank was
killed or stopped, and the others timed out), every distinct line is printed once. A traceback
goes to a log file the line names, or above the line with `--debug`. Under torchrun each rank
prints its own line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

from schedcc.errors import RankFailure, UserError, first_line

__all__ = ["RankReport", "print_failures", "say"]


@dataclasses.dataclass(frozen=True)
class RankReport:
    """How a rank failed: its exit code, one line, whether the failure is its own (`cause`, as
    opposed to a lost peer or a wait that timed out), and the traceback worth keeping ("": none).
    """

    code: int
    message: str
    cause: bool
    traceback: str = ""
    time: float = 0.0

    @classmethod
    def of(cls, exc: BaseException) -> RankReport:
        """The report of `exc` (see [Note: exit codes] in `backends.run.launch`): the user's code
        failing is exit 1 with its traceback kept; a user's mistake exit 2; a lost peer exit 1,
        not a cause; anything else exit 1 with its traceback (a bug of schedcc's own)."""
        from schedcc.errors import ScheduleError, UserCodeError

        now = time.time()
        if isinstance(exc, UserCodeError):
            return cls(1, str(exc), True, _traceback(exc), now)
        if isinstance(exc, (UserError, ScheduleError, ValueError)):
            return cls(2, f"error: {exc}", True, "", now)
        if isinstance(exc, RankFailure):
            return cls(1, str(exc), False, "", now)
        return cls(1, f"failed: {first_line(exc)}", True, _traceback(exc), now)

    def line(self, rank: str, *, debug: bool) -> str:
        """`schedcc: RANK: message`, with the traceback above it (`debug`) or in a log file the
        line names."""
        line = f"schedcc: {rank}: {self.message}"
        if not self.traceback:
            return line
        if debug:
            return f"{self.traceback.rstrip()}\n{line}"
        fd, path = tempfile.mkstemp(prefix="schedcc-run-", suffix=".log")
        with os.fdopen(fd, "w") as file:
            file.write(self.traceback)
        return f"{line} (traceback in {path}; --debug prints it)"

    def write(self, path: str) -> None:
        """Write the report to `path` whole (renamed into place), for `read`."""
        with open(f"{path}.part", "w") as file:
            json.dump(dataclasses.asdict(self), file)
        os.replace(f"{path}.part", path)

    @classmethod
    def read(cls, path: str) -> RankReport | None:
        """The report written to `path`, or None (the rank ended without one)."""
        try:
            with open(path) as file:
                return cls(**json.load(file))
        except (OSError, ValueError, TypeError):
            return None


def _traceback(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


def say(line: str) -> None:
    """One line on stderr in one write, so lines of ranks ending together never interleave."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def print_failures(
    code: int, reports: list[RankReport | None], describe: Callable[[int], str], debug: bool
) -> int:
    """Print the ranks' failures once each; the exit code (see [Note: one line per failure])."""
    failed = sorted(
        ((report.time, rank, report) for rank, report in enumerate(reports) if report),
        key=lambda item: item[:2],
    )
    causes = [(rank, report) for _, rank, report in failed if report.cause]
    if causes:
        rank, first = causes[0]
        say(first.line(describe(rank), debug=debug))
        return first.code
    said: set[str] = set()
    for _, rank, report in failed:
        if report.message not in said:
            said.add(report.message)
            say(report.line(f"rank {rank}", debug=debug))
    return code
