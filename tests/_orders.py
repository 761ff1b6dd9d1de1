"""Hypothesis strategies for random dependency-respecting compute orders.

`random_orders()` draws a shape (p <= 8, m <= 16, v <= 3, 1-3 batches, looped or V-shape
placement, optionally split backward I + W) and one random interleaving of the computes that
respects the data dependencies, as a `Schedule` whose `order(stage)` returns that order. It is
built by simulating the stages: at every moment some computes are ready (their inputs exist, and
on their stage the optimizer steps they need have their gradients); pick a random one, run it,
release what it unblocks. The compiler's core claim (docs/design.md): every such order validates.

Ordering rules between batches on one stage (the compiler places the step of batch b after the
stage's last weight gradient of batch b):

- a weight gradient (B or W) of batch b comes after every weight gradient of batch b - 1;
- a forward of batch b comes after every weight gradient of batch b - 1 - weight_delay.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from hypothesis import strategies as st

from schedcc import Backward, BackwardInput, BackwardWeight, Forward, Schedule
from schedcc.ir import Compute

__all__ = ["OrderSchedule", "random_order", "random_orders", "shapes"]


class OrderSchedule(Schedule):
    """A schedule that yields a given compute order; `vshape` selects V-shape placement."""

    name = "test-order"
    chunks = "any"

    def __init__(
        self,
        num_stages: int,
        num_microbatches: int,
        num_chunks: int = 1,
        num_batches: int = 1,
        *,
        vshape: bool = False,
        weight_delay: int = 0,
        orders: Sequence[Sequence[Compute]] | None = None,
    ) -> None:
        self.vshape = vshape
        self.weight_delay = weight_delay  # type: ignore[misc]
        self.orders = [list(ops) for ops in orders] if orders is not None else None
        super().__init__(num_stages, num_microbatches, num_chunks, num_batches)

    def placement(self, segment: int) -> tuple[int, int]:
        p = self.num_stages
        chunk, offset = divmod(segment, p)
        if self.vshape and chunk % 2:
            return p - 1 - offset, chunk
        return offset, chunk

    def order(self, stage: int):
        assert self.orders is not None, "set orders before compiling"
        return list(self.orders[stage])

    def __repr__(self) -> str:
        kind = "V" if self.vshape else "looped"
        return f"{super().__repr__()}[{kind}, delay={self.weight_delay}]"


def random_order(schedule: OrderSchedule, rng: random.Random, split: bool) -> list[list[Compute]]:
    """One random dependency-respecting compute order per stage for `schedule`'s shape."""
    p, m = schedule.num_stages, schedule.num_microbatches
    num_segments, delay = schedule.num_segments, schedule.weight_delay
    table = schedule.segment_table()
    where = {k: (s, c) for s, row in enumerate(table) for c, k in enumerate(row)}
    last = num_segments - 1

    # A task is (code, microbatch, segment); deps counts what it still waits for.
    deps: dict[tuple, int] = {}
    after: dict[tuple, list[tuple]] = {}  # what a finished task unblocks
    gate_waiters: dict[tuple[int, int], list[tuple]] = {}  # (stage, batch) -> gated tasks
    grads_left: dict[tuple[int, int], int] = {}  # (stage, batch) -> weight grads to run
    back = "I" if split else "B"

    def need(task: tuple, *before: tuple) -> None:
        deps[task] = deps.get(task, 0) + len(before)
        for b in before:
            after.setdefault(b, []).append(task)

    def gate(task: tuple, stage: int, batch: int) -> None:
        if batch >= 0:
            deps[task] = deps.get(task, 0) + 1
            gate_waiters.setdefault((stage, batch), []).append(task)

    for i in range(schedule.num_microbatches_total):
        batch = i // m
        for k in range(num_segments):
            s = where[k][0]
            need(("F", i, k), *([("F", i, k - 1)] if k > 0 else []))
            gate(("F", i, k), s, batch - 1 - delay)
            need((back, i, k), ("F", i, k), *([(back, i, k + 1)] if k < last else []))
            if split:
                need(("W", i, k), ("I", i, k))
                gate(("W", i, k), s, batch - 1)
            else:
                gate(("B", i, k), s, batch - 1)
            grads_left[s, batch] = grads_left.get((s, batch), 0) + 1

    ready: list[list[tuple]] = [[] for _ in range(p)]
    for task, count in deps.items():
        if count == 0:
            ready[where[task[2]][0]].append(task)
    orders: list[list[Compute]] = [[] for _ in range(p)]
    make = {"F": Forward, "B": Backward, "I": BackwardInput, "W": BackwardWeight}

    def release(task: tuple) -> None:
        deps[task] -= 1
        if deps[task] == 0:
            ready[where[task[2]][0]].append(task)

    while True:
        live = [s for s in range(p) if ready[s]]
        if not live:
            break
        s = rng.choice(live)
        pool = ready[s]
        j = rng.randrange(len(pool))
        pool[j], pool[-1] = pool[-1], pool[j]
        task = pool.pop()
        code, i, k = task
        orders[s].append(make[code](i, where[k][1]))
        for nxt in after.get(task, ()):
            release(nxt)
        if code in ("B", "W"):
            key = (s, i // m)
            grads_left[key] -= 1
            if grads_left[key] == 0:
                for nxt in gate_waiters.get(key, ()):
                    release(nxt)
    assert all(count == 0 for count in deps.values()), "the generator left tasks unrun"
    return orders


@st.composite
def shapes(draw, max_stages: int = 8, max_microbatches: int = 16, max_chunks: int = 3):
    """A schedule shape: (p, m, v, batches, vshape, split)."""
    p = draw(st.integers(1, max_stages))
    m = draw(st.integers(1, max_microbatches))
    v = draw(st.integers(1, max_chunks))
    batches = draw(st.integers(1, 3))
    vshape = draw(st.booleans()) if v > 1 else False
    split = draw(st.booleans())
    return p, m, v, batches, vshape, split


@st.composite
def random_orders(draw, weight_delay: int = 0, **limits) -> OrderSchedule:
    """An `OrderSchedule` holding one random dependency-respecting compute order."""
    p, m, v, batches, vshape, split = draw(shapes(**limits))
    schedule = OrderSchedule(p, m, v, batches, vshape=vshape, weight_delay=weight_delay)
    seed = draw(st.integers(0, 2**32 - 1))
    schedule.orders = random_order(schedule, random.Random(seed), split)
    return schedule
