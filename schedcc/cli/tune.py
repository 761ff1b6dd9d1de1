"""`schedcc tune`: simulate every schedule over a grid of shapes and rank what fits in memory.

For each schedule (every registered one, plus `--schedule` extras), each microbatch count and each
chunk count, tune compiles and simulates the program; a shape the schedule rejects
(`ScheduleConfigError`) is skipped, a program whose peak activations exceed `--memory-limit` is
dropped, and the rest are ranked by simulated time per microbatch (`makespan / m`).

[Note: tune's units] Costs (`--costs`, `--costs-from`) are for one stage's share of the model
with v = 1; with v chunks per stage a chunk runs 1/v of that share, so its compute costs are
divided by v (comm and update costs are not). Activation memory is counted the same way: a
chunk's activations are 1/v of a stage's, so "peak act" is the peak number of held chunk
activations divided by v, in microbatches of a whole stage (1F1B's stage 0 holds p). Ranking by
`makespan / m` compares throughput at a fixed microbatch size, and equally step time at a fixed
global batch when costs scale linearly with the microbatch size.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import attrs

from schedcc.cli import positive_int
from schedcc.cli.show import parse_costs
from schedcc.compiler import compile
from schedcc.errors import ScheduleConfigError, ScheduleError
from schedcc.registry import get_schedule, registered_schedules
from schedcc.schedule import Schedule
from schedcc.simulate import CostModel, simulate

__all__ = ["register", "run", "tune"]

EPILOG = """examples:
  schedcc tune -p 8 --microbatches 8,16,32
  schedcc tune -p 4 --microbatches 8,16 --chunks 1,2 --memory-limit 4 --costs F=1,B=2,I=1,W=1
  schedcc tune -p 4 --microbatches 8 --costs-from trace.json --dp 2 --zero 1 --format json
  schedcc tune -p 4 --microbatches 8 --schedule my_schedules.py:MySchedule
