"""`schedcc search`: the found order against every built-in, its bound and drawing, the file it
writes (that `verify` and `show` take), and one-line errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

import schedcc
from schedcc import CostModel, get_schedule
from schedcc.cli import main
from schedcc.cli.args import parse_costs
from schedcc.cli.search import _bounds_line
from schedcc.costs import measured_backward
from schedcc.search import FoundOrder, _splits, search
from schedcc.sizes import parse_size
from schedcc.tune import _per_chunk


def test_prints_the_found_order_its_ranking_and_drawing_and_writes_the_file(tmp_path, capsys):
    """The first line names the makespan and the bound, the ranking lists the found order and
    the built-ins, the drawing has a row per stage; `--out` writes a file `verify` passes and
    `show` draws at its own shape."""
    out = tmp_path / "my_order.py"
    argv = ["search", "-p", "3", "-m", "4", "--memory-limit", "2", "--recompute"]
    assert main([*argv, "--time-limit", "3", "--out", str(out), "--class-name", "Mine"]) == 0
    text = capsys.readouterr().out
    first, second = text.splitlines()[:2]
    assert first.startswith("found: p=3 m=4")
    bound = re.search(r"lower bound ([0-9.]+) ", first).group(1)
    assert second.startswith("lower bound by layout: ")
    assert second.split(", ")[0].endswith(f" {bound}")  # the least first: the bound
    assert "(found)" in text
    assert "1f1b" in text
    assert "stage 2 |" in text
    assert f"{out}:Mine" in text
    cls = get_schedule(f"{out}:Mine")
    assert issubclass(cls, FoundOrder)
    p, m, v = cls.shape
    verify = ["verify", "--schedule", f"{out}:Mine", "-p", str(p), "-m", str(m), "-v", str(v)]
    assert main(verify) == 0
    capsys.readouterr()
    assert main(["show", "--schedule", f"{out}:Mine"]) == 0  # its own shape, -p -m -v left out
    assert "stage 2 |" in capsys.readouterr().out


def test_where_the_bound_is_of_pairs_it_says_what_no_order_without_them_beats():
    """p = 4, m = 8, 1:2:1, a 1.5x last stage, 1F1B's activations: the least bound is of
    DualPipe's layout in overlapped pairs, and the line of bounds and the written file's
    docstring name the least of the layouts without pairs as what no order without them
    beats (`SearchResult.without_pairs`)."""
    heavy = CostModel(forward=1.5, backward=3.0, backward_input=1.5, backward_weight=1.5)
    result = search(4, 8, costs=CostModel(per_stage={3: heavy}), memory_limit=4, recompute=True,
                    max_evaluations=30, eager=True)  # fmt: skip
    alone = min(b.bound for b in result.layout_bounds if not b.pairs)
    assert result.without_pairs == alone > result.bound
    line = _bounds_line(result)
    assert line.startswith("lower bound by layout: two replicas v=2 ")
    assert line.endswith(f"; without overlapped pairs no order beats {alone:g}")
    assert f"above it; no order without overlapped pairs beats {alone:g}); " in result.to_python()


def test_eager_searches_times_and_ranks_as_the_engine_runs(tmp_path, capsys):
    """`--eager`: the found line says so and gives the eager makespan and bound (the order's
    eager timeline, which the written file's docstring names), and the ranking times every
    built-in eagerly (its makespan column says so)."""
    out = tmp_path / "eager.py"
    argv = ["search", "-p", "2", "-m", "8", "-v", "2", "--placement", "looped", "--costs",
            "F=1,B=2,comm=0.2", "--method", "heuristic", "--time-limit", "2"]  # fmt: skip
    argv.append("--eager")
    assert main([*argv, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    first = text.splitlines()[0]
    made = float(re.search(r"makespan \(eager\) ([0-9.]+),", first).group(1))
    cls = get_schedule(f"{out}:Found")
    costs = _per_chunk(parse_costs("F=1,B=2,comm=0.2"), 2)  # what --costs says, per chunk
    program = schedcc.compile(cls(2, 8, 2))
    assert made == pytest.approx(schedcc.simulate(program, costs, eager=True).makespan, abs=1e-4)
    assert made < schedcc.simulate(program, costs).makespan  # rendezvous waits for partners
    assert "makespan (eager)" in text
    written = out.read_text()
    assert "Simulated makespan (eager: sends that never wait)" in written
    assert "schedcc show --schedule THIS_FILE.py:Found --eager" in written
    show = ["show", "--schedule", f"{out}:Found", "--eager", "--costs"]
    assert main([*show, "F=0.5,B=1,I=0.5,W=0.5,comm=0.2"]) == 0  # show's costs: per chunk
    assert capsys.readouterr().out.splitlines()[-1].startswith(f"makespan {made:g},")


def test_offload_places_copies_the_written_file_keeps(tmp_path, capsys):
    """`--offload` at one microbatch a stage without recomputation, two chunks a stage: the
    found order offloads (priced copies), fits, and the file it writes replays its copies and
    passes `verify`."""
    out = tmp_path / "offloaded.py"
    argv = ["search", "-p", "4", "-m", "8", "-v", "2", "--costs", "F=1,B=2,O=0.5,L=0.5"]
    argv += ["--memory-limit", "1", "--offload", "--method", "heuristic", "--time-limit", "3"]
    assert main([*argv, "--out", str(out)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "offload" in first.split("from ")[-1]
    assert "peak activations per stage [1 1 1 1]" in first
    cls = get_schedule(f"{out}:Found")
    assert any(text[0] == "O" for row in cls.orders for text in row.split())
    assert main(["verify", "--schedule", f"{out}:Found", "-p", "4", "-m", "8", "-v", "2"]) == 0


def test_the_found_file_ranks_in_tune(tmp_path, capsys):
    """`tune --schedule FILE:Found` ranks the written order with the built-ins."""
    out = tmp_path / "found.py"
    assert (
        main(["search", "-p", "2", "-m", "4", "-v", "1", "--time-limit", "2", "--out", str(out)])
        == 0
    )
    capsys.readouterr()
    code = main(
        ["tune", "-p", "2", "-m", "4", "-v", "1", "--schedule", f"{out}:Found", "--format", "json"]
    )
    assert code == 0
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    assert any(row["schedule"] == f"{out}:Found" for row in ranked)


def test_prove_is_the_searchs_and_its_bound_says_so(monkeypatch, capsys):
    """`--prove S` reaches `search(..., prove=S)`, and the found line names the bound's source
    (the relaxation's value itself: tests/simulate/test_search_relax.py)."""
    import schedcc.cli.search as cli_search

    seen = {}

    def spy(*args, **kwargs):
        seen.update(kwargs)
        result = search(*args, **kwargs)
        return attrs.evolve(result, bound_from="relaxation")

    monkeypatch.setattr(cli_search, "search", spy)
    argv = ["search", "-p", "2", "-m", "2", "-v", "1", "--time-limit", "1", "--prove", "0.5"]
    assert main(argv) == 0
    assert seen["prove"] == 0.5
    assert "(relaxation;" in capsys.readouterr().out.splitlines()[0]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["-p", "3", "-m", "4", "--memory-limit", "0.1"], "no order for p=3, m=4 fits"),
        (["-p", "3", "-m", "4", "--offload"], "--offload goes with --memory-limit"),
        (["-p", "3", "-m", "4", "-v", "1", "--placement", "v"], "V placement (a wave) needs"),
        (["-p", "3", "-m", "4", "--memory-limit", "1GiB"], "--memory-limit 1GiB is in bytes"),
        (["-p", "3", "-m", "4", "--class-name", "not a name"], "--class-name"),
        (["-p", "3", "-m", "4", "--time-limit", "0"], "time_limit"),
        (["-p", "3", "-m", "4", "--prove", "-1"], "prove must be seconds >= 0"),
        (["-p", "3", "-m", "4", "--out", "/no-such-folder/found.py"], "does not exist"),
        (["-p", "3", "-m", "4", "--out", "."], "is a directory; give a file name"),
    ],
)
def test_bad_input_is_one_line(argv, says, capsys):
    """Each mistake exits 2 with one line on stderr that says what to change."""
    assert main(["search", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert says in err


def test_costs_from_a_trace_of_a_slow_last_stage(tmp_path, capsys):
    """`--costs-from` reads a measured trace per stage (`CostModel.from_trace`): the bound it
    prints is that of the measured costs, above the balanced one (the slow last stage shows)."""
    slow = CostModel(forward=2.0, backward=4.0, backward_input=2.0, backward_weight=2.0)
    trace = tmp_path / "run.json"
    program = schedcc.compile(get_schedule("1f1b")(3, 4))
    schedcc.simulate(program, CostModel(per_stage={2: slow})).to_chrome_trace(trace)
    argv = ["search", "-p", "3", "-m", "4", "-v", "1", "--backward", "B", "--time-limit", "2"]
    assert main([*argv, "--costs-from", str(trace)]) == 0
    first = capsys.readouterr().out.splitlines()[0]

    def bound(costs):
        return search(
            3, 4, num_chunks=1, split_backward=False, costs=costs, max_evaluations=1
        ).bound

    measured = bound(CostModel.from_trace(trace))
    assert f"lower bound {measured:g} " in first
    assert measured > bound(CostModel())


def test_costs_from_a_trace_search_the_backward_forms_it_measured(tmp_path, capsys):
    """`--costs-from` a trace of F/B orders searches F/B orders only ([Note: a trace's backward
    both ways]: I and W read off B are a guess, an optimistic one), one of F/I/W orders both
    forms (B read as I + W is the pessimistic side), here F/I/W as the faster;
    `--backward both` searches both, where F/I/W orders simulate faster, and says that their
    costs are a guess, as `tune` does."""
    for name, split in (("1f1b", False), ("zb-h1", True)):
        trace = tmp_path / f"{name}.json"
        program = schedcc.compile(get_schedule(name)(3, 6))
        schedcc.simulate(program, CostModel(comm=0.1)).to_chrome_trace(trace)
        assert measured_backward(trace) == ((False,) if name == "1f1b" else (False, True))
        argv = ["search", "-p", "3", "-m", "6", "-v", "1", "--costs-from", str(trace)]
        out = tmp_path / f"found_{name.replace('-', '_')}.py"
        assert main([*argv, "--time-limit", "1", "--method", "heuristic", "--out", str(out)]) == 0
        capsys.readouterr()
        found = get_schedule(f"{out}:Found")
        assert _splits(found.orders) == split
    assert main([*argv[:-2], "--costs-from", str(tmp_path / "1f1b.json"), "--backward", "both",
                 "--time-limit", "1", "--method", "heuristic"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert " I0 " in out  # the drawing of an F/I/W order
    assert "measured whole backwards only: I and W are read as B / 2" in out
    for name, guessed in (("1f1b", True), ("zb-h1", False)):  # tune says so too
        assert main(["tune", *argv[1:-2], "--costs-from", str(tmp_path / f"{name}.json")]) == 0
        assert ("measured whole backwards only" in capsys.readouterr().out) == guessed
    assert measured_backward([]) == (False, True)  # nothing measured: both


def test_orders_finer_than_the_traces_cut_are_said_to_be_priced_by_stage(tmp_path, capsys):
    """A trace of a run at v = 1 measures no segment of a cut in 2p: `tune` and `search` say
    which rows are priced from stage costs divided among chunks ([Note: segment costs]); a
    trace at v = 2 prices both v = 1 and v = 2 per segment and no line is printed."""
    finer = "priced segment by segment, those at more chunks a stage"
    for name, v, said in (("1f1b", 1, True), ("interleaved-1f1b", 2, False)):
        trace = tmp_path / f"{name}.json"
        program = schedcc.compile(get_schedule(name)(2, 4, v))
        schedcc.simulate(program).to_chrome_trace(trace)
        shape = ["-p", "2", "-m", "4", "--costs-from", str(trace)]
        assert main(["tune", *shape, "-v", "1,2"]) == 0
        assert (finer in capsys.readouterr().out) == said
        assert main(["search", *shape, "-v", "1,2", "--time-limit", "1"]) == 0
        assert (finer in capsys.readouterr().out) == said
    at_one = ["-p", "2", "-m", "4", "-v", "1", "--costs-from", str(tmp_path / "1f1b.json")]
    assert main(["tune", *at_one]) == 0
    assert finer not in capsys.readouterr().out  # every row at the trace's cut


def test_segment_costs_search_as_the_library_prices_them(tmp_path, capsys):
    """`search --segment-costs`: the found V order's makespan is its simulated one under those
    segment costs (the heavy last segment on stage 0), as the line prints it."""
    out = tmp_path / "found.py"
    argv = ["search", "-p", "2", "-m", "4", "-v", "2", "--placement", "v", "--costs",
            "B=2,comm=0.1", "--segment-costs", ";;;F=2.5,B=5", "--time-limit", "1",
            "--method", "heuristic", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    line = capsys.readouterr().out.splitlines()[0]
    found = get_schedule(f"{out}:Found")
    segments = [CostModel(comm=0.1)] * 3 + [CostModel(forward=2.5, backward=5, comm=0.1)]
    costs = CostModel(comm=0.1, per_segment=segments)
    makespan = schedcc.simulate(schedcc.compile(found(2, 4, 2)), costs).makespan
    assert line.startswith("found: p=2 m=4 v=2 (V), makespan ")
    assert f"makespan {makespan:g}," in line


def test_run_trains_the_written_file_exactly(tmp_path, capsys):
    """`schedcc run --schedule FILE:Found` trains the found order on two processes (gloo), at
    its own shape when `-p`, `-m` and `-v` are left out, and `--check` finds it equal to
    non-pipelined training."""
    out = tmp_path / "found.py"
    assert main(["search", "-p", "2", "-m", "4", "--time-limit", "3", "--out", str(out)]) == 0
    capsys.readouterr()
    argv = ["--schedule", f"{out}:Found", "--steps", "3"]
    argv += ["--check", "--model", "mlp", "--p2p", "gloo"]
    result = subprocess.run(
        [sys.executable, "-m", "schedcc", "run", "--no-progress", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert "Found(p=2, m=4" in result.stdout
    assert ": ok" in result.stdout


def _schedcc_run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "schedcc", "run", "--no-progress", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def test_run_searches_for_the_costs_of_a_first_run(tmp_path):
    """The closed loop: a first run's trace in, `--schedule search --costs-from` searches for
    its measured costs within a limit (in microbatches, recomputing or offloading; in the bytes
    the trace records), prints the simulated step, and trains the found order exactly, its
    measured peak activations within the byte limit. The first run is interleaved (v = 2): its
    trace records the cut, and the search in bytes finds an order of that cut, of the backward
    form the trace measured (whole). Beside a run at v = 1 (`--other-cut`), the search prices
    each compute's per-call part."""
    trace = tmp_path / "first.json"
    first = _schedcc_run(
        "--schedule", "interleaved-1f1b", "-v", "2", "--steps", "2", "--model", "mlp",
        "--trace", str(trace), "--check",
    )  # fmt: skip
    assert first.returncode == 0, first.stderr
    recorded = json.loads(trace.read_text())["otherData"]
    assert recorded["cut"] == {
        "num_stages": 2, "num_chunks": 2, "num_replicas": 1, "segments": [[0, 2], [1, 3]],
    }  # fmt: skip
    assert len(CostModel.from_trace(trace).per_segment) == 4  # each segment's own costs
    assert recorded["updates"] == {"tied": [], "grad_norm": True}  # what its program compiled
    at_one = tmp_path / "1f1b.json"  # the same model at v = 1: each compute's per-call part
    at_v1 = ["--steps", "2", "--model", "mlp", "--check", "--trace", str(at_one)]  # as trained
    assert _schedcc_run(*at_v1).returncode == 0
    limited = _schedcc_run(  # within one microbatch a stage
        "--schedule", "search", "--costs-from", str(trace), "--other-cut", str(at_one),
        "--search-time", "1", "--search-memory-limit", "1", "--search-offload", "--steps", "2",
        "--model", "mlp", "--check",
    )  # fmt: skip
    assert limited.returncode == 0, limited.stderr
    assert f"under the costs measured in {trace} and {at_one}" in limited.stdout
    assert re.search(r"search: simulated step [0-9.]+ ms, eagerly as the engine runs \(lower bound",
                     limited.stdout)
    assert "within 1 microbatches a stage" in limited.stdout
    assert "Found(p=2, m=8" in limited.stdout
    assert ": ok" in limited.stdout
    # in bytes: the first run's trace records one microbatch's per segment (float64, as --check
    # trains), and the run's own peak rows (measured) keep to the limit where the first run's
    # were over: a quarter more than a stage's two segments of one microbatch
    sizes = recorded["memory"]["activations"]
    limit = int(1.25 * max(sizes[0] + sizes[2], sizes[1] + sizes[3]))
    in_bytes = _schedcc_run(
        "--schedule", "search", "--costs-from", str(trace), "--search-time", "1",
        "--search-memory-limit", f"{limit}B", "--search-offload", "--steps", "2",
        "--model", "mlp", "--check",
    )  # fmt: skip
    assert in_bytes.returncode == 0, in_bytes.stderr
    assert f"within {limit}B of activations a stage" in in_bytes.stdout
    assert "Found(p=2, m=8, v=2)" in in_bytes.stdout  # the cut the bytes were measured on
    path = re.search(r"the order is (\S+):Found", in_bytes.stdout).group(1)
    assert not _splits(get_schedule(f"{path}:Found").orders)  # the trace measured whole B only
    assert ": ok" in in_bytes.stdout
    assert max(_peaks(first.stdout)) > limit
    assert 0 < max(_peaks(in_bytes.stdout)) <= limit


def test_run_searches_after_first_runs_of_its_own(tmp_path, monkeypatch):
    """`--schedule search` without `--costs-from`: a first run at each cut searched, the finer
    first, traced to a temporary folder; the search prices the finer run's costs with the
    coarser as its other cut, and the order found trains exactly; at one cut, within bytes its
    own first run measured."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    found = _schedcc_run(
        "--schedule", "search", "--search-time", "1", "--search-memory-limit", "1", "--steps",
        "2", "--model", "mlp", "--check",
    )  # fmt: skip
    assert found.returncode == 0, found.stderr
    runs = re.findall(r"search: a first run, (\S+) at v = (\d), 12 steps, traced to (\S+)",
                      found.stdout)  # fmt: skip
    assert [(name, v) for name, v, _ in runs] == [("interleaved-1f1b", "2"), ("1f1b", "1")]
    finer, coarser = (trace for _, _, trace in runs)
    assert Path(finer).parent == Path(coarser).parent  # one folder, in the temporary one
    assert Path(finer).parent.parent == tmp_path
    assert f"under the costs measured in {finer} and {coarser}" in found.stdout
    assert CostModel.from_trace(finer, other_cuts=[coarser]).at(0).fixed_forward > 0
    assert found.stdout.count(": ok") == 3  # the first runs and the found order, exactly
    one = _schedcc_run(  # in bytes, as its own first run measured them (README's closed loop)
        "--schedule", "search", "-v", "1", "--search-time", "1", "--steps", "2", "--model", "mlp",
        "--search-memory-limit", "16MiB",
    )  # fmt: skip
    assert one.returncode == 0, one.stderr
    assert one.stdout.count("search: a first run") == 1  # one cut: no other
    assert re.search(r"under the costs measured in \S+1f1b-v1.json, within 16MiB", one.stdout)


def _peaks(summary: str) -> list[int]:
    """The summary's "peak activations, stage s" rows, in bytes."""
    rows = re.findall(r"peak activations, stage \d+\s*[│|]\s*([0-9.]+ [KMG]?i?B)", summary)
    return [parse_size(row) for row in rows]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--schedule", "search", "--other-cut", "t.json"], "--other-cut goes with --costs-from"),
        (["--schedule", "1f1b", "--costs-from", "t.json"], "goes with --schedule search"),
        (["--schedule", "1f1b", "--other-cut", "t.json"], "goes with --schedule search"),
        (["--schedule", "1f1b", "--search-memory-limit", "2"], "goes with --schedule search"),
        (["--schedule", "search", "--costs-from", "t.json", "--search-offload"],
         "goes with --search-memory-limit"),
        (["--schedule", "search", "--costs-from", "t.json", "--search-memory-limit", "0"],
         "--search-memory-limit: expected a positive number"),
    ],
)
def test_run_search_mistakes_are_one_line(argv, says, capsys):
    """`--schedule search` with another cut but no trace, or a trace without it: one line,
    exit 2."""
    try:
        code = main(["run", *argv])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert says in err


def _traced_with_updates(tmp_path, costs: CostModel):
    """A trace of 1F1B at p = 2, m = 4, its head tied and its norm taken, as `schedcc run
    --trace` records them; and the timeline that wrote it."""
    program = schedcc.compile(get_schedule("1f1b")(2, 4), tied=[(0, 1)], grad_norm=True)
    timeline = schedcc.simulate(program, costs, eager=True)
    trace = timeline.to_chrome_trace(tmp_path / "first.json")
    written = json.loads(trace.read_text())
    written.setdefault("otherData", {})["updates"] = {"tied": [[0, 1]], "grad_norm": True}
    trace.write_text(json.dumps(written))
    return trace, timeline


def test_costs_from_a_trace_time_the_updates_its_run_compiled(tmp_path, capsys):
    """`tune` and `search --costs-from` compile every program with the trace's ties and norm
    ([Note: a trace's updates]): tune times 1F1B as the traced step, and the found order's
    makespan is its own compiled with them (the first and last segments tied at v = 2 too);
    `--tied` and `--grad-norm` say the same for costs given by hand."""
    costs = CostModel(reduce=1.5, norm=0.5, step=1.0, comm=0.1)
    trace, timeline = _traced_with_updates(tmp_path, costs)
    shape = ["-p", "2", "-m", "4", "--eager"]
    assert main(["tune", *shape, "-v", "1", "--costs-from", str(trace), "--format", "json"]) == 0
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    traced = next(row for row in ranked if row["schedule"] == "1f1b")
    assert traced["makespan"] == pytest.approx(timeline.makespan)
    out = tmp_path / "found.py"
    argv = ["search", *shape, "-v", "1,2", "--costs-from", str(trace), "--time-limit", "1",
            "--method", "heuristic", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "timed with its updates' collectives: tied (0, -1) and the gradient norm" in printed
    line = printed.splitlines()[0]
    makespan = float(re.search(r"makespan \(eager\) ([0-9.]+)", line).group(1))
    found = get_schedule(f"{out}:Found")(*get_schedule(f"{out}:Found").shape)
    program = schedcc.compile(found, tied=[(0, -1)], grad_norm=True)
    measured = CostModel.from_trace(trace)
    expected = schedcc.simulate(program, _per_chunk(measured, found.num_chunks), eager=True)
    assert makespan == pytest.approx(expected.makespan, abs=1e-4)
    by_hand = ["-v", "1", "--costs", "reduce=1.5,norm=0.5,step=1,comm=0.1", "--format", "json"]
    assert main(["tune", *shape, *by_hand, "--tied", "0,-1", "--grad-norm"]) == 0
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    assert next(r for r in ranked if r["schedule"] == "1f1b")["makespan"] == pytest.approx(
        timeline.makespan
    )


def test_run_searches_for_the_program_its_first_run_compiled(tmp_path, capsys):
    """The closed loop's search times its orders with the ties and norm the first run's trace
    records: the simulated step it prints is the found order's, compiled with them."""
    from schedcc.cli import build_parser
    from schedcc.cli.run import _searched

    costs = CostModel(reduce=1.5, norm=0.5, step=1.0, comm=0.1)
    trace, _ = _traced_with_updates(tmp_path, costs)
    argv = ["run", "--schedule", "search", "-p", "2", "-m", "4", "--costs-from", str(trace),
            "--search-time", "1"]  # fmt: skip
    args = build_parser().parse_args(argv)
    path, v = _searched(args, False)
    printed = capsys.readouterr().out
    step = float(re.search(r"simulated step ([0-9.]+) ms", printed).group(1))
    assert "collectives: tied (0, -1) and the gradient norm" in printed
    found = get_schedule(path)(*get_schedule(path).shape)
    program = schedcc.compile(found, tied=[(0, -1)], grad_norm=True)
    measured = CostModel.from_trace(trace)
    expected = schedcc.simulate(program, _per_chunk(measured, found.num_chunks), eager=True)
    assert step == pytest.approx(expected.makespan, abs=0.005)
    assert found.num_chunks == v


def test_bad_ties_are_one_line(capsys):
    """A malformed `--tied`, or one naming segments of one cut across several, exits 2."""
    for argv, says in (
        (["--tied", "0,x"], "give groups of segment indices"),
        (["-v", "1,2", "--tied", "0,1"], "names segments of one cut"),
    ):
        try:
            code = main(["search", "-p", "2", "-m", "4", *argv])
        except SystemExit as exc:  # argparse's own
            code = exc.code
        assert code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1
        assert says in err


def test_the_closed_loop_searches_only_cuts_of_the_model_it_measured(tmp_path, capsys):
    """The built-in GPT has a block a segment, 4 at least: at p = 4 it is another model at
    v = 2 than at v = 1, so costs measured at one price nothing at the other. Without
    `--costs-from` the search leaves v = 2 out, saying why; with a trace of v = 1 and `-v 2`,
    one line and exit 2."""
    import argparse

    from schedcc.cli.run import _one_model

    args = argparse.Namespace(model="tiny-gpt", num_stages=4, seed=0)
    assert _one_model(args, [1, 2], 1) == [1]
    assert "orders at v = 2 left out: --model tiny-gpt cut in 8 segments" in capsys.readouterr().out
    at_two = argparse.Namespace(model="tiny-gpt", num_stages=2, seed=0)
    assert _one_model(at_two, [1, 2], 1) == [1, 2]  # 4 blocks at either cut
    events = [
        {"name": name, "ph": "X", "ts": 0, "dur": 1000, "pid": 0, "tid": stage}
        for stage in range(4)
        for name in ("F0", "B0")
    ]
    cut = {"num_stages": 4, "num_chunks": 1, "num_replicas": 1, "segments": [[0], [1], [2], [3]]}
    trace = tmp_path / "v1.json"
    trace.write_text(json.dumps({"traceEvents": events, "otherData": {
        "cut": cut, "updates": {"tied": [[0, -1]], "grad_norm": True}}}))  # fmt: skip
    argv = ["run", "--schedule", "search", "-p", "4", "-v", "2", "--costs-from", str(trace)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "cut at -v 2 is another model than the one" in err[0]
