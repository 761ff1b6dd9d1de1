"""The `schedcc` command line: one module per subcommand, dispatched from `main`.

Each subcommand module defines `register(subparsers)`, which adds its parser and sets
`func=run` on it; `run(args) -> int` is the exit status. The arguments they share are defined
once, in `schedcc.cli.args`. A user's mistake (a `ScheduleError`, a `ValueError`, a missing file)
is printed as one line and exits 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

from schedcc.cli import list_, run, search, show, tune, verify
from schedcc.cli.args import UsageError
from schedcc.errors import ScheduleError

__all__ = ["UsageError", "build_parser", "main"]

#: Subcommand modules, in the order `--help` lists them.
COMMANDS = (list_, show, verify, run, tune, search)

EPILOG = """examples:
  schedcc list
  schedcc show --schedule 1f1b -p 4 -m 8
  schedcc verify --schedule my_schedules.py:MySchedule -p 4 -m 8
  schedcc run --schedule 1f1b --steps 20
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="schedcc",
        description="Compile, prove, simulate, draw and run pipeline-parallel schedules.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMANDS:
        module.register(subparsers)
    one_line_errors(parser, "")
    for name, subparser in subparsers.choices.items():
        one_line_errors(subparser, name)
    return parser


def one_line_errors(parser: argparse.ArgumentParser, command: str) -> None:
    """Make argparse report a bad value as one line (no usage block), exit 2."""
    prefix = f"schedcc {command}".strip()

    def error(message: str):
        print(f"{prefix}: error: {message} (see {prefix} --help)", file=sys.stderr)
        raise SystemExit(2)

    parser.error = error  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 a failed check, 2 bad input).

    Called as the program (`argv` None: `schedcc ...`, `python -m schedcc ...`) by a command
    that imported torch, it ends the process itself once the command is done (see [Note: a
    quick exit]).
    """
    code = _main(argv)
    if argv is None and "torch" in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


# [Note: a quick exit] Tearing down an interpreter that imported torch (and torch._dynamo, which
# torch.optim imports) frees tens of thousands of objects: about half a second on an idle
# machine and two or more on a loaded one, after the command has printed all it has to say.
# `schedcc run` promises to return within its timeout plus a second or two of a stopped rank
# ([Note: a rank that stops responding]), so the program skips the teardown: every file it
# wrote is closed, its ranks are gone, and nothing it needs runs at exit.


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # e.g. `schedcc tune ... | head`: the reader left; nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (ScheduleError, UsageError, ValueError, OSError) as exc:
        message = str(exc).strip()
        print(f"schedcc {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"schedcc {args.command}: interrupted", file=sys.stderr)
        return 130