"""

_COMPUTE_FIELDS = ("forward", "backward", "backward_input", "backward_weight")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "tune",
        help="rank every schedule over a grid of shapes under a memory limit",
        description="Simulate every registered schedule (and your own) over a grid of shapes, "
        "drop those over the activation-memory limit and rank the rest by time per microbatch.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "-p",
        "--num-stages",
        "--stages",
        type=positive_int,
        required=True,
        metavar="P",
        help="stages",
    )
    parser.add_argument(
        "--microbatches",
        type=_int_list,
        default=[8],
        metavar="M,...",
        help="microbatch counts to try (default 8)",
    )
    parser.add_argument(
        "--chunks",
        type=_int_list,
        default=[1, 2],
        metavar="V,...",
        help="chunks per stage to try (default 1,2); schedules skip counts they reject",
    )
    parser.add_argument(
        "--memory-limit",
        type=_positive_float,
        default=None,
        metavar="N",
        help="drop programs holding more than N microbatches of one stage's activations",
    )
    parser.add_argument(
        "--costs",
        type=parse_costs,
        default=None,
        metavar="K=V,...",
        help="per-stage costs at v = 1, e.g. F=1,B=2,I=1,W=1,comm=0.1 (chunks get 1/v)",
    )
    parser.add_argument(
        "--costs-from",
        type=Path,
        default=None,
        metavar="TRACE",
        help="measured costs from a Chrome trace of a run (--costs fills kinds it lacks)",
    )
    parser.add_argument("--dp", type=positive_int, default=1, metavar="N", help="data parallel")
    parser.add_argument("--zero", type=int, choices=(0, 1, 2), default=0, help="ZeRO stage")
    parser.add_argument(
        "--schedule",
        action="append",
        default=[],
        metavar="NAME",
        help="also try this schedule (module:Class or path/to/file.py:Class); repeatable",
    )
    parser.add_argument("--format", choices=("table", "json"), default="table")
    parser.set_defaults(func=run)


def _int_list(text: str) -> list[int]:
    values = []
    for part in filter(None, (item.strip() for item in text.split(","))):
        values.append(positive_int(part))
    if not values:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list like 8,16, got {text!r}")
    return sorted(set(values))


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def run(args) -> int:
    costs = _costs(args.costs, args.costs_from)
    report = tune(
        _schedules(args.schedule),
        num_stages=args.num_stages,
        microbatches=args.microbatches,
        chunks=args.chunks,
        costs=costs,
        memory_limit=args.memory_limit,
        data_parallel=args.dp,
        zero=args.zero,
    )
    if args.format == "json":
        print(json.dumps(report, indent=2))
    else:
        print(_table(report))
    return 0 if report["ranked"] else 1


def _costs(given: CostModel | None, trace: Path | None) -> CostModel:
    if trace is None:
        return given or CostModel()
    defaults = {}
    if given is not None:
        defaults = {
            name: value
            for name, value in attrs.asdict(given, recurse=False).items()
            if name not in ("per_stage", "per_chunk")
        }
    return CostModel.from_trace(trace, **defaults)


def _schedules(extra: list[str]) -> dict[str, type[Schedule]]:
    """Registered schedules (one entry per class, under its own name), then the extras."""
    found: dict[str, type[Schedule]] = {}
    by_target: dict[str, list[str]] = {}
    for name, target in sorted(registered_schedules().items()):
        by_target.setdefault(target, []).append(name)
    for names in by_target.values():
        try:
            cls = get_schedule(names[0])
        except ScheduleError:
            continue  # a registered entry whose module is not there: `schedcc list` says why
        found[cls.name if cls.name in names else names[0]] = cls
    for name in extra:
        found[name] = get_schedule(name)
    return dict(sorted(found.items()))


def _per_chunk(costs: CostModel, num_chunks: int) -> CostModel:
    """`costs` with compute costs divided by `num_chunks` (see [Note: tune's units])."""
    if num_chunks == 1:
        return costs
    scaled = {name: getattr(costs, name) / num_chunks for name in _COMPUTE_FIELDS}
    return attrs.evolve(
        costs,
        **scaled,
        per_stage={s: _per_chunk(model, num_chunks) for s, model in costs.per_stage.items()},
        per_chunk={c: _per_chunk(model, num_chunks) for c, model in costs.per_chunk.items()},
    )


def tune(
    schedules: dict[str, type[Schedule]],
    *,
    num_stages: int,
    microbatches: list[int],
    chunks: list[int],
    costs: CostModel,
    memory_limit: float | None = None,
    data_parallel: int = 1,
    zero: int = 0,
) -> dict:
    """Simulate each schedule at each (m, v); returns `{"ranked", "over_limit", "skipped"}`.

    Each ranked row is a dict: schedule, m, v, makespan, time_per_microbatch, bubble,
    peak_activations (max over stages, in stage-microbatches), activations and versions (per
    stage). Rows are sorted by time per microbatch, then peak activations.

    >>> from schedcc.registry import get_schedule
    >>> report = tune({"1f1b": get_schedule("1f1b")}, num_stages=2, microbatches=[4],
    ...               chunks=[1, 2], costs=CostModel())
    >>> [(row["schedule"], row["makespan"]) for row in report["ranked"]]
    [('1f1b', 15.0)]
    """
    ranked, over, skipped = [], [], []
    for name, cls in schedules.items():
        for m in microbatches:
            for v in chunks:
                where = {"schedule": name, "m": m, "v": v}
                try:
                    program = compile(
                        cls(num_stages, m, num_chunks=v), data_parallel=data_parallel, zero=zero
                    )
                except ScheduleConfigError as exc:
                    skipped.append({**where, "reason": str(exc)})
                    continue
                except ScheduleError as exc:
                    skipped.append({**where, "reason": f"invalid: {exc}"})
                    continue
                row = {**where, **_measure(program, _per_chunk(costs, v), v)}
                fits = memory_limit is None or row["peak_activations"] <= memory_limit
                (ranked if fits else over).append(row)
    ranked.sort(key=lambda r: (r["time_per_microbatch"], r["peak_activations"], r["schedule"]))
    return {"ranked": ranked, "over_limit": over, "skipped": skipped}


def _measure(program, costs: CostModel, num_chunks: int) -> dict:
    timeline = simulate(program, costs)
    m = program.schedule.num_microbatches * program.schedule.num_batches
    activations = [round(n / num_chunks, 3) for n in timeline.peak_activations]
    return {
        "makespan": timeline.makespan,
        "time_per_microbatch": timeline.makespan / m,
        "bubble": round(timeline.bubble_fraction, 4),
        "peak_activations": max(activations),
        "activations": activations,
        "versions": list(timeline.peak_versions),
    }


def _table(report: dict) -> str:
    header = (
        "#",
        "schedule",
        "m",
        "v",
        "makespan",
        "per mb",
        "bubble",
        "peak act",
        "act per stage",
        "versions per stage",
    )
    rows = [
        (
            str(rank),
            r["schedule"],
            str(r["m"]),
            str(r["v"]),
            f"{r['makespan']:g}",
            f"{r['time_per_microbatch']:.3f}",
            f"{100 * r['bubble']:.1f}%",
            f"{r['peak_activations']:g}",
            " ".join(f"{n:g}" for n in r["activations"]),
            " ".join(str(n) for n in r["versions"]),
        )
        for rank, r in enumerate(report["ranked"], 1)
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]
    ]
    if not rows:
        lines = ["no schedule fits: every shape was skipped or over the memory limit"]
    if report["over_limit"]:
        dropped = ", ".join(
            f"{r['schedule']} m={r['m']} v={r['v']} ({r['peak_activations']:g})"
            for r in report["over_limit"]
        )
        lines.append(f"over the memory limit: {dropped}")
    if report["skipped"]:
        lines.append(
            f"skipped {len(report['skipped'])} shapes a schedule rejects (--format json lists why)"
        )
    return "\n".join(lines)
