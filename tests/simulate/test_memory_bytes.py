"""Bytes, not just counts: `MemoryModel`, `Timeline.peak_bytes`, `validate(max_bytes=)`, and
`tune`/`show` under a byte limit; the simulated activation bytes equal the engines' measured ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import schedcc
from schedcc import CostModel, MemoryBoundError, ScheduleConfigError
from schedcc.backends.local import Engine
from schedcc.backends.runtime.memory import measure_memory
from schedcc.cli import main
from schedcc.memory_model import MemoryModel
from schedcc.sizes import parse_size

MiB = 2**20
_WIDTH = 16


def _segments(n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.Sequential(nn.Linear(_WIDTH, _WIDTH), nn.ReLU(), nn.Linear(_WIDTH, _WIDTH))
        for _ in range(n)
    ]


def _sgd(params):
    return torch.optim.SGD(params, lr=0.01)


@pytest.mark.parametrize(
    ("text", "size"),
    [("512MiB", 512 * MiB), ("12GiB", 12 * 2**30), ("1.5 KB", 1500), ("7", 7), (64, 64)],
)
def test_sizes_parse_with_units(text, size):
    """Sizes take B, KB..TB (powers of 1000) and KiB..TiB (powers of 1024), or no unit."""
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["12 parsecs", "-1GiB", "GiB", "", True, float("inf")])
def test_bad_sizes_are_config_errors(text):
    """A size that is not a non-negative number with a known unit is a `ScheduleConfigError`."""
    with pytest.raises(ScheduleConfigError):
        parse_size(text)


@pytest.mark.parametrize(
    ("name", "v"), [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("2bw", 1)]
)
@pytest.mark.parametrize("recompute", [False, True])
def test_simulated_activation_bytes_equal_the_measured_ones(name, v, recompute):
    """With a memory model measured on the segments, the simulator's peak activation bytes per
    stage are exactly what the local engine measures, with and without recomputation."""
    p, m, size = 3, 6, 4
    schedule = schedcc.get_schedule(name)(p, m, v)
    program = schedcc.compile(schedule, recompute=recompute)
    gen = torch.Generator().manual_seed(1)
    x, y = (
        torch.randn(m * size, _WIDTH, generator=gen),
        torch.randn(m * size, _WIDTH, generator=gen),
    )
    memory = measure_memory(_segments(p * v), x[:size], y[:size], nn.functional.mse_loss)
    engine = Engine(program, _segments(p * v), nn.functional.mse_loss, _sgd)
    list(engine.train([(x, y)] * schedule.num_batches))
    timeline = schedcc.simulate(program, CostModel(memory=memory))
    assert list(timeline.peak_activation_bytes) == engine.peak_activation_bytes


def test_measure_memory_counts_parameters_inputs_and_optimizer_state():
    """Parameters and inputs are their tensors' bytes; Adam keeps two moments per parameter."""
    segments = [nn.Linear(4, 8), nn.Linear(8, 2)]
    memory = measure_memory(
        segments, torch.ones(3, 4), torch.ones(3, 2), nn.functional.mse_loss, torch.optim.Adam
    )
    assert memory.parameters == (4 * (4 * 8 + 8), 4 * (8 * 2 + 2))
    assert memory.inputs == (4 * 3 * 4, 4 * 3 * 8)
    assert memory.optimizer == tuple(2 * n for n in memory.parameters)
    assert all(a > 0 for a in memory.activations)


def _timeline(name, memory, *, num_batches=1, **compile_args):
    schedule = schedcc.get_schedule(name)(2, 4, num_batches=num_batches)
    return schedcc.simulate(schedcc.compile(schedule, **compile_args), CostModel(memory=memory))


