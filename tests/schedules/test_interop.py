"""schedcc.interop.torch: export to torch's action text and CSV, import torch's schedules back."""

from __future__ import annotations

import multiprocessing
import socket
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

import schedcc
from schedcc import DeadlockError, ScheduleConfigError, ScheduleError
from schedcc.interop.torch import (
    format_actions,
    from_torch_actions,
    from_torch_csv,
    to_torch_actions,
    to_torch_csv,
    torch_schedule,
)

SHAPES = [("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-v", 2)]


def _compile(name, p, m, v=1):
    return schedcc.compile(schedcc.get_schedule(name)(p, m, num_chunks=v))


def test_import_does_not_load_torch():
    """Importing schedcc.interop.torch leaves torch unimported (it is loaded lazily)."""
    code = "import sys, schedcc.interop.torch; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_module_name_does_not_shadow_torch():
    """Inside schedcc.interop, `import torch` still finds the real torch package."""
    from schedcc.interop.torch import _torch_class

    assert _torch_class("Schedule1F1B").__module__ == "torch.distributed.pipelining.schedules"


def test_export_text_form():
    """1F1B on 2 stages exports as torch's rank rows, comms and REDUCE_GRAD included."""
    rows = to_torch_actions(_compile("1f1b", 2, 2))
    assert format_actions(rows) == (
        "rank 0: 0F0 0SEND_F0 0F1 0RECV_B0 0SEND_F1 0B0 0RECV_B1 0B1 0REDUCE_GRAD\n"
        "rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1REDUCE_GRAD 1SEND_B1"
    )


@given(
    case=st.sampled_from(SHAPES),
    p=st.integers(1, 4),
    m=st.integers(1, 8),
    comms=st.booleans(),
)
def test_export_import_round_trip(case, p, m, comms):
    """Exporting a program and importing the rows gives back the same per-stage instructions."""
    name, v = case
    program = _compile(name, p, m, v)
    back = from_torch_actions(to_torch_actions(program, comms=comms), m)
    assert back.segment_table() == program.schedule.segment_table()
    again = schedcc.compile(back)
    keep = ("comm", "compute") if comms else ("compute",)
    for mine, theirs in zip(program.stages, again.stages):
        assert [op for op in mine if op.group in keep] == [op for op in theirs if op.group in keep]


@pytest.mark.parametrize(("name", "v"), [("1f1b", 1), ("zb-v", 2), ("interleaved-1f1b", 2)])
def test_torch_validates_the_exported_csv(tmp_path, name, v):
    """torch's own schedule validator accepts schedcc's exported compute-only CSV."""
    from torch.distributed.pipelining.schedules import _validate_schedule

    p, m = 4, 8
    program = _compile(name, p, m, v)
    path = to_torch_csv(program, tmp_path / "schedule.csv", comms=False)
    rows = from_torch_csv(path, m)
    assert rows.num_stages == p
    import csv

    from torch.distributed.pipelining.schedules import _Action

    with path.open() as file:
        actions = {r: [_Action.from_str(a) for a in row] for r, row in enumerate(csv.reader(file))}
    mapping = _validate_schedule(actions, p, p * v, m)
    assert mapping == {k: program.schedule.placement(k)[0] for k in range(p * v)}


@pytest.mark.parametrize(
    ("name", "v"),
    [
        ("ScheduleGPipe", None),
        ("ScheduleInterleaved1F1B", 2),
        ("ScheduleInterleavedZeroBubble", 2),
        ("ScheduleZBVZeroBubble", 2),
        ("ScheduleLoopedBFS", 2),
        ("ScheduleDualPipeV", 2),
    ],
)
def test_torch_builtin_schedules_validate(name, v):
    """torch's built-in schedules, imported unchanged, pass schedcc's validator and simulate."""
    schedule = torch_schedule(name, 4, 8, num_chunks=v)
    timeline = schedcc.simulate(schedcc.compile(schedule))
    assert timeline.makespan > 0
    assert schedule.num_chunks == (v or 1)


def test_torch_comm_order_validates_and_is_timed():
    """torch's own comm lowering of ZBV validates under schedcc's rendezvous model; schedcc's
    comm placement for the same compute order is at least as fast."""
    theirs = schedcc.simulate(schedcc.compile(torch_schedule("ScheduleZBVZeroBubble", 4, 8)))
    with_comms = torch_schedule("ScheduleZBVZeroBubble", 4, 8, comms=True)
    program = schedcc.compile(with_comms)
    assert any(op.group == "comm" for op in program.stages[0])
    assert schedcc.simulate(program).makespan >= theirs.makespan
    with pytest.raises(ScheduleConfigError, match="pipeline_order_with_comms"):
        torch_schedule("Schedule1F1B", 4, 8, comms=True)


def test_torch_1f1b_mislabels_the_last_rank():
    """torch 2.13's Schedule1F1B runs F1..F8 on the last rank for m = 8: schedcc catches it."""
    schedule = torch_schedule("Schedule1F1B", 4, 8)
    forwards = [op.microbatch for op in schedule.order(3) if op.code == "F"]
    if forwards == list(range(8)):
        pytest.skip("this torch labels Schedule1F1B's last rank correctly")
    assert forwards == list(range(1, 9))
    with pytest.raises(ScheduleError, match=r"stage 3.*microbatch 8"):
        schedcc.compile(schedule)


