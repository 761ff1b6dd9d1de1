"""Searched orders measured: `schedcc.search`'s order against the fitting built-ins (a benchmark).

The closed loop of `schedcc run --schedule search --costs-from TRACE`, timed. For each p (2 and 4
gloo ranks, one thread each, as `step_time.py`) the GPT of `schedcc run`'s default model
(`tiny-gpt`: its LM head tied to the token embedding, so the last stage is the heaviest) is cut
into p stages (2p blocks, at least 4, over p * v segments), m = 2p or 4p microbatches of 2
samples, one batch (one length) for every step, SGD:

1. first runs: 1F1B and interleaved 1F1B at v = 2 train `--warmup` + `--trace-steps` steps,
   taking each step in turn; the measured events of the last `--trace-steps` runs, as `schedcc
   run --trace` writes them (microseconds), give `CostModel.from_trace` of 1F1B's (the median of
   each instruction kind per stage, in milliseconds: its default unit, so every simulated
   makespan below is in ms) with each compute's per-call part read off both cuts
   (`other_cuts`, as `--costs-from` with `--other-cut`), and 1F1B's measured peak bytes of
   saved activations per stage (`--trace-split`: zb-h1's events too, so I and W are measured);
2. the memory limit is half of 1F1B's peak activations: p / 2 whole-stage microbatches (1F1B's
   stage 0 holds p), the same count on every stage; in bytes, stage s's limit is p / 2 of the
   microbatches 1F1B's measured peak on it held (p - s of them);
3. candidates: `schedcc.search(p, m, costs=..., memory_limit=p / 2, recompute=True,
   tied=[(0, -1)])` (every order timed with the tied head's all-reduce it runs; v = 1, 2,
   both placements, `--search-time` seconds) over both backward forms ("search": F/B and F/I/W
   orders; `from_trace` reads a 1F1B trace's whole backwards split as I = W = B / 2, and, the
   trace being a CPU run's, overlapped pairs as run in order), the same with
   `split_backward=False` ("search F/B": only the kinds a 1F1B trace measures, as the closed
   loop calls it, `measured_backward`), the search within the byte
   limit itself ("search in bytes, cut in p", as `schedcc run --schedule search
   --search-memory-limit SIZE` calls it: the first run's measured bytes of one microbatch per
   stage, `MemoryModel.from_trace`, count them, for orders of its cut: v = 1 and DualPipe;
   "cut in 2p": the costs and bytes of the first run of interleaved 1F1B at v = 2, the 1F1B
   run its other cut, for orders at v = 2, looped or V, its simulated ms under those costs;
   both of the backward forms the trace prices, `measured_backward`: F/B after these runs),
   and every
   built-in that fits the
   same limit at its fastest, as `schedcc search` ranks them: `schedcc.tune` over v = 1, 2, with and
   without full recomputation, the best fitting row of each built-in (weight-delayed orders,
   2BW, left out: `train_step` runs one flush step, they run several batches a program);
4. each candidate compiled with the tie and trained: `--warmup` untimed steps, then `--rounds`
   rounds of one timed step each, the order rotating from round to round; a step is timed
   barrier to barrier on every rank and the slowest rank counts; median per candidate.

The table: measured ms per step, the simulated makespan (ms, under the measured costs) in the
rendezvous model and eagerly (sends that never wait, as the engine runs), measured over each; the
instructions' span (the longest over the ranks from a rank's first instruction's start to its
last one's end, median over the rounds: what the simulator times, without `train_step`'s own
time around them and the barriers) over the eager makespan, and over the eager makespan priced
from 1F1B's trace alone (one cut); and the most saved-activation
bytes any stage held (measured, the engine's `peak_activation_bytes`) against the byte limit of
that stage.

With `--eager` each search runs twice, in the rendezvous model and eagerly (as the closed loop
searches), and both orders are trained side by side.

    python benchmarks/search_measured.py [--stages 2 4] [--rounds 10] [--warmup 3]
        [--trace-steps 5] [--search-time 10] [--trace-split] [--eager] [--quick]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported

import argparse
import itertools
import json
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch._dynamo  # torch.optim imports it (seconds): import once, before forking ranks
import torch.distributed as dist
from _stamp import stamp

import schedcc
from schedcc.backends.distributed.engine import Engine
from schedcc.backends.run import gpt
from schedcc.backends.run.launch import keep_freed_memory, spawn
from schedcc.backends.runtime.tied import tied_groups
from schedcc.costs import CostModel, measured_backward
from schedcc.draw.chrome import chrome_trace, cut_record
from schedcc.memory_model import MemoryModel
from schedcc.registry import build_schedule, get_schedule, registered_classes
from schedcc.tune import priced

MICROBATCH_SIZE = 2  # `schedcc run`'s default
TIED = [(0, -1)]  # the head tied to the embedding: every candidate's program takes its all-reduce


def _sgd(params):
    return torch.optim.SGD(params, lr=1e-3)


def _timed(step) -> float:
    """Wall seconds barrier to barrier."""
    dist.barrier()
    start = time.perf_counter()
    step()
    dist.barrier()
    return time.perf_counter() - start


def _data():
    """`tiny-gpt`'s data, one batch of the longest length (32 tokens) for every step."""
    data = gpt.PaddedBigramData(vocab=64, max_len=32, min_len=8, seed=0)
    step = next(s for s in range(100) if data.batch(1, s)[0][0].shape[1] == data.max_len)
    return lambda batch_size: data.batch(batch_size, step)


