"""`schedcc run`'s summary: the simulated bubble is timed the way the engine ran the program."""

from __future__ import annotations

import pytest

import schedcc
from schedcc.backends.run.report import _ran_eagerly, _simulated_bubble


def test_the_simulated_bubble_follows_how_the_sends_ran():
    """Interleaved 1F1B at p = 2 with F = 1, B = 2 measured: over gloo (sends that never wait)
    the bubble is the ideal 1/17; with NCCL's rendezvous batches it is the step model's."""
    program = schedcc.compile(schedcc.get_schedule("interleaved-1f1b")(2, 8, 2))
    measured = list(schedcc.simulate(program, eager=True).events)
    assert _simulated_bubble(program, measured, eager=True) == pytest.approx(1 / 17)
    rendezvous = schedcc.simulate(program).bubble_fraction
    assert _simulated_bubble(program, measured, eager=False) == pytest.approx(rendezvous)
    assert rendezvous > 1 / 17


@pytest.mark.parametrize(
    ("kinds", "eager"),
    [
        (["shared memory", "shared memory"], True),
        (["gloo", "shared memory + gloo"], True),
        (["none"], True),
        (["nccl", "nccl"], False),
    ],
)
def test_only_nccl_runs_are_timed_with_rendezvous_exchanges(kinds, eager):
    assert _ran_eagerly([{"p2p": kind} for kind in kinds]) is eager
