"""`import schedcc` stays light: no torch, and the public names docs/design.md lists are there."""

from __future__ import annotations

import subprocess
import sys

import schedcc

_PROBE = """
import sys
import schedcc
program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4))
schedcc.validate(program)
heavy = sorted(name for name in ("torch", "matplotlib", "numpy") if name in sys.modules)
print(",".join(heavy))
"""


def test_import_does_not_import_torch():
    """Importing schedcc and compiling and validating a schedule never imports torch."""
    result = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    assert "torch" not in result.stdout.strip().split(","), result.stdout


def test_public_names():
    """The top level exports the names docs/design.md promises; `__all__` lists only real names."""
    for name in (
        "Schedule",
        "Forward",
        "Backward",
        "BackwardInput",
        "BackwardWeight",
        "SendActivation",
        "RecvActivation",
        "SendGrad",
        "RecvGrad",
        "ReduceGrads",
        "OptimizerStep",
        "GatherParams",
        "compile",
        "validate",
        "Program",
        "get_schedule",
        "available_schedules",
        "ScheduleError",
        "ScheduleConfigError",
        "UnknownScheduleError",
    ):
        assert name in schedcc.__all__, name
    for name in schedcc.__all__:
        assert hasattr(schedcc, name), name
    assert issubclass(schedcc.ScheduleConfigError, ValueError)
