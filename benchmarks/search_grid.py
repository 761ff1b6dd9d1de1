"""`schedcc.search` over a simulated grid, against the best built-in at the same memory limit.

Each shape: p stages, m microbatches, F:B:W costs (B the whole backward, I = B - W), a comm
cost per exchange, one heavy stage (the last 1.5x, or the first 1.3x), and an activation limit
as a fraction of 1F1B's peak (p microbatches of a stage). The best built-in is `schedcc.tune`'s
fastest within the limit over v = 1, 2, with and without full recomputation; the search may
recompute, split the backward, and use either placement. A row prints both makespans, the
lower bound, each one's distance above it, and the search's seconds; the summary counts the
issue's targets: never slower than the best built-in, strictly faster where the built-ins are
more than 3% above the bound, within 3% of the bound.

    .venv/bin/python benchmarks/search_grid.py                  # p = 4, 8 (216 shapes)
    .venv/bin/python benchmarks/search_grid.py --stages 16 --time-limit 10 --ratios 1:2:1 \
        --comms 0.1 --heavy "last 1.5x"                         # 9 shapes at p = 16
    .venv/bin/python benchmarks/search_grid.py --quick          # 12 shapes at p = 4
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import time

from _stamp import stamp

import schedcc
from schedcc import CostModel, ScheduleConfigError

RATIOS = {"1:2:1": (1.0, 2.0, 1.0), "1:1.5:0.8": (1.0, 1.5, 0.8)}
COMMS = (0.0, 0.1, 1.0)
HEAVY = {"last 1.5x": (-1, 1.5), "first 1.3x": (0, 1.3)}
LIMITS = (1.0, 0.6, 0.3)


def costs_of(p: int, ratio: str, comm: float, heavy: str) -> CostModel:
    """The grid's cost model: every stage at `ratio`, one stage scaled by `heavy`."""
    forward, backward, weight = RATIOS[ratio]

    def model(scale: float) -> CostModel:
        return CostModel(
            forward=forward * scale,
            backward=backward * scale,
            backward_input=(backward - weight) * scale,
            backward_weight=weight * scale,
            comm=comm,
        )

    stage, scale = HEAVY[heavy]
    base = model(1.0)
    return CostModel(
        **{
            f: getattr(base, f)
            for f in ("forward", "backward", "backward_input", "backward_weight", "comm")
        },
        per_stage={stage % p: model(scale)},
    )


def run_shape(shape) -> dict:
    p, m, ratio, comm, heavy, fraction, time_limit = shape
    costs = costs_of(p, ratio, comm, heavy)
    limit = fraction * p
    ranked = schedcc.tune(
        num_stages=p,
        num_microbatches=m,
        num_chunks=(1, 2),
        costs=costs,
        memory_limit=limit,
        recompute=(False, True),
    ).ranked
    builtin = ranked[0] if ranked else None
    started = time.monotonic()
    try:
        found = schedcc.search(
            p, m, costs=costs, memory_limit=limit, recompute=True, time_limit=time_limit
        )
    except ScheduleConfigError:
        found = None
    seconds = time.monotonic() - started
    return {
        "shape": shape,
        "builtin": (builtin.schedule, builtin.makespan) if builtin else None,
        "found": (found.makespan, found.bound, found.source) if found else None,
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--time-limit", type=float, default=3.0)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--ratios", nargs="+", default=list(RATIOS), choices=list(RATIOS))
    parser.add_argument("--comms", type=float, nargs="+", default=list(COMMS))
    parser.add_argument("--heavy", nargs="+", default=list(HEAVY), choices=list(HEAVY))
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    shapes = [
        (p, m, ratio, comm, heavy, fraction, args.time_limit)
        for p in args.stages
        for m in (p, 2 * p, 4 * p)
        for ratio, comm, heavy, fraction in itertools.product(
            args.ratios, args.comms, args.heavy, LIMITS
        )
    ]
    if args.quick:
        shapes = [s for s in shapes if s[0] == 4 and s[1] == 8 and s[3] == 0.1][:12]
    print(stamp("search_grid"))
    print(
        f"{'p':>3} {'m':>3} {'F:B:W':>9} {'comm':>4} {'heavy':>10} {'limit':>5} | "
        f"{'best built-in':>24} {'found':>8} {'bound':>8} {'b-in gap':>8} {'gap':>6} "
        f"{'s':>5} | source"
    )
    rows = []
    with multiprocessing.Pool(args.jobs) as pool:
        for row in pool.imap(run_shape, shapes):
            rows.append(row)
            p, m, ratio, comm, heavy, fraction, _ = row["shape"]
            name, builtin = row["builtin"] or ("none fits", float("nan"))
            if row["found"] is None:
                print(
                    f"{p:>3} {m:>3} {ratio:>9} {comm:>4} {heavy:>10} {fraction:>5} | "
                    f"{name:>15} {builtin:>8.2f}   (no order fits)"
                )
                continue
            found, bound, source = row["found"]
            print(
                f"{p:>3} {m:>3} {ratio:>9} {comm:>4} {heavy:>10} {fraction:>5} | "
                f"{name:>15} {builtin:>8.2f} {found:>8.2f} {bound:>8.2f} "
                f"{builtin / bound - 1:>8.1%} {found / bound - 1:>6.1%} {row['seconds']:>5.1f} | "
                f"{source}",
                flush=True,
            )
    summary(rows)


def summary(rows) -> None:
    done = [r for r in rows if r["found"] is not None and r["builtin"] is not None]
    slower = [r for r in done if r["found"][0] > r["builtin"][1] + 1e-9]
    loose = [r for r in done if r["builtin"][1] > 1.03 * r["found"][1]]
    strictly = [r for r in loose if r["found"][0] < r["builtin"][1] - 1e-9]
    close = [r for r in done if r["found"][0] <= 1.03 * r["found"][1]]
    print(
        f"# {len(done)} shapes: slower than the best built-in in {len(slower)}; built-ins > 3% "
        f"above the bound in {len(loose)}, the search strictly faster in {len(strictly)} of "
        f"them; within 3% of the bound in {len(close)} ({len(close) / max(1, len(done)):.0%}); "
        f"search seconds max {max(r['seconds'] for r in rows):.1f}"
    )
    by_limit = {}
    for r in done:
        by_limit.setdefault(r["shape"][5], []).append(r)
    for fraction, group in sorted(by_limit.items(), reverse=True):
        within = sum(r["found"][0] <= 1.03 * r["found"][1] for r in group)
        faster = sum(r["found"][0] < r["builtin"][1] - 1e-9 for r in group)
        print(
            f"#   limit {fraction:g}x 1F1B: {len(group)} shapes, within 3% of the bound "
            f"{within}, faster than the best built-in {faster}"
        )


if __name__ == "__main__":
    main()
