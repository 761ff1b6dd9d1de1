"""`schedcc tune`: ranks schedules over shapes, honours the memory limit, speaks JSON."""

from __future__ import annotations

import json

import attrs
import pytest

from schedcc import CostModel, get_schedule, tune
from schedcc.cli import main

USER_SCHEDULE = """
from schedcc import Schedule, Forward, Backward

class AllForwardsFirst(Schedule):
    name = "all-forwards-first"

    def order(self, stage):
        yield from (Forward(i) for i in range(self.num_microbatches))
        yield from (Backward(i) for i in range(self.num_microbatches))
"""


def _json(capsys, *argv):
    code = main(["tune", *argv, "--format", "json"])
    return code, json.loads(capsys.readouterr().out)


def test_ranks_every_registered_schedule(capsys):
    """Every registered schedule appears once per shape it accepts, fastest per microbatch first;
    with no -v each is tried at the first two of its own chunks (zb-v at 2 only, never 1)."""
    code, report = _json(capsys, "-p", "4", "-m", "8,16")
    assert code == 0
    names = {row["schedule"] for row in report["ranked"]}
    assert {"gpipe", "1f1b", "zb-h1", "zb-v"} <= names
    assert "pipedream-flush" not in names  # aliases are not listed twice
    times = [row["time_per_microbatch"] for row in report["ranked"]]
    assert times == sorted(times)
    tried = {(row["schedule"], row["num_chunks"]) for row in report["ranked"] + report["skipped"]}
    assert {("zb-v", 2), ("1f1b", 1), ("interleaved-1f1b", 1), ("interleaved-1f1b", 2)} <= tried
    assert ("zb-v", 1) not in tried
    assert ("1f1b", 2) not in tried


def test_zero_bubble_beats_1f1b_at_equal_memory(capsys):
    """With F = I = W = 1 and a memory limit of p, ZB-V then ZB-H1 rank above 1F1B."""
    limit = ["--memory-limit", "4", "--costs", "F=1,B=2,I=1,W=1"]
    code, report = _json(capsys, "-p", "4", "-m", "8", *limit)
    assert code == 0
    order = [row["schedule"] for row in report["ranked"]]
    assert order.index("zb-v") < order.index("zb-h1") < order.index("1f1b")
    assert all(row["peak_activations"] <= 4 for row in report["ranked"])
    assert {row["schedule"] for row in report["over_limit"]} >= {"gpipe"}


def test_eager_times_every_program_as_the_engine_runs_it(capsys):
    """`--eager`: interleaved 1F1B at p = 2, m = 8, v = 2 takes the ideal 25.5 (sends that never
    wait) where the rendezvous model takes 28.5, and the JSON says which timeline it is."""
    argv = ("-p", "2", "-m", "8", "-v", "2", "--schedule", "interleaved-1f1b")
    _, eager = _json(capsys, *argv, "--eager")
    _, rendezvous = _json(capsys, *argv)
    assert eager["eager"] is True
    assert rendezvous["eager"] is False
    def interleaved(report) -> list[float]:
        return [r["makespan"] for r in report["ranked"] if r["schedule"] == "interleaved-1f1b"]

    assert interleaved(eager) == [25.5]
    assert interleaved(rendezvous) == [28.5]
    assert main(["tune", *argv, "--eager"]) == 0
    assert "makespan (eager)" in capsys.readouterr().out


def test_memory_limit_drops_programs(capsys):
    """A limit below every program's peak leaves nothing ranked and exits 1 with a message."""
    code = main(["tune", "-p", "4", "-m", "8", "--memory-limit", "1"])
    out = capsys.readouterr().out
    assert code == 1
    assert "no schedule fits" in out
    assert "over the memory limit" in out


def test_table_lists_per_stage_numbers(capsys):
    """The table has one row per program with activations and weight versions per stage."""
    code = main(["tune", "-p", "2", "-m", "4", "-v", "1"])
    out = capsys.readouterr().out
    assert code == 0
    header, *rows = out.splitlines()
    assert "act per stage" in header
    assert "versions per stage" in header
    onefonebee = next(row for row in rows if " 1f1b " in row)
    assert "2 1" in onefonebee  # 1F1B's peak activations per stage for p = 2


def test_user_schedule_is_ranked(tmp_path, capsys):
    """A --schedule file:Class joins the ranking under the name it was given."""
    path = tmp_path / "mine.py"
    path.write_text(USER_SCHEDULE)
    spec = f"{path}:AllForwardsFirst"
    code, report = _json(capsys, "-p", "2", "-m", "4", "--schedule", spec)
    assert code == 0
    assert spec in {row["schedule"] for row in report["ranked"]}