def _segments(p: int, num_segments: int):
    """`tiny-gpt` (32 wide, vocab 64, the head tied) with 2p blocks (at least 4) whatever v, so
    every candidate of a p trains the same model, cut into `num_segments`."""
    config = gpt.GPTConfig(vocab=64, max_len=32, num_blocks=max(4, 2 * p))
    return gpt.gpt_segments(gpt.GPT(config, seed=0), num_segments)


class _Runner:
    """One candidate: its schedule compiled with the model's tie, on this rank's engine."""

    def __init__(self, schedule, recompute: bool, data):
        # one model replica's segments, held once per replica (DualPipe: twice), tied within
        # the replica (compile ties the copies)
        replicas = type(schedule).num_replicas
        replica = _segments(schedule.num_stages, schedule.num_segments // replicas)
        program = schedcc.compile(schedule, tied=tied_groups(replica), recompute=recompute)
        segments = replica * replicas
        self.engine = Engine(program, segments, gpt.GPT_LOSS, _sgd, reduce_loss=False)
        self.x, self.y = data

    def step(self) -> None:
        self.engine.train_step(self.x, self.y)

    def instructions(self) -> float:
        """Seconds from this rank's first instruction's start of the last step to its last
        one's end (each rank's clock starts at its own origin, so spans, not times, compare)."""
        events = self.engine.trace_events()
        return max(e[3] for e in events) - min(e[2] for e in events)

    def peak_bytes(self) -> list[float]:
        """Every stage's most saved-activation bytes (gathered from the ranks)."""
        mine = self.engine.peak_activation_bytes[dist.get_rank()] or 0
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        return [float(b) for b in gathered]


def _first_run(p: int, m: int, data, folder: Path, opts):
    """`(costs, alone, peaks, runs)`: the costs measured in 1F1B's first run
    (`CostModel.from_trace` of its events) with each compute's per-call part read off it and
    interleaved 1F1B's at v = 2 (`other_cuts`), the same from 1F1B's alone, and 1F1B's peak
    bytes per stage; with `--trace-split`, zb-h1's events too (its I and W, which 1F1B never
    runs). `runs`: per first run (1F1B at v = 1, interleaved 1F1B at v = 2), what the closed loop
    reads of its trace (`--costs-from` it, `--other-cut` the other): its costs and one
    microbatch's bytes per segment of its cut (`MemoryModel.from_trace` of what `schedcc run
    --trace` records). The first runs take their steps in turn, so the machine's drift is
    theirs alike."""
    runner = _Runner(build_schedule(get_schedule("1f1b"), p, m), False, data)
    at_two = build_schedule(get_schedule("interleaved-1f1b"), p, m, num_chunks=2)
    interleaved = _Runner(at_two, False, data)
    first = [runner, interleaved]
    if opts.trace_split:
        first.append(_Runner(build_schedule(get_schedule("zb-h1"), p, m), False, data))
    events = _traced(first, opts)
    if opts.trace_split:
        events[0] += events.pop()
    paths = [
        _written(each, ran, folder / f"{k}.json")
        for k, (each, ran) in enumerate(zip(first, events))
    ]
    runs = [
        (
            CostModel.from_trace(path, other_cuts=[other]),
            MemoryModel.from_trace(path),
            measured_backward(path),
        )
        for path, other in zip(paths, paths[::-1])
    ]
    return runs[0][0], CostModel.from_trace(paths[0]), runner.peak_bytes(), runs


def _written(runner: _Runner, events: list[dict], path: Path) -> Path:
    """`path`, holding the trace `schedcc run --trace` would write of `runner`'s first run
    (every rank's `events`, its cut and bytes records)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, events)
    metadata = {"device": "cpu", **_bytes_record(runner)}
    events = [e for rank in gathered for e in rank]
    path.write_text(json.dumps({"traceEvents": events, "otherData": metadata}))
    return path


def _bytes_record(runner: _Runner) -> dict:
    """The `"cut"` and `"memory"` records `schedcc run --trace` writes of `runner`'s program:
    one microbatch's bytes per segment, gathered from the ranks ([Note: a trace's bytes])."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, runner.engine.microbatch_bytes)
    sizes = {k: size for rank in gathered for k, size in rank.items()}
    memory = {f: [sizes[k][f] for k in sorted(sizes)] for f in ("activations", "inputs")}
    return {"cut": cut_record(runner.engine.program.schedule), "memory": memory}


