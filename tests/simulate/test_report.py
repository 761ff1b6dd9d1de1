"""`schedcc run`'s summary: the simulated step and bubble are timed the way the engine ran the
program, under the costs its own events measure."""

from __future__ import annotations

import pytest

import schedcc
from schedcc import CostModel
from schedcc.backends.run.report import _simulated


def test_the_simulated_bubble_is_timed_as_the_engine_runs():
    """Interleaved 1F1B at p = 2 with F = 1, B = 2 measured: every transport posts sends as their
    tensors are made and never waits on them, so the bubble is the ideal 1/17, below the step
    model's rendezvous timing."""
    program = schedcc.compile(schedcc.get_schedule("interleaved-1f1b")(2, 8, 2))
    measured = list(schedcc.simulate(program, eager=True).events)
    assert _simulated(program, measured).bubble_fraction == pytest.approx(1 / 17)
    assert schedcc.simulate(program).bubble_fraction > 1 / 17


@pytest.mark.parametrize(("name", "v"), [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-v", 2)])
def test_the_simulated_step_reads_back_the_run_it_measured(name, v):
    """A run's own events give back its step: each chunk priced at its measured share of the
    stage's costs (`from_trace` reads a stage's costs, the chunks summed), with comm and the
    updates, so a program timed at those costs simulates to the same makespan (in ms: the
    events are in seconds)."""
    costs = CostModel(forward=1.5, backward=2.5, comm=0.25, step=0.5, norm=0.25,
                      per_stage={1: CostModel(forward=2.0, backward=3.0, comm=0.25, step=0.5,
                                              norm=0.25)})  # fmt: skip
    program = schedcc.compile(schedcc.get_schedule(name)(2, 8, v), grad_norm=True)
    ran = schedcc.simulate(program, costs, eager=True)
    assert _simulated(program, list(ran.events)).makespan == pytest.approx(ran.makespan * 1e3)


def test_the_simulated_step_reads_dualpipe_s_replicas_and_pairs_as_measured():
    """DualPipe holds a chunk of each model replica per stage and runs overlapped pairs: its
    measured events (a pair timed as a marker of its forward and the whole pair, the halves in
    order on the CPU) give back its step, each replica's chunk at its own costs."""
    from schedcc.ir import Forward, OverlappedBackward

    costs = CostModel(forward=1.5, backward=2.5, comm=0.25, overlap=1.0)
    program = schedcc.compile(schedcc.get_schedule("dualpipe")(2, 8, 2))
    ran = schedcc.simulate(program, costs, eager=True)
    assert any(isinstance(e.instruction, OverlappedBackward) for e in ran.events)
    measured, pair_start = [], None
    events = sorted(ran.events, key=lambda e: (e.stage, e.start, e.end))
    for event, after in zip(events, [*events[1:], None]):
        if pair_start is not None:  # a pair's backward: the whole pair
            measured.append(event._replace(start=pair_start))
            pair_start = None
        elif (
            isinstance(event.instruction, Forward)
            and after is not None
            and isinstance(after.instruction, OverlappedBackward)
            and after.stage == event.stage
            and after.start == pytest.approx(event.end)
        ):  # a pair's forward: a marker
            measured.append(event._replace(end=event.start))
            pair_start = event.start
        else:
            measured.append(event)
    assert _simulated(program, measured).makespan == pytest.approx(ran.makespan * 1e3)


def test_the_simulated_step_reads_back_the_warm_up_of_each_run():
    """A stage's first forward and backward of each step take longer ([Note: a step's first
    computes]): the summary lays the steady runs one after another, so `from_trace` splits each
    stage's at its steps and takes the median first compute's excess over the runs; laid over
    each other from time 0, it would read one first compute of the three."""
    from schedcc.backends.run.report import _one_after_another

    def ran(warm: float):
        costs = CostModel(forward=1.5, backward=2.5, comm=0.25, step=0.5, per_stage={
            1: CostModel(forward=2.0, backward=3.0, comm=0.25, step=0.5, warmup_forward=warm,
                         warmup_backward=warm / 2)})  # fmt: skip
        return schedcc.simulate(program, costs, eager=True)

    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 8))
    runs = [list(ran(warm).events) for warm in (3.0, 1.0, 1.0)]
    laid = _one_after_another(runs)
    second = laid[len(runs[0]) : 2 * len(runs[0])]
    assert [e.start for e in second] == [e.start + ran(3.0).makespan for e in runs[1]]
    assert _simulated(program, laid).makespan == pytest.approx(ran(1.0).makespan * 1e3)
    overlaid = [e for run in runs for e in run]
    assert _simulated(program, overlaid).makespan > ran(1.0).makespan * 1e3 + 1.0


def test_the_simulated_step_reads_each_receive_s_take_and_compute_s_own_time():
    """The summary reads the run's events as the trace `--trace` writes of them, each with its
    fifth element: a receive's take ([Note: a receive's take] in `schedcc.costs`) and a
    compute's own time ([Note: a compute's fixed time]). With them its step is the one
    `--costs-from` that trace simulates, and each take priced makes it longer."""
    from schedcc.draw.chrome import chrome_trace
    from schedcc.ir import COMPUTE, RECEIVES
    from schedcc.tune import priced

    schedule = schedcc.get_schedule("interleaved-1f1b")(2, 8, 2)
    program = schedcc.compile(schedule)
    ran = schedcc.simulate(program, CostModel(forward=1.5, backward=2.5, comm=0.25), eager=True)
    def own_time(e) -> float | None:
        if isinstance(e.instruction, RECEIVES):
            return 0.05
        return 0.9 * (e.end - e.start) if isinstance(e.instruction, COMPUTE) else None

    own = [(*e, own_time(e)) for e in ran.events]
    read = CostModel.from_trace(chrome_trace(own, unit_us=1e6))
    assert read.at(1).receive == pytest.approx(50.0)
    assert read.at(1).fixed_forward == pytest.approx(150.0)
    want = schedcc.simulate(program, priced(read, schedule), eager=True).makespan
    assert _simulated(program, own).makespan == pytest.approx(want)
    assert want > _simulated(program, list(ran.events)).makespan + 50.0