def test_costs_from_trace(tmp_path, capsys):
    """--costs-from reads measured durations: every compute 1/100 of the default scales every
    makespan by 1/100."""
    events = [
        {"name": name, "ph": "X", "ts": 0, "dur": dur, "pid": 0, "tid": stage}
        for stage in range(2)
        for name, dur in [("F0", 10), ("B0", 20), ("I0", 10), ("W0", 10)]
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(events))
    _, measured = _json(capsys, "-p", "2", "-m", "4", "--costs-from", str(path))
    _, unit = _json(capsys, "-p", "2", "-m", "4")
    mine = {(r["schedule"], r["num_chunks"]): r["makespan"] for r in measured["ranked"]}
    base = {(r["schedule"], r["num_chunks"]): r["makespan"] for r in unit["ranked"]}
    assert mine.keys() == base.keys()
    assert [mine[key] / base[key] for key in base] == pytest.approx([0.01] * len(base))


def test_costs_fill_only_the_kinds_a_trace_lacks(tmp_path):
    """`--costs comm=0.05` beside `--costs-from` gives comm alone: what the trace reads beyond
    its medians stays its own (a stage's first forward, I and W off its whole backward, a
    compute's fixed part, the CPU's overlap)."""
    from schedcc.cli import build_parser
    from schedcc.cli.tune import costs_of

    timed = [("F0", 0, 1500, 1400), ("F1", 2, 1000, 900), ("B0", 3, 2000, 1800), ("Step", 5, 1, 0)]
    events = [
        {"name": name, "ph": "X", "ts": ts, "dur": dur, "pid": 0, "tid": stage,
         "args": {"segment_us": own} if own else {}}
        for stage in range(2)
        for name, ts, dur, own in timed
    ]  # fmt: skip
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events, "otherData": {"device": "cpu"}}))
    argv = ["tune", "-p", "2", "--costs-from", str(path), "--costs", "comm=0.05"]
    got = costs_of(build_parser().parse_args(argv))
    want = CostModel.from_trace(path, num_stages=2, comm=0.05)
    assert got == want
    assert (got.at(1).comm, got.overlap, got.at(1).warmup_forward) == (0.05, 1.0, 0.25)
    assert got.at(1).fixed_forward == pytest.approx(0.1)
    assert got.at(1).backward_input == pytest.approx((2.0 - 0.2) / 2 + 0.2)


def test_segment_costs_price_each_segment_where_it_lies(capsys):
    """`--segment-costs` gives each segment's costs ([Note: segment costs]): every row is timed
    as the library times its program under them; four segments price v = 2 orders segment by
    segment (a V holds the heavy last on stage 0) and v = 1 orders with them summed; two
    segments price v = 2 orders from each stage's divided among its chunks (DualPipe's replicas
    of a cut in p segment by segment); a malformed one, or one beside --costs-from, is one
    line, exit 2."""
    base = CostModel(backward=2, comm=0.1)
    for given, segments in (
        (";;;F=2.5,B=5", [base] * 3 + [CostModel(forward=2.5, backward=5, comm=0.1)]),
        ("F=1;F=3", [base, CostModel(forward=3, comm=0.1)]),
    ):
        code, out = _json(capsys, "-p", "2", "-m", "4", "-v", "1,2", "--costs", "B=2,comm=0.1",
                          "--segment-costs", given)  # fmt: skip
        assert code == 0
        rows = {(r["schedule"], r["num_chunks"]): r["makespan"] for r in out["ranked"]}
        assert ("zb-v", 2) in rows
        assert ("1f1b", 1) in rows
        costs = CostModel(backward=2, comm=0.1, per_segment=segments)
        if len(segments) == 2:  # a cut in p: v = 2 rows but DualPipe's read the stage costs
            costs = attrs.evolve(costs, per_stage=dict(enumerate(segments)))
        for (name, v), makespan in rows.items():
            expected = tune([name], num_stages=2, num_microbatches=4, num_chunks=v, costs=costs)
            assert makespan in [c.makespan for c in expected.ranked], (name, v)
    v_shape = rows[("zb-v", 2)]
    assert v_shape != _json(capsys, "-p", "2", "-m", "4", "-v", "2", "--costs", "B=2,comm=0.1",
                            "--segment-costs", "F=3;F=1")[1]["ranked"][0]["makespan"]  # fmt: skip
    for bad in (
        ["--segment-costs", "F=x;"],
        ["--segment-costs", "F=1;;", "-v", "1,2"],  # 3 segments: no cut of 2 stages
        ["--segment-costs", "F=1;", "--costs-from", "t.json"],
    ):
        try:
            code = main(["tune", "-p", "2", "-m", "4", *bad])
        except SystemExit as exc:  # argparse's own refusal
            code = exc.code
        assert code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1
        assert "--segment-costs" in err[0]


