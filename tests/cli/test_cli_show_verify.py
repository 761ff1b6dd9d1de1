"""`schedcc show` and `schedcc verify` end to end, through a real subprocess."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
from _cli import verify_rows

from schedcc.cli import main

BROKEN = '''
from schedcc import Schedule, Forward, Backward

class Backward0First(Schedule):
    """Runs the backward of microbatch 0 before any forward on the last stage: invalid."""
    name = "broken"
    def order(self, stage):
        mbs = self.microbatches(0)
        if stage == self.num_stages - 1:
            yield Backward(0)
        for i in mbs:
            yield Forward(i)
        for i in reversed(mbs):
            if i or stage != self.num_stages - 1:
                yield Backward(i)
'''


def schedcc_cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "schedcc", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )


def test_show_prints_the_drawing_and_the_summary():
    """ASCII to stdout: a row per stage and the textbook 1F1B makespan in the summary."""
    result = schedcc_cli("show", "--schedule", "1f1b", "-p", "4", "-m", "8")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert sum(line.startswith("stage ") for line in lines) == 4
    assert lines[-1].startswith("makespan 33, bubble 27.3%, peak activations per stage [4 3 2 1]")


def test_show_eager_times_sends_that_never_wait():
    """Interleaved 1F1B at p = 2: 57 units with rendezvous exchanges, the ideal 51 eagerly."""
    shape = ("--schedule", "interleaved-1f1b", "-p", "2", "-m", "8", "-v", "2")
    rendezvous = schedcc_cli("show", *shape)
    eager = schedcc_cli("show", *shape, "--eager")
    assert rendezvous.returncode == eager.returncode == 0, rendezvous.stderr + eager.stderr
    assert rendezvous.stdout.splitlines()[-1].startswith("makespan 57,")
    assert eager.stdout.splitlines()[-1].startswith("makespan 51, bubble 5.9%")


def test_show_writes_svg_and_chrome_files(tmp_path):
    """--format svg and --format chrome write the files they are asked for."""
    svg = schedcc_cli(
        "show",
        "--schedule",
        "gpipe",
        "-p",
        "2",
        "-m",
        "4",
        "--format",
        "svg",
        "-o",
        str(tmp_path / "g.svg"),
        "--costs",
        "F=1,B=2,comm=0.1",
    )
    assert svg.returncode == 0, svg.stderr
    assert (tmp_path / "g.svg").read_text().lstrip().startswith("<?xml")
    chrome = schedcc_cli(
        "show",
        "--schedule",
        "1f1b",
        "-p",
        "2",
        "-m",
        "2",
        "--dp",
        "2",
        "-o",
        str(tmp_path / "t.json"),
    )
    assert chrome.returncode == 0, chrome.stderr
    names = {e["name"] for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"]}
    assert {"F0", "B1", "Reduce", "Step"} <= names


def test_verify_passes_a_builtin_schedule_over_its_grid():
    """verify exits 0 and reports every checked shape as passing."""
    result = schedcc_cli("verify", "--schedule", "1f1b", "-p", "3")
    assert result.returncode == 0, result.stderr
    assert "FAIL" not in result.stdout
    assert "shapes pass" in result.stdout


def test_verify_fails_a_broken_schedule_and_explains(tmp_path):
    """A schedule that runs a backward before its forward: exit 1, FAIL rows, the reason."""
    (tmp_path / "broken.py").write_text(BROKEN)
    result = schedcc_cli(
        "verify", "--schedule", "broken.py:Backward0First", "-m", "2", cwd=tmp_path
    )
    assert result.returncode == 1
    assert "FAIL DependencyError" in result.stdout
    assert "move B0 after it" in result.stdout


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["show", "--schedule", "no-such-schedule"], "unknown schedule"),
        (["show", "--schedule", "1f1b", "-p", "0"], "positive integer"),
        (["verify", "--schedule", "missing_file.py:X"], "does not exist"),
        (["verify", "--schedule", "schedcc.ir:Forward"], "not a subclass of schedcc.Schedule"),
        (["show", "--schedule", "1f1b", "--costs", "F=fast"], "not a number"),
        (
            ["show", "--schedule", "zb-v", "-p", "2", "-v", "2", "--segment-costs", ";;F=2"],
            "cuts the model in 4",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, says):
    """Unknown schedule, p = 0, missing file, a non-Schedule class, bad costs: one line, exit 2."""
    result = schedcc_cli(*args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert says in result.stderr


@pytest.mark.parametrize("command", ["show", "verify"])
def test_help_shows_examples(command, capsys):
    """--help lists runnable examples in its epilog."""
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    assert f"schedcc {command} --schedule" in capsys.readouterr().out


def test_a_shape_the_schedule_rejects_is_bad_input(capsys):
    """verify of a shape the schedule refuses (1f1b with v = 2) is exit 2 with its rule."""
    assert main(["verify", "--schedule", "1f1b", "-v", "2"]) == 2
    assert "one chunk per stage" in capsys.readouterr().err


def test_verify_refuses_both_a_schedule_and_a_torch_class(capsys):
    """verify with --schedule and --torch together is bad input (exit 2), not one silently."""
    assert main(["verify", "--schedule", "1f1b", "--torch", "Schedule1F1B"]) == 2
    assert "not both" in capsys.readouterr().err


def test_show_prices_each_segment_where_its_placement_puts_it(capsys):
    """`show --segment-costs` simulates each segment at its own costs: zb-v's stage 0 holds the
    first and the last segment (the V), so a heavy last segment makes stage 0 the busy one, as
    `schedcc.simulate` times it under `CostModel(per_segment=...)`."""
    import schedcc
    from schedcc import CostModel

    argv = ["show", "--schedule", "zb-v", "-p", "2", "-m", "4", "-v", "2"]
    assert main([*argv, "--segment-costs", ";;;F=2.5,I=2.5,W=2.5"]) == 0
    out = capsys.readouterr().out
    heavy = CostModel(forward=2.5, backward_input=2.5, backward_weight=2.5)
    costs = CostModel(per_segment=[CostModel()] * 3 + [heavy])
    timeline = schedcc.simulate(schedcc.compile(schedcc.get_schedule("zb-v")(2, 4, 2)), costs)
    assert f"makespan {timeline.makespan:g}," in out
    assert timeline.busy[0] > timeline.busy[1]


def test_show_without_v_uses_the_schedules_own_chunks(capsys):
    """show --schedule zb-v with no -v draws ZB-V's two chunks (5.9% bubble at p=4, m=8)."""
    assert main(["show", "--schedule", "zb-v", "-p", "4", "-m", "8"]) == 0
    assert "bubble 5.9%" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["show", "verify", "tune", "run"])
