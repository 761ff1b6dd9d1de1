"""Searched waves: `schedcc.search` at v = 4 in a wave and looped, against interleaved 1F1B.

For each p, m = 2p and 4p, and a comm cost per group (costs 1:2:1, I = W = B / 2, no memory
limit): interleaved 1F1B at v = 4 (the order hand-written waves are measured against), the
fastest built-in over v = 1, 2, 4 (`schedcc.tune`), and `schedcc.search(num_chunks=4)` with
`placement="wave"` (each odd chunk back up the stages, Hanayo's) and `"looped"` (the heuristic,
`--time-limit` seconds each), with the wave's lower bound. Simulated makespans, in forwards.

With `--eager`, every makespan and bound is of the eager timeline (sends that never wait).

    .venv/bin/python benchmarks/search_waves.py [--stages 4 8] [--comms 0 0.1] [--time-limit 5]
        [--eager]
"""

from __future__ import annotations

import argparse

from _stamp import stamp

import schedcc
from schedcc import CostModel


def row(p: int, m: int, comm: float, seconds: float, eager: bool = False) -> str:
    costs = CostModel(comm=comm)
    built = schedcc.tune(
        num_stages=p, num_microbatches=m, num_chunks=[1, 2, 4], costs=costs, eager=eager
    )
    interleaved = min(
        c.makespan for c in built.ranked if (c.schedule, c.num_chunks) == ("interleaved-1f1b", 4)
    )
    best = built.best
    found = {
        place: schedcc.search(
            p,
            m,
            num_chunks=4,
            placement=place,
            costs=costs,
            time_limit=seconds,
            method="heuristic",
            eager=eager,
        )
        for place in ("wave", "looped")
    }
    wave, looped = found["wave"], found["looped"]
    return (
        f"| {p} | {m} | {comm:g} | {interleaved:.2f} | {best.schedule} v={best.num_chunks} "
        f"{best.makespan:.2f} | {wave.makespan:.2f} | {looped.makespan:.2f} | {wave.bound:.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--comms", type=float, nargs="+", default=[0.0, 0.1])
    parser.add_argument("--time-limit", type=float, default=5.0)
    parser.add_argument("--eager", action="store_true", help="time everything eagerly")
    args = parser.parse_args()
    print(stamp("search_waves"), f"eager={args.eager}")
    print(
        "| p | m | comm | interleaved-1f1b v=4 | fastest built-in | search, wave v=4 "
        "| search, looped v=4 | bound (wave) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for p in args.stages:
        for m in (2 * p, 4 * p):
            for comm in args.comms:
                print(row(p, m, comm, args.time_limit, args.eager), flush=True)


if __name__ == "__main__":
    main()