def _traced(runners: list[_Runner], opts) -> list[list[dict]]:
    """Per runner, this rank's events of `--trace-steps` steps after `--warmup`, as `schedcc run
    --trace` writes them (each compute's own time, each receive's take); the runners take each
    step in turn."""
    for runner in runners:
        for _ in range(opts.warmup):
            runner.step()
    events: list[list[dict]] = [[] for _ in runners]
    for _ in range(opts.trace_steps):
        for runner, mine in zip(runners, events):
            runner.step()
            trace = chrome_trace(runner.engine.trace_events(own=True), unit_us=1e6)
            mine += [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    return events


def _candidates(p: int, m: int, costs: CostModel, runs, in_bytes, opts) -> list[dict]:
    """The searched orders and each built-in's fastest fitting row, with their makespans (ms);
    "search in bytes" searches orders within `in_bytes` per stage with the costs and bytes of
    each first run in `runs` ([Note: a trace's bytes] in `backends.run.report`), orders of its
    cut."""
    limit = p / 2
    rows = []
    searches = [("search", {"split_backward": (False, True)})]
    searches.append(("search F/B", {"split_backward": False}))
    for measured, memory, forms in runs:
        args = {"costs": measured, "memory": memory, "memory_limit": in_bytes}
        args["split_backward"] = forms  # as the closed loop searches
        searches.append((f"search in bytes, cut in {memory.cut}", args))
    timings = (False, True) if opts.eager else (False,)
    for (label, args), eager in itertools.product(searches, timings):
        args = {"memory_limit": limit, "costs": costs, **args}
        found = schedcc.search(
            p, m, recompute=True, time_limit=opts.search_time, eager=eager, tied=TIED, **args
        )
        ops = " ".join(found.schedule.orders).replace("+", "").split()
        kinds = "F/I/W" if any(op.startswith("I") for op in ops) else "F/B"
        timed = {
            key: schedcc.simulate(found.program, found.timeline.costs, eager=key).makespan
            for key in (False, True)
        }
        rows.append(
            {
                "name": f"{label}{', eager' if eager else ''} ({found.source}; {kinds}, "
                f"v={found.schedule.num_chunks})",
                # a class does not pickle across ranks; its file's text does
                "schedule": found.to_python(),
                "num_chunks": found.schedule.num_chunks,
                "recompute": False,  # its recomputations are in its order
                "simulated": timed[False],
                "eager": timed[True],
                "activations": max(found.peak_activations),
            }
        )
    ranking, eagerly = (
        schedcc.tune(
            registered_classes(),
            num_stages=p,
            num_microbatches=m,
            num_chunks=(1, 2),
            costs=costs,
            memory_limit=limit,
            tied=TIED,
            recompute=(False, True),
            eager=eager,
        )
        for eager in (False, True)
    )
    eager_of = {(c.schedule, c.num_chunks, c.recompute): c.makespan for c in eagerly.ranked}
    # weight-delayed orders (2BW) are left out: `train_step` runs one flush step, and they need
    # several batches a run (`schedcc run` gives them 4), so their makespan is another quantity
    seen = {name for name, cls in registered_classes().items() if cls.weight_delay}
    for c in ranking.ranked:  # fastest first: each built-in's first fitting row is its best
        if c.schedule in seen:
            continue
        seen.add(c.schedule)
        rows.append(
            {
                "name": f"{c.schedule} v={c.num_chunks}" + (" recompute" if c.recompute else ""),
                "schedule": c.schedule,
                "num_chunks": c.num_chunks,
                "recompute": c.recompute,
                "simulated": c.makespan,
                "eager": eager_of[c.schedule, c.num_chunks, c.recompute],
                "activations": c.peak_activations,
            }
        )
    return rows[: opts.max_builtins + len(searches)]


def _built(row: dict, p: int, m: int):
    """A candidate's schedule: a built-in by name, or the found order from its file's text."""
    cls = registered_classes().get(row["schedule"])
    if cls is None:
        namespace: dict = {}
        exec(row["schedule"], namespace)  # the file `schedcc.search` wrote, class Found
        cls = namespace["Found"]
    return build_schedule(cls, p, m, num_chunks=row["num_chunks"])


def _shape(rank: int, p: int, m: int, opts) -> dict:
    data = _data()(m * MICROBATCH_SIZE)
    with tempfile.TemporaryDirectory() as folder:
        costs, alone, peaks, runs = _first_run(p, m, data, Path(folder), opts)
    # 1F1B's stage s holds p - s microbatches: p / 2 of them is this share of its peak
    limit = [b * (p / 2) / (p - s) for s, b in enumerate(peaks)]
    rows = None
    if rank == 0:
        started = time.monotonic()
        rows = _candidates(p, m, costs, runs, [int(b) for b in limit], opts)
        searched_s = time.monotonic() - started
        for row in rows:  # as priced from 1F1B's trace alone
            schedule = _built(row, p, m)
            program = schedcc.compile(schedule, tied=TIED, recompute=row["recompute"])
            row["alone"] = schedcc.simulate(program, priced(alone, schedule), eager=True).makespan
    shared = [rows if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    rows = shared[0]
    runners = [_Runner(_built(row, p, m), row["recompute"], data) for row in rows]
    for runner in runners:
        for _ in range(opts.warmup):
            runner.step()
    times: list[list[float]] = [[] for _ in runners]
    spans: list[list[float]] = [[] for _ in runners]
    order = list(range(len(runners)))
    for turn in range(opts.rounds):
        k = turn % len(order)  # rotate: no candidate always follows the same one
        for i in order[k:] + order[:k]:
            times[i].append(_timed(runners[i].step))
            spans[i].append(runners[i].instructions())
    for row, runner, values, span in zip(rows, runners, times, spans):
        slowest = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        row["measured"] = statistics.median(slowest.tolist()) * 1e3
        longest = torch.tensor(span, dtype=torch.float64)
        dist.all_reduce(longest, op=dist.ReduceOp.MAX)
        row["span"] = statistics.median(longest.tolist()) * 1e3
        row["bytes"] = runner.peak_bytes()
        del row["schedule"]
    return {
        "p": p,
        "m": m,
        "rows": rows,
        "limit": limit,
        "search_s": searched_s if rank == 0 else 0.0,
        "costs": [
            (stage.forward, stage.backward, stage.backward_input, stage.backward_weight, stage.comm)
            for _, stage in sorted(costs.per_stage.items())
        ],
        "load": os.getloadavg(),
    }


def _worker(rank: int, world_size: int, opts) -> int:
    torch.set_num_threads(1)
    keep_freed_memory()
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(120))
    for k in opts.per_stage:
        shape = _shape(rank, world_size, k * world_size, opts)
        if rank == 0:
            _print(shape)  # as each shape finishes
    dist.barrier()
    return 0


def _print(shape: dict) -> None:
    p, m, limit = shape["p"], shape["m"], shape["limit"]
    load = " ".join(f"{x:.2f}" for x in shape["load"])
    print(
        f"\np={p} m={m}: limit {p / 2:g} microbatches of a stage, bytes per stage "
        f"[{', '.join(f'{b / 1024:.0f} KiB' for b in limit)}]; search {shape['search_s']:.1f} s; "
        f"load average {load}"
    )
    print(
        "measured costs per stage, ms (F, B, I, W, comm): "
        + "; ".join(", ".join(f"{x:.2f}" for x in costs) for costs in shape["costs"])
    )
    print(
        "| candidate | measured ms | simulated ms | measured/simulated | eager ms | "
        "measured/eager | instructions ms | instructions/eager | instructions/eager, one cut | "
        "simulated activations | peak measured / limit bytes (worst stage) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in shape["rows"]:
        ratios = [b / lim for b, lim in zip(row["bytes"], limit) if lim > 0]
        worst = max(range(len(ratios)), key=ratios.__getitem__)
        print(
            f"| {row['name']} | {row['measured']:.2f} | {row['simulated']:.2f} | "
            f"{row['measured'] / row['simulated']:.2f} | {row['eager']:.2f} | "
            f"{row['measured'] / row['eager']:.2f} | {row['span']:.2f} | "
            f"{row['span'] / row['eager']:.2f} | {row['span'] / row['alone']:.2f} | "
            f"{row['activations']:g} | "
            f"{row['bytes'][worst] / 1024:.0f} / {limit[worst] / 1024:.0f} KiB (stage {worst}, "
            f"{ratios[worst]:.2f}) |",
            flush=True,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", nargs="+", type=int, default=[2, 4], help="p values")
    parser.add_argument(
        "--per-stage", nargs="+", type=int, default=[2, 4], help="m = this times p (default 2 4)"
    )
    parser.add_argument("--rounds", type=int, default=10, help="timed steps per candidate")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per candidate")
    parser.add_argument("--trace-steps", type=int, default=5, help="first-run steps measured")
    parser.add_argument("--search-time", type=float, default=10.0, help="search seconds")
    parser.add_argument(
        "--max-builtins", type=int, default=100, help="fastest fitting built-ins timed"
    )
    parser.add_argument(
        "--trace-split",
        action="store_true",
        help="trace zb-h1 after 1F1B, so the costs hold measured I and W",
    )
    parser.add_argument(
        "--eager",
        action="store_true",
        help="also search eagerly (sends that never wait), as `schedcc run --schedule search` "
        "does, and train those orders beside the rendezvous ones",
    )
    parser.add_argument(
        "--quick", action="store_true", help="p=2, m=4, 2 rounds, 2 built-ins: a smoke run"
    )
    opts = parser.parse_args()
    if opts.quick:
        opts.stages, opts.per_stage, opts.rounds, opts.warmup = [2], [2], 2, 1
        opts.trace_steps, opts.search_time, opts.max_builtins = 2, 1.0, 2
    print(stamp("search_measured"))
    for p in opts.stages:
        code = spawn(_worker, p, (opts,), grace=120, threads=1, bind_cores=True)
        if code:
            return code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