def test_import_reports_bad_input(tmp_path):
    """Unreadable actions, split ranks and unknown names are ScheduleConfigErrors."""
    with pytest.raises(ScheduleConfigError, match="cannot read torch action"):
        from_torch_actions([["0F0", "0X0"]], 1)
    with pytest.raises(ScheduleConfigError, match="appears on ranks"):
        from_torch_actions([["0F0"], ["0B0"]], 1)
    with pytest.raises(ScheduleConfigError, match="same number of segments"):
        from_torch_actions([["0F0", "1F0"], ["2F0"]], 1)
    with pytest.raises(ScheduleConfigError, match="unknown torch schedule"):
        torch_schedule("NoSuchSchedule", 2, 2)
    with pytest.raises(ScheduleConfigError, match="rejects"):
        torch_schedule("Schedule1F1B", 4, 2)
    with pytest.raises(ScheduleConfigError, match="one batch"):
        to_torch_actions(schedcc.compile(schedcc.get_schedule("1f1b")(2, 2, num_batches=2)))


def test_user_csv_deadlock_is_found(tmp_path):
    """A user's CSV whose order waits in a cycle is a DeadlockError naming the stages."""
    path = tmp_path / "order.csv"
    path.write_text("0F0,0F1,0B1,0B0\n1F1,1F0,1B0,1B1\n")
    assert schedcc.compile(from_torch_csv(path, 2)).num_stages == 2  # unusual, but legal
    path.write_text("0F0,0B0,0F1,0B1\n1F1,1F0,1B0,1B1\n")
    with pytest.raises(DeadlockError, match="stage 0"):
        schedcc.compile(from_torch_csv(path, 2))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_torch_runtime_trains_like_schedcc(tmp_path):
    """schedcc's 1F1B and ZB-H1, exported and run by torch's runtime on 2 gloo ranks, train two
    steps to the parameters schedcc's local backend reaches."""
    import torch
    from _interop_worker import run_rank
    from _models import batches, make_segments, mse, sgd

    from schedcc.backends.local import Engine

    m = 4
    programs = {name: _compile(name, 2, m) for name in ("1f1b", "zb-h1")}
    runs = [
        (str(to_torch_csv(program, tmp_path / f"{name}.csv")), str(tmp_path / f"{name}-{{}}.pt"))
        for name, program in programs.items()
    ]
    port = _free_port()
    context = multiprocessing.get_context("spawn")
    procs = [
        context.Process(target=run_rank, args=(r, port, [(c, out.format(r)) for c, out in runs], m))
        for r in range(2)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    assert [proc.exitcode for proc in procs] == [0, 0]

    for (name, program), (_, out) in zip(programs.items(), runs):
        segments = make_segments(2)
        list(Engine(program, segments, mse, sgd).train(batches(2, 2 * m)))
        for rank in range(2):
            theirs = torch.load(out.format(rank))
            for key, mine in segments[rank].state_dict().items():
                torch.testing.assert_close(theirs[key], mine, atol=1e-12, rtol=1e-12, msg=name)


def test_cli_verify_torch_catches_the_mislabel(capsys):
    """`schedcc verify --torch Schedule1F1B -p 4 -m 8` reports the last rank's F1..F8, exit 1."""
    from schedcc.cli import main

    schedule = torch_schedule("Schedule1F1B", 4, 8)
    if [op.microbatch for op in schedule.order(3) if op.code == "F"] == list(range(8)):
        pytest.skip("this torch labels Schedule1F1B's last rank correctly")
    code = main(["verify", "--torch", "Schedule1F1B", "-p", "4", "-m", "8"])
    out = capsys.readouterr().out
    assert code == 1
    assert "rank 3, segment 3: forwards of microbatches 1..8; expected 0..7" in out
    assert "microbatch 8" in out


def test_cli_verify_torch_passes_a_sound_schedule(capsys):
    """`schedcc verify --torch ScheduleZBVZeroBubble` validates, simulates and exits 0."""
    from schedcc.cli import main

    code = main(["verify", "--torch", "ScheduleZBVZeroBubble", "-p", "4", "-m", "8"])
    out = capsys.readouterr().out
    assert code == 0
    assert "pass: schedcc validates torch's order; makespan 51" in out


def test_check_torch_schedule_reports_coverage_and_the_first_error():
    """The library check behind `verify --torch`: rows, coverage lines, error, timeline."""
    from schedcc.interop.torch_check import check_torch_schedule

    report = check_torch_schedule("ScheduleZBVZeroBubble", 4, 8)
    assert report.ok
    assert report.timeline.makespan == 51
    assert report.rows[0][0] == "0F0"
    report = check_torch_schedule("Schedule1F1B", 4, 8)
    if report.ok:
        pytest.skip("this torch labels Schedule1F1B's last rank correctly")
    assert report.coverage == (
        "rank 3, segment 3: forwards of microbatches 1..8; expected 0..7, each once",
    )
    assert isinstance(report.error, ScheduleError)


@pytest.mark.parametrize("name", ["PipelineScheduleSingle", "PipelineScheduleMulti"])
def test_torch_base_classes_are_refused_by_name(name):
    """A base class of torch's schedules is a ScheduleConfigError listing real schedules."""
    with pytest.raises(ScheduleConfigError, match=f"{name} is a base class.*Schedule1F1B"):
        torch_schedule(name, 4, 8)


@pytest.mark.parametrize(("name", "v", "tied"), [("dualpipe", 2, ()), ("1f1b", 1, ((0, 1),))])
def test_copies_torch_cannot_sum_are_refused_unless_the_caller_sums_them(name, v, tied, tmp_path):
    """DualPipe's replicas and a tied head have copies that only ReduceTied keeps equal: torch's
    actions cannot say it, so the export refuses unless the caller sums them itself."""
    program = schedcc.compile(schedcc.get_schedule(name)(2, 4, v), tied=tied)
    with pytest.raises(schedcc.ScheduleConfigError, match="copies would drift apart"):
        to_torch_csv(program, tmp_path / "plan.csv")
    rows = to_torch_actions(program, copies_summed_by_caller=True)
    assert len(rows) == 2
    assert all(row for row in rows)