def test_shared_flags_are_spelled_one_way(command, capsys):
    """--schedule, -p/--num-stages, -m/--num-microbatches, -v/--num-chunks, --dp and --zero are
    spelled the same in every command; --microbatches and --chunks are hidden aliases."""
    from schedcc.cli import build_parser

    parser = build_parser()
    long = ["--num-stages", "3", "--num-microbatches", "6", "--num-chunks", "2"]
    args = parser.parse_args([command, "--schedule", "1f1b", *long, "--dp", "2", "--zero", "1"])
    many = command == "tune"
    assert args.num_stages == 3
    assert args.num_microbatches == ([6] if many else 6)
    assert args.num_chunks == ([2] if many else 2)
    assert (args.dp, args.zero) == (2, 1)
    alias = ["--schedule", "1f1b", "-p", "3", "--microbatches", "6", "--chunks", "2"]
    args = parser.parse_args([command, *alias])
    assert (args.num_microbatches, args.num_chunks) == (([6], [2]) if many else (6, 2))
    with pytest.raises(SystemExit):
        main([command, "--help"])
    usage = capsys.readouterr().out
    assert "--num-microbatches" in usage
    assert "--microbatches" not in usage.replace("--num-microbatches", "")
    assert "--stages" not in usage.replace("--num-stages", "")