def test_peak_bytes_count_stashes_shards_and_recompute():
    """Peak bytes add parameters, gradients and optimizer state to the activations; 2BW holds a
    stashed copy of the parameters; ZeRO-1 shards the optimizer state and ZeRO-2 also the
    gradients after each reduce-scatter (ZeRO-3 also the parameters between uses);
    recomputation holds one microbatch's activations plus kept inputs."""
    memory = MemoryModel(activations="1MiB", parameters="4MiB", optimizer="8MiB", inputs="0.25MiB")
    plain = _timeline("1f1b", memory)
    assert plain.peak_activation_bytes == (2 * MiB, 1 * MiB)
    assert plain.peak_bytes == ((2 + 4 + 4 + 8) * MiB, (1 + 4 + 4 + 8) * MiB)
    stashed = _timeline("2bw", memory, num_batches=2)
    assert stashed.stage_bytes[0].stashed == 4 * MiB
    zero1 = _timeline("1f1b", memory, data_parallel=2, zero=1)
    assert zero1.stage_bytes[0].optimizer == 4 * MiB
    assert zero1.stage_bytes[0].gradients == 4 * MiB
    assert zero1.stage_bytes[0].parameters == (4 + 2) * MiB  # whole + the stepped shard
    zero2 = _timeline("1f1b", memory, data_parallel=2, zero=2)
    assert zero2.stage_bytes[0].gradients == (4 + 2) * MiB  # one backward's whole + the shard
    zero3 = _timeline("1f1b", memory, data_parallel=2, zero=3)
    assert zero3.stage_bytes[0].parameters == 4 * MiB  # whole from Unshard to Reshard
    assert zero3.stage_bytes[0].total < zero2.stage_bytes[0].total
    recomputed = _timeline("1f1b", memory, recompute=True)
    assert recomputed.peak_activation_bytes == (1.25 * MiB, 1 * MiB)  # F1's input, then R0


def test_bytes_need_a_memory_model():
    """Asking a timeline for bytes without `CostModel(memory=...)` is a `ScheduleConfigError`,
    as is a per-segment list of the wrong length."""
    timeline = schedcc.simulate(schedcc.compile(schedcc.get_schedule("1f1b")(2, 4)))
    with pytest.raises(ScheduleConfigError, match="memory model"):
        timeline.peak_bytes  # noqa: B018
    with pytest.raises(ScheduleConfigError, match="3 sizes but the program has 2"):
        _timeline("1f1b", MemoryModel(activations=[1, 2, 3])).peak_bytes  # noqa: B018
    with pytest.raises(ScheduleConfigError, match="MemoryModel"):
        CostModel(memory={"activations": 1})


def test_validate_bounds_bytes():
    """`validate(max_bytes=...)` rejects a program that holds more on a stage, naming where;
    full recomputation makes the same schedule fit."""
    memory = MemoryModel(activations="1MiB", parameters="1MiB")
    program = schedcc.compile(schedcc.get_schedule("gpipe")(2, 8))
    with pytest.raises(
        MemoryBoundError, match=r"F4\) makes stage 0 hold 6.00 MiB, over the limit of 5.00 MiB"
    ):
        schedcc.validate(program, max_bytes="5MiB", memory=memory)
    schedcc.validate(program, max_bytes="10MiB", memory=memory)
    recomputed = schedcc.compile(schedcc.get_schedule("gpipe")(2, 8), recompute=True)
    schedcc.validate(recomputed, max_bytes="3MiB", memory=memory)
    with pytest.raises(MemoryBoundError, match=r"R7\) makes stage 0 hold 2.00 MiB"):
        schedcc.validate(recomputed, max_bytes="1MiB", memory=memory)  # parameters + R7
    with pytest.raises(MemoryBoundError, match="before any activation"):
        schedcc.validate(recomputed, max_bytes="0.5MiB", memory=memory)
    with pytest.raises(ScheduleConfigError, match="needs memory"):
        schedcc.validate(program, max_bytes="5MiB")


