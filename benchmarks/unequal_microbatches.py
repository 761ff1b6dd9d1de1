"""What unequal microbatches cost a pipeline, simulated: equal sample counts against `balance`.

A batch of variable-length sequences (lengths drawn from a seeded long-tailed distribution, as
packed language-model data has) is cut into `m` microbatches two ways: `m` equal sample counts in
the data's order, and `schedcc.microbatches.balance` (token-balanced, unequal counts). Each
microbatch's compute is taken proportional to its tokens (`CostModel(per_microbatch=...)`, the
factors relative to the mean: attention's quadratic part left out), and each schedule is
simulated (F = 1, B = 2 for a mean microbatch). The table prints the makespan of each split
against the ideal of equal microbatches (the same total work), and the largest microbatch's
tokens over the mean. No torch; seconds on a laptop.

    .venv/bin/python benchmarks/unequal_microbatches.py
"""

from __future__ import annotations

import random

from _stamp import stamp

import schedcc
from schedcc.microbatches import balance

SHAPES = [("1f1b", 4, 8, 1), ("1f1b", 8, 16, 1), ("interleaved-1f1b", 4, 8, 2), ("gpipe", 4, 8, 1)]
SAMPLES_PER_MICROBATCH = 8


def _lengths(count: int, seed: int) -> list[int]:
    """`count` sequence lengths, long-tailed (log-normal), between 16 and 4096 tokens."""
    rng = random.Random(seed)
    return [min(4096, max(16, int(rng.lognormvariate(6.0, 0.8)))) for _ in range(count)]


def _factors(lengths: list[int], groups: list[list[int]]) -> list[float]:
    tokens = [sum(lengths[i] for i in group) for group in groups]
    mean = sum(tokens) / len(tokens)
    return [t / mean for t in tokens]


def _makespan(name: str, p: int, m: int, v: int, factors: list[float] | None) -> float:
    program = schedcc.compile(schedcc.get_schedule(name)(p, m, v))
    costs = schedcc.CostModel(forward=1 / v, backward=2 / v, per_microbatch=factors or ())
    return schedcc.simulate(program, costs).makespan


def main() -> None:
    print(stamp("unequal_microbatches"))
    print("| schedule | p | m | split | largest / mean tokens | makespan | / equal |")
    print("|---|---|---|---|---|---|---|")
    for name, p, m, v in SHAPES:
        lengths = _lengths(m * SAMPLES_PER_MICROBATCH, seed=p * 100 + m)
        size = SAMPLES_PER_MICROBATCH
        in_order = [list(range(j * size, (j + 1) * size)) for j in range(m)]
        ideal = _makespan(name, p, m, v, None)
        for split, groups in (("equal counts", in_order), ("balance", balance(lengths, m))):
            factors = _factors(lengths, groups)
            makespan = _makespan(name, p, m, v, factors)
            print(
                f"| {name} v={v} | {p} | {m} | {split} | {max(factors):.3f} | {makespan:.2f} "
                f"| {makespan / ideal:.3f} |"
            )


if __name__ == "__main__":
    main()