def test_a_trace_of_another_depth_is_one_line(tmp_path, capsys):
    """`tune`, `search` and `run --schedule search` with a trace of 2 stages at -p 3: one line
    naming the stages measured, exit 2 (its stages' costs are for another cut)."""
    events = [
        {"name": name, "ph": "X", "ts": 0, "dur": 10, "pid": 0, "tid": stage}
        for stage in range(2)
        for name in ("F0", "B0")
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(events))
    closed_loop = ["run", "--schedule", "search", "--model", "mlp"]
    for command in (["tune"], ["search", "-m", "4"], closed_loop):
        assert main([*command, "-p", "3", "--costs-from", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1
        assert "measured stages [0, 1], not the 3 of this pipeline" in err[0]


def _cut(tmp_path, calls: int):
    """A trace of 2 stages, each running its share (F 2, B 4 ms) as `calls` chunks that cost
    0.3 ms more each whatever the chunk ([Note: a compute's per-call time])."""
    events = [
        {"name": f"{code}{i}{'' if c == 0 else f'.{c}'}", "ph": "X", "ts": 0, "pid": 0,
         "tid": stage, "dur": (share / calls + 0.3) * 1000}
        for stage in range(2)
        for c in range(calls)
        for code, share in (("F", 2.0), ("B", 4.0))
        for i in range(2)
    ]  # fmt: skip
    path = tmp_path / f"v{calls}.json"
    path.write_text(json.dumps(events))
    return path


def test_other_cut_prices_each_cut_with_the_per_call_part(tmp_path, capsys):
    """`--other-cut` beside `--costs-from`: tune and search price what the two cuts measured
    (interleaved 1F1B at v = 2 as its chunks ran), not the v = 1 trace divided; alone, or at
    the trace's own cut, one line and exit 2."""
    one, two = _cut(tmp_path, 1), _cut(tmp_path, 2)
    shape = ["-p", "2", "-m", "4", "-v", "2"]
    both, alone = (
        next(
            row["makespan"]
            for row in _json(capsys, *shape, "--costs-from", str(one), *more)[1]["ranked"]
            if row["schedule"] == "interleaved-1f1b"
        )
        for more in (["--other-cut", str(two)], [])
    )
    costs = CostModel(forward=2.3, backward=4.3, fixed_forward=0.3, fixed_backward=0.3)
    (want,) = tune(["interleaved-1f1b"], num_stages=2, num_microbatches=4, num_chunks=2,
                   costs=costs).ranked  # fmt: skip
    assert both == pytest.approx(want.makespan)
    assert alone < want.makespan
    for argv, says in (
        (["--other-cut", str(two)], "--other-cut goes with --costs-from"),
        (["--costs-from", str(one), "--other-cut", str(one)], "another v"),
    ):
        for command in (["tune"], ["search"]):
            assert main([*command, "-p", "2", "-m", "4", *argv]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1
            assert says in err[0]


def test_chunks_share_the_stage_cost():
    """A chunk costs 1/v of a stage: interleaved 1F1B does the same work as 1F1B per stage."""
    schedules = {"interleaved-1f1b": get_schedule("interleaved-1f1b")}
    result = tune(schedules, num_stages=2, num_microbatches=4, num_chunks=2, costs=CostModel())
    (row,) = result.ranked
    assert row.makespan * (1 - row.bubble) == pytest.approx(12.0, rel=1e-3)


@pytest.mark.parametrize(
    "argv",
    [
        ["tune"],
        ["tune", "-p", "0"],
        ["tune", "-p", "2", "-m", "8,x"],
        ["tune", "-p", "2", "--memory-limit", "-1"],
        ["tune", "-p", "2", "--costs", "F=fast"],
        ["tune", "-p", "2", "--schedule", "no-such-schedule"],
        ["tune", "-p", "2", "--costs-from", "/no/such/trace.json"],
    ],
)
def test_bad_input_is_one_line(argv, capsys):
    """Each bad argument is one readable line on stderr and exit status 2, no traceback."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors exit from inside main
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("schedcc tune: error:")
    assert len(err.splitlines()) == 1