def test_tune_ranks_recompute_under_a_byte_limit():
    """`tune` with a memory model and a byte limit keeps what fits: at a tight limit only
    recomputed candidates remain, and each candidate reports its peak bytes."""
    costs = CostModel(memory=MemoryModel(activations="1GiB", parameters="1GiB"))
    result = schedcc.tune(
        ["gpipe", "1f1b"],
        num_stages=4,
        num_microbatches=8,
        num_chunks=1,
        costs=costs,
        memory_limit="3.5GiB",
        recompute=(False, True),
    )
    assert result.ranked
    assert all(c.recompute for c in result.ranked)
    assert all(c.peak_bytes <= 3.5 * 2**30 for c in result.ranked)
    assert {(c.schedule, c.recompute) for c in result.over_limit} == {
        ("gpipe", False),
        ("1f1b", False),
    }


def test_cli_tune_and_show_take_recompute_and_bytes(capsys):
    """`schedcc tune --recompute --memory ... --memory-limit 11GiB` ranks in bytes; `show
    --recompute --memory ...` draws the Rs and prints the peak bytes per stage; a byte limit
    without `--memory` is one line and exit 2."""
    argv = ["tune", "-p", "4", "-m", "8", "-v", "1", "--schedule", "1f1b", "--recompute"]
    memory = ["--memory", "act=2GiB,params=1GiB,opt=2GiB", "--memory-limit", "11GiB"]
    assert main([*argv, *memory, "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    without = {(r["schedule"], r["recompute"]) for r in report["ranked"] if not r["recompute"]}
    assert without == {("1f1b-offload", False)}  # only offloading fits without recomputing
    assert all(r["peak_bytes"] <= 11 * 2**30 for r in report["ranked"])
    assert main(["show", "--schedule", "1f1b", "-p", "2", "-m", "2", "--recompute",
                 "--memory", "activations=1MiB,parameters=1MiB"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "R0" in out
    assert "peak bytes per stage [3.00 MiB, 3.00 MiB]" in out
    assert main(["tune", "-p", "2", "--memory-limit", "11GiB"]) == 2
    err = capsys.readouterr().err
    assert "give --memory" in err
    assert len(err.strip().splitlines()) == 1


def test_per_stage_sizes_follow_each_segment_to_its_stage_at_any_v():
    """[Note: tune's units]: a `MemoryModel` with one size per stage is each stage's at
    v = 1: at v = 2, looped or V, a stage's chunks together hold its sizes (here parameters
    and their gradients, 2x), in `tune` and in `search` alike."""
    costs = CostModel(memory=MemoryModel(parameters=[10, 20, 40], activations=0))
    ranked = schedcc.tune(
        ["1f1b", "interleaved-1f1b", "zb-v"], num_stages=3, num_microbatches=[6], costs=costs
    ).ranked
    assert {(c.schedule, c.num_chunks) for c in ranked} >= {("interleaved-1f1b", 2), ("zb-v", 2)}
    assert all(c.bytes == (20.0, 40.0, 80.0) for c in ranked)
    found = schedcc.search(
        3, 6, costs=costs, memory_limit=[20, 40, 80], time_limit=2, method="heuristic", seed=1
    )
    assert found.peak_bytes == (20.0, 40.0, 80.0)
    sizes = CostModel(memory=MemoryModel(activations=[1000, 2000, 4000]))
    for name in ("interleaved-1f1b", "zb-v"):  # a chunk holds half of its stage's activations
        (row,) = schedcc.tune([name], num_stages=3, num_microbatches=[6], num_chunks=2,
                              costs=sizes).ranked  # fmt: skip
        counts = row.activations  # whole-stage microbatches held on each stage
        assert row.bytes == pytest.approx([n * a for n, a in zip(counts, (1000, 2000, 4000))])


@pytest.mark.parametrize(("name", "v"), [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-v", 2)])
@pytest.mark.parametrize("recompute", [False, True])
def test_an_engine_records_what_one_microbatch_takes_per_segment(name, v, recompute):
    """`microbatch_bytes` (what `schedcc run --trace` records) is, per segment, what one
    microbatch's forward saves and its input takes: `measure_memory`'s sizes, with and without
    recomputation, looped and V placement."""
    p, m, size = 2, 4, 3
    program = schedcc.compile(schedcc.get_schedule(name)(p, m, v), recompute=recompute)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(m * size, _WIDTH, generator=gen)
    y = torch.randn(m * size, _WIDTH, generator=gen)
    memory = measure_memory(_segments(p * v), x[:size], y[:size], nn.functional.mse_loss)
    engine = Engine(program, _segments(p * v), nn.functional.mse_loss, _sgd)
    list(engine.train([(x, y)] * program.schedule.num_batches))
    assert engine.microbatch_bytes == {
        k: {field: memory.at(field, k) for field in ("activations", "inputs")}
        for k in range(p * v)
    }


def _trace(path, memory) -> str:
    events = [
        {"name": name, "ph": "X", "pid": 0, "tid": s, "ts": 0, "dur": dur}
        for s in range(2)
        for name, dur in (("F0", 1000), ("B0", 2000))
    ]
    path.write_text(json.dumps({"traceEvents": events, "otherData": {"memory": memory}}))
    return str(path)


def test_a_memory_model_from_a_trace_counts_activations_alone(tmp_path):
    """`MemoryModel.from_trace` reads the per-segment bytes a run recorded, with no parameters,
    gradients or optimizer state: a byte limit with it is one on activations."""
    trace = _trace(tmp_path / "t.json", {"activations": [1024, 2048], "inputs": [16, 32]})
    memory = MemoryModel.from_trace(trace)
    assert memory == MemoryModel(activations=[1024, 2048], inputs=[16, 32], cut=2)
    timeline = _timeline("1f1b", memory)
    assert timeline.peak_bytes == timeline.peak_activation_bytes == (2048, 2048)


@pytest.mark.parametrize(
    ("memory", "says"),
    [
        (None, "records no measured bytes"),
        ({"activations": [1, 2]}, "'inputs', a list of numbers"),
        ({"activations": "1KiB", "inputs": [1]}, "'activations', a list of numbers"),
        ({"activations": [1, 2], "inputs": [1]}, "2 segments' activations but 1"),
        ({"activations": [-1, 2], "inputs": [1, 1]}, "finite number >= 0"),
        ([1, 2], "a list of numbers"),
    ],
)
def test_a_trace_without_good_bytes_is_a_config_error(tmp_path, memory, says):
    """A trace that records no bytes, or malformed ones, is a `ScheduleConfigError` naming why."""
    path = tmp_path / "t.json"
    if memory is None:
        path.write_text(json.dumps({"traceEvents": []}))
    else:
        _trace(path, memory)
    with pytest.raises(ScheduleConfigError, match=says):
        MemoryModel.from_trace(path)


def test_cli_byte_limits_count_a_traces_bytes(tmp_path, capsys):
    """`tune` and `search --costs-from TRACE --memory-limit SIZE` without `--memory` count the
    activation bytes the trace records, for orders of the cut it measured; a trace without them,
    chunk counts that cut the model otherwise, or a trace of another run than the closed loop's
    (here fp32 bytes for a `--check` run) are one line and exit 2."""
    trace = _trace(tmp_path / "t.json", {"activations": [1024, 1024], "inputs": [0, 0]})
    argv = ["-p", "2", "-m", "4", "--costs-from", trace, "--memory-limit", "1KiB"]
    assert main(["search", *argv, "-v", "1", "--recompute", "--time-limit", "2"]) == 0
    out = capsys.readouterr().out
    assert "peak bytes per stage [1.00 KiB, 1.00 KiB]" in out
    assert "a cut in 2 segments: orders at v = 1 and DualPipe's replicas" in out
    assert main(["tune", *argv, "-v", "1,2", "--recompute", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    over = {(c["schedule"], c["num_chunks"]): c["peak_bytes"] for c in rows["over_limit"]}
    assert over[("1f1b", 1)] == 2048
    skipped = {(c["schedule"], c["num_chunks"]): c["reason"] for c in rows["skipped"]}
    assert "measured on a cut in 2" in skipped[("interleaved-1f1b", 2)]
    ranked = {(c["schedule"], c["num_chunks"]) for c in rows["ranked"]}
    assert ("dualpipe", 2) in ranked  # its replicas each cut the model in 2
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"traceEvents": json.loads(Path(trace).read_text())["traceEvents"]}))
    argv[5] = str(bare)
    closed_loop = ["run", "--schedule", "search", "--costs-from", str(bare), "--model", "mlp"]
    closed_loop += ["--search-memory-limit", "1KiB"]
    four = _trace(tmp_path / "v2.json", {"activations": [1, 2, 3, 4], "inputs": [0, 0, 0, 0]})
    three = _trace(tmp_path / "v3.json", {"activations": [1, 2, 3], "inputs": [0, 0, 0]})
    fp32 = {"activations": [1024, 1024], "inputs": [0, 0], "dtype": "fp32"}
    fp32 = _trace(tmp_path / "fp32.json", fp32)
    model = _trace(tmp_path / "gpt.json", {**json.loads(Path(fp32).read_text())["otherData"][
        "memory"], "dtype": "float64", "model": "tiny-gpt"})
    for mistake, says in (
        (["search", *argv, "--time-limit", "1"], "records no measured bytes"),
        (closed_loop, "records no measured bytes"),
        (["search", *argv[:5], four, *argv[6:], "-v", "1"], "cut in 4 segments, v = 2 on 2"),
        (["tune", *argv[:5], four, *argv[6:], "-v", "1"], "add -v 2"),
        ([*closed_loop[:4], four, *closed_loop[5:], "-v", "1"], "add -v 2"),
        (["search", *argv[:5], three, *argv[6:]], "which 2 stages do not share evenly"),
        ([*closed_loop[:4], fp32, *closed_loop[5:], "--check"], "dtype = 'fp32'"),
        ([*closed_loop[:4], model, *closed_loop[5:], "--check"], "model = 'tiny-gpt' (--model)"),
    ):
        assert main(mistake) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1
        assert says in err[0]


def test_a_trace_records_one_replicas_bytes_and_none_with_sequence_parts():
    """A trace's bytes are one microbatch's per segment of one model replica (DualPipe's cut is
    its first replica's), with what the run trained; a run with sequence parts holds a part's
    per graph, so its trace records none (a byte limit from it is then refused)."""
    from types import SimpleNamespace

    from schedcc.backends.run.report import memory_record

    config = SimpleNamespace(
        check=False, precision="fp32", model="mlp", microbatch_size=2, tp=1,
        recompute_layers=None, compile=None,
    )  # fmt: skip
    gathered = [
        {"stage": s, "dp": 0, "sizes": {s: {"activations": 10 * (s + 1), "inputs": 1}}}
        for s in range(2)
    ]
    whole = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4))
    assert memory_record(whole, config, gathered)["memory"] == {
        "activations": [10, 20], "inputs": [1, 1], "dtype": "fp32", "model": "mlp",
        "microbatch_size": 2, "tp": 1, "recompute_layers": None, "compile": None,
    }  # fmt: skip
    parts = schedcc.compile(schedcc.get_schedule("seq1f1b")(2, 4))
    assert parts.schedule.num_parts > 1
    assert memory_record(parts, config, gathered) == {}
    # DualPipe's second replica is a copy of the first: the cut is one replica's segments
    replicated = [
        {"stage": s, "dp": 0, "sizes": {k: {"activations": 10 * (k % 2 + 1), "inputs": 1}
                                        for k in (s, 3 - s)}}
        for s in range(2)
    ]  # fmt: skip
    dualpipe = schedcc.compile(schedcc.get_schedule("dualpipe")(2, 4, 2))
    assert memory_record(dualpipe, config, replicated)["memory"]["activations"] == [10, 20]