ONE_CHUNK = '''
from schedcc import Schedule, Forward, Backward

class GPipe(Schedule):
    """README's GPipe: yields Forward(i) and Backward(i), chunk 0 only."""
    name = "my-gpipe"
    def order(self, stage):
        for b in range(self.num_batches):
            mbs = self.microbatches(b)
            yield from (Forward(i) for i in mbs)
            yield from (Backward(i) for i in reversed(mbs))

class BackwardChunksInOrder(Schedule):
    """Runs each microbatch's backwards chunk 0 first: right for v = 1 only, declared any."""
    chunks = "any"
    def order(self, stage):
        for b in range(self.num_batches):
            mbs = self.microbatches(b)
            for c in range(self.num_chunks):
                yield from (Forward(i, chunk=c) for i in mbs)
            for c in range(self.num_chunks):
                yield from (Backward(i, chunk=c) for i in reversed(mbs))
'''


def test_verify_passes_a_one_chunk_schedule_with_no_flags(tmp_path, monkeypatch, capsys):
    """README's GPipe (no chunks declared) passes `verify` with no flags: its grid has v = 1 only
    (5 stage counts, 6 microbatch counts, 2 batch counts)."""
    (tmp_path / "one_chunk.py").write_text(ONE_CHUNK)
    monkeypatch.chdir(tmp_path)
    assert main(["verify", "--schedule", "one_chunk.py:GPipe"]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out
    assert "my-gpipe: 60 shapes" in out
    rows = verify_rows(out)
    assert len(rows) == 60
    assert {row[2] for row in rows} == {"1"}


def test_verify_fails_where_declared_chunks_are_wrong(tmp_path, monkeypatch, capsys):
    """A schedule declaring any chunk count but right only for v = 1: exit 1, every failing row
    at v = 2, every v = 1 row passing."""
    (tmp_path / "one_chunk.py").write_text(ONE_CHUNK)
    monkeypatch.chdir(tmp_path)
    assert main(["verify", "--schedule", "one_chunk.py:BackwardChunksInOrder", "-p", "2"]) == 1
    out = capsys.readouterr().out
    rows = verify_rows(out)
    assert {row[2] for row in rows if row[4] == "FAIL"} == {"2"}
    assert {row[4] for row in rows if row[2] == "1"} == {"pass"}


def test_verify_takes_dp_and_zero(capsys):
    """verify --dp 2 --zero 1 compiles every shape with the data-parallel updates."""
    assert (
        main(["verify", "--schedule", "1f1b", "-p", "2", "-m", "4", "--dp", "2", "--zero", "1"])
        == 0
    )
    assert "2 of 2 shapes pass" in capsys.readouterr().out


def test_every_cost_field_is_a_costs_key():
    """--costs takes every duration field of CostModel by name, and the instruction codes."""
    from schedcc.cli.args import parse_costs
    from schedcc.costs import cost_fields

    values = {  # the overlap field is a fraction
        name: 0.5 if name == "overlap" else float(n + 1) for n, name in enumerate(cost_fields())
    }
    model = parse_costs(",".join(f"{name}={value}" for name, value in values.items()))
    assert {name: getattr(model, name) for name in values} == values
    with pytest.raises(argparse.ArgumentTypeError, match="overlap must be a fraction"):
        parse_costs("overlap=2")
    assert parse_costs("F=3,W=0.5,Reduce=2").reduce == 2.0


def test_verify_imports_a_schedule_files_neighbours(tmp_path, monkeypatch, capsys):
    """`schedcc verify --schedule sub/file.py:Class` where the file imports a module beside it:
    the file's folder is on the import path while it loads (and only then)."""
    folder = tmp_path / "sub"
    folder.mkdir()
    (folder / "helper_orders.py").write_text(
        "from schedcc.schedules.one_f_one_b import OneFOneB\n\n\n"
        "class Mine(OneFOneB):\n    name = 'mine-1f1b'\n"
    )
    (folder / "my_schedule.py").write_text("from helper_orders import Mine\n")
    monkeypatch.chdir(tmp_path)
    before = list(sys.path)
    code = main(["verify", "--schedule", "sub/my_schedule.py:Mine", "-p", "2", "-m", "4"])
    assert code == 0, capsys.readouterr().err
    assert "2 of 2 shapes pass" in capsys.readouterr().out
    assert sys.path == before
