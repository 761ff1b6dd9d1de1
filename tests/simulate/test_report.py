"""`schedcc run`'s summary: the simulated bubble is timed the way the engine ran the program."""

from __future__ import annotations

import pytest

import schedcc
from schedcc.backends.run.report import _simulated_bubble


def test_the_simulated_bubble_is_timed_as_the_engine_runs():
    """Interleaved 1F1B at p = 2 with F = 1, B = 2 measured: every transport posts sends as their
    tensors are made and never waits on them, so the bubble is the ideal 1/17, below the step
    model's rendezvous timing."""
    program = schedcc.compile(schedcc.get_schedule("interleaved-1f1b")(2, 8, 2))
    measured = list(schedcc.simulate(program, eager=True).events)
    assert _simulated_bubble(program, measured) == pytest.approx(1 / 17)
    assert schedcc.simulate(program).bubble_fraction > 1 / 17
