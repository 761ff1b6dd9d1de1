"""Searched orders under per-stage limits in bytes: the heuristic against the exact method.

p = 4, v = 1 and 2 (`--chunks`), a heavy last stage (1.5x) that also holds the largest
activations (an LM head's logits), per-stage parameters and Adam's state; each stage's limit
keeps its parameters, gradients and optimizer state and `--share` of the activation bytes 1F1B
holds on it beyond them (at least one microbatch's, which the last stage always needs). Each
shape is searched with `method="heuristic"` and `method="exact"` ([Note: bytes in the exact
model]), both with `recompute=True` and the same `--time-limit`; the table gives each makespan,
the bound (and where it came from) and how far the exact method's order is above it.

    python benchmarks/search_bytes.py [--time-limit 12] [--microbatches 4 8] [--share 0.6 0.3]
        [--chunks 1 2]
"""

from __future__ import annotations

import argparse

from _stamp import stamp

import schedcc
from schedcc import CostModel, MemoryModel

P = 4
ACTIVATIONS = [100.0, 100.0, 100.0, 300.0]
PARAMETERS = [400.0, 300.0, 300.0, 500.0]
INPUTS = 10.0


def _costs(comm: float) -> CostModel:
    heavy = CostModel(forward=1.5, backward=3.0, backward_input=1.5, backward_weight=1.5, comm=comm)
    memory = MemoryModel(
        activations=ACTIVATIONS,
        parameters=PARAMETERS,
        optimizer=[2 * x for x in PARAMETERS],
        inputs=INPUTS,
    )
    return CostModel(comm=comm, per_stage={P - 1: heavy}, memory=memory)


def _limits(costs: CostModel, m: int, share: float) -> list[float]:
    """Each stage's parameters, gradients and optimizer state, and `share` of the activation
    bytes 1F1B holds beyond them (at least one microbatch's and every input)."""
    peak = schedcc.simulate(schedcc.compile(schedcc.get_schedule("1f1b")(P, m)), costs).peak_bytes
    static = [4 * x for x in PARAMETERS]  # parameters, gradients, Adam's two moments
    return [
        fixed + max(share * (held - fixed), act + INPUTS * m)
        for fixed, held, act in zip(static, peak, ACTIVATIONS)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=12.0)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--share", type=float, nargs="+", default=[0.6, 0.3])
    parser.add_argument("--comm", type=float, nargs="+", default=[0.0, 0.1])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2])
    opts = parser.parse_args()
    print(stamp("search_bytes"))
    print(
        "| m | comm | share | heuristic | exact | bound | from | exact above the bound | "
        "exact's order from | v | exact s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for m in opts.microbatches:
        for comm in opts.comm:
            for share in opts.share:
                costs = _costs(comm)
                found = {
                    method: schedcc.search(
                        P,
                        m,
                        num_chunks=opts.chunks,
                        costs=costs,
                        memory_limit=_limits(costs, m, share),
                        recompute=True,
                        time_limit=opts.time_limit,
                        method=method,
                        seed=0,
                    )
                    for method in ("heuristic", "exact")
                }
                exact = found["exact"]
                gap = exact.makespan / exact.bound - 1
                print(
                    f"| {m} | {comm:g} | {share:g} | {found['heuristic'].makespan:.2f} | "
                    f"{exact.makespan:.2f} | {exact.bound:.2f} | {exact.bound_from} | "
                    f"{gap:.1%} | {exact.source} | {exact.schedule.num_chunks} | "
                    f"{exact.seconds:.1f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
