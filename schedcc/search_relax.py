"""A stage's time-indexed relaxation: a stronger lower bound where the analytic one is loose.

[Note: the stage relaxation] `lower_bound` ([Note: the lower bound] in
`schedcc.search_bound`) adds what each stage must do in sums: its work, its held time (Little's
law), the stretches where it cannot pair. In overlapped pairs under a limit those sums let a
stage pair and hold at once what no order can: at p = 4, m = 8, 1:2:1, comm 1F, a 1.5x last
stage, 0.6x 1F1B's activations, DualPipe's two replicas are bounded at 36.0 and the best order
takes 39.0. This module bounds one stage s by a linear program over time steps of length `dt`:
the other stages are left out (the stage's inputs arrive as early as `lower_bound`'s heads and
round trips allow), and the stage runs its computes one at a time, holding at most what the
limit holds at every step. A feasible schedule of the whole pipeline gives a feasible point, so
where the program has none within `H` steps, no order ends its last compute (on any stage:
the backwards below stage s's follow them) by `H * dt`, and `(H + 1) * dt` is a bound.

The variables are cumulative counts: `Y[c][t]`, how many computes of class c started by step t
(non-decreasing). The classes: a kept forward of segment k (`FK`), a dropped one (`FD`, with
`recompute`: its activation is not held until its recomputation `R`), a lone backward `B` (and
with a split backward its pieces `I` and `W`), a recomputation `R`, and in overlapped pairs a
pair of a forward of segment a (kept or dropped) with the backward of segment b. Its rows:

- one compute at a time: the classes running at step t, `Y[c][t] - Y[c][t - d_c]`, add to at
  most 1;
- each segment's forwards start no earlier than its inputs can arrive: the n-th at least its
  head ([Note: the lower bound], item 1) and `n - 1` of an earlier segment's forward later (the
  stage before runs them one at a time);
- a backward of segment k starts only after a forward's output (a lone forward's end, a pair's
  end) and k's round trip, and on an activation the stage holds (kept, or recomputed); its n-th
  input comes no sooner than `n - 1` of the pieces above it after the first (their stage runs
  them one at a time);
- the held activations (kept forwards and recomputations begun, less backwards and weight
  gradients ended) take at most the limit at every step (in bytes: each segment's share);
- every count is complete by step H, each backward of segment k by `tail(k)` earlier: its
  output still runs down the segments below k ([Note: the lower bound], item 1).

Rounding keeps it a relaxation: each duration, head and round trip is rounded down to whole
steps, and a schedule's start times rounded down to steps keep every row (a sum of floors is at
most the floor of the sum; a held count at step t is at most the continuous one just before
`(t + 1) * dt`). `dt` is the largest step that divides every duration where the program then
spans at most `MAX_STEPS` steps. Beyond, any step gives a bound, a weaker one the more its
rounding takes away, so `dt` is the step between `high / MAX_STEPS` and twice that which
rounds the stage's durations down least: at 1:1.5:0.8, a 1.3x stage's 0.91, 1.04, 1.3 and 1.95
are all multiples of 0.13, where a multiple of their common 0.01 (0.08 for 27.3) rounds 0.91
down to 0.88 and 1.04 to 0.96. With a split backward the program has no lone `B` where `I`
then `W` take no longer in steps: any point running one runs them in its place, at its start,
in its steps, freeing its activation no later.

It covers what it can prove: every microbatch's factor 1 (the stage's computes cost their
segment's costs); warm-ups, receives' takes and comm groups are left out (less work: still a
relaxation); an order that offloads is bounded without the limit, as `lower_bound` does. At
p = 4, m = 8, comm 1F, a 1.5x last stage, 0.6x, stage 3 of DualPipe's layout needs 39.0: the
order found is optimal (docs/performance.md, "A stage's time-indexed relaxation"). The linear
program is solved by HiGHS's interior point method as `ortools` ships it (`pip install
"schedcc[search]"`; GLOP's simplex where that build lacks HiGHS), one program per step count
tried, binary search between the analytic bound and the best order found. Where the gap
is between stages, every stage's program in one proves more ([Note: the whole pipeline's
relaxation], `relaxed_pipeline_bound`), where it is small enough to solve.
"""

from __future__ import annotations

import math
import time
from fractions import Fraction

from schedcc.costs import overlapped_pair

__all__ = ["MAX_PIPELINE_SIZE", "MAX_STEPS", "relaxed_pipeline_bound", "relaxed_stage_bound"]

#: the most time steps a stage's program spans (a coarser step beyond)
MAX_STEPS = 400

#: the most variables (a count per class and step) of the whole pipeline's program
MAX_PIPELINE_SIZE = 25_000


def relaxed_stage_bound(
    bound, s: int, rooms, recompute: bool, low: float, high: float, deadline: float
) -> float:
    """The least end of the run's last compute in `[low, high]` that stage s's relaxation admits
    ([Note: the stage relaxation]): `low` where it admits that, `high` where it admits nothing
    below it; where time runs out, the least step count not yet refuted (`low` at worst, and
    where the stage is not covered).

    Args:
        bound: the layout's `_Bound` (`schedcc.search_bound`).
        s: the stage.
        rooms: per segment of s, how many of its activations the limit holds at once; None:
            no limit.
        recompute: forwards may be dropped and recomputed.
        low, high: the analytic bound of the stage and the best makespan found.
        deadline: `time.monotonic()` after which no program is started.
    """
    ks = bound.on[s]
    if not ks or high <= low or not _covered(bound):
        return low
    stage = _Stage(bound, ks, rooms, recompute)
    return _least_end(stage, stage.step(high), low, high, deadline)


def relaxed_pipeline_bound(
    bound, rooms, recompute: bool, low: float, high: float, deadline: float
) -> float:
    """As `relaxed_stage_bound`, of every stage's program in one ([Note: the whole pipeline's
    relaxation]): `rooms` per stage (or None), `low` the layout's bound so far; `low` where
    the program would span more than `MAX_PIPELINE_SIZE`."""
    if high <= low or not _covered(bound):
        return low
    pipeline = _Pipeline(bound, rooms, recompute)
    dt = pipeline.step(high)
    if dt <= 0 or pipeline.size(math.ceil(high / dt)) > MAX_PIPELINE_SIZE:
        return low
    return _least_end(pipeline, dt, low, high, deadline)


def _least_end(program, dt: float, low: float, high: float, deadline: float) -> float:
    """The least end in `[low, high]` that `program` (a stage's, or the pipeline's) admits
    on steps of `dt`, by binary search over its step counts; where time runs out, the least
    not yet refuted."""
    if dt <= 0:
        return low
    lo, hi = max(1, math.floor(low / dt)), math.ceil(high / dt)
    if lo >= hi:
        return low
    mid = lo  # the analytic bound's own steps first, then halves
    while lo < hi and time.monotonic() < deadline:
        admits = program.admits(mid, dt, deadline)
        if admits is None:  # out of time: every step count below lo is refuted
            break
        if admits:
            hi = mid
        else:
            lo = mid + 1
        mid = (lo + hi) // 2
    return max(low, min(high, lo * dt))


def _step(durations: list[float], others: list[float], high: float) -> float:
    """The time step: the largest dividing every duration, head and round trip where the
    program then spans at most `MAX_STEPS`; else the step in `[high / MAX_STEPS, 2 * high /
    MAX_STEPS]` that rounds the computes' durations down least (then the heads' and round
    trips'), the larger of two that round alike ([Note: the stage relaxation]: any step
    gives a bound; the less it rounds away, the stronger)."""
    if min(durations + others) < 0 or high <= 0:
        return 0.0
    durations, others = [d for d in durations if d > 0], [v for v in others if v > 0]
    if not durations:
        return 0.0
    common = _common_step(durations + others)
    least = high / MAX_STEPS
    if common is not None and common >= least:
        return common
    candidates = {
        v / n
        for v in set(durations)
        for n in range(max(1, math.ceil(v / (2 * least))), math.floor(v / least) + 1)
    }
    if common is not None:
        candidates.add(common * math.ceil(least / common))
    candidates = [dt for dt in candidates if least <= dt <= 2 * least] or [least]

    def lost(dt: float) -> tuple[float, float, float]:
        def share(values):  # the part of their sum that rounding down to dt loses
            kept = sum(math.floor(v / dt + 1e-9) * dt for v in values)
            return round(1 - kept / sum(values), 9) if values else 0.0

        return share(durations), share(others), -dt

    return min(candidates, key=lost)


def _common_step(values) -> float | None:
    """The largest step dividing every value (on a grid of 1/10,000ths), or None."""
    common = Fraction(0)
    for value in values:
        f = Fraction(value).limit_denominator(10_000)
        if abs(float(f) - value) > 1e-9:
            return None
        common = Fraction(
            math.gcd(common.numerator * f.denominator, f.numerator * common.denominator),
            common.denominator * f.denominator,
        )
    return float(common) if common > 0 else None


def _covered(bound) -> bool:
    """Whether every microbatch's computes cost their segment's costs (the heads and round
    trips of other segments' computes are read too)."""
    return all(least == 1.0 == most for least, most in zip(bound.least, bound.heaviest))


class _Stage:
    """One stage's classes of computes and the rows that tie them."""

    def __init__(self, bound, ks, rooms, recompute: bool):
        self.b, self.ks, self.rooms, self.recompute = bound, ks, rooms, recompute
        models = bound.models
        # class -> its duration (not yet in steps)
        self.classes: dict[tuple, float] = {}
        for k in ks:
            model = models[k]
            self.classes["FK", k] = model.forward
            if recompute:
                self.classes["FD", k] = model.forward
                self.classes["R", k] = bound._redo(k)
            self.classes["B", k] = model.backward
            if bound.split:
                self.classes["I", k] = model.backward_input
                self.classes["W", k] = model.backward_weight
        # per segment, not yet in steps: the head and the spacing of its forwards' inputs
        # (one forward of an earlier segment apart), the round trip, the first backward's
        # input and the spacing of the later ones (one piece above apart), and the tail
        self.times: dict[int, dict[str, float]] = {
            k: {
                "head": bound.head(k),
                "spacing": max((models[j].forward for j in range(bound.first[k], k)), default=0.0),
                "trip": bound.round_trip(k),
                "first": bound._first_backward([k]),
                "gap": max((bound.piece(j) for j in range(k + 1, bound.end[k] + 1)), default=0.0),
                "tail": bound.tail(k),
            }
            for k in ks
        }
        if bound.overlapped:
            for a in ks:  # a pair: the forward's cost, then the backward's rest
                for b in ks:
                    rest = overlapped_pair(models[b]) - models[b].forward
                    for kept in (True, False) if recompute else (True,):
                        self.classes["P", a, kept, b] = models[a].forward + rest

    def step(self, high: float) -> float:
        """The time step of the stage's program up to `high` (`_step`)."""
        return _step(self.durations(), self.others(), high)

    def durations(self) -> list[float]:
        """Its classes' durations (not yet in steps)."""
        return list(self.classes.values())

    def others(self) -> list[float]:
        """Its heads, round trips, spacings and tails."""
        return [v for times in self.times.values() for v in times.values()]

    def admits(self, steps: int, dt: float, deadline: float) -> bool | None:
        """Whether the relaxation has a point whose computes all end by step `steps`; None
        where the solver ran out of time."""
        return _solve(deadline, lambda solver: self.rows(solver, steps, dt))

    def rows(self, solver, steps: int, dt: float) -> _Counts:
        """Add the stage's variables and rows to `solver`, its computes all ended by step
        `steps`; its counts, for rows between stages."""
        b, ks, H = self.b, self.ks, steps

        def down(x: float) -> int:
            return math.floor(x / dt + 1e-9)

        length = {c: down(d) for c, d in self.classes.items()}
        if b.split:  # a lone B is an I then a W that take no longer: the program needs no B
            for k in ks:
                if length["I", k] + length["W", k] <= length["B", k]:
                    del length["B", k]
        Y = {c: [solver.NumVar(0, solver.infinity(), "") for _ in range(H + 1)] for c in length}
        for ys in Y.values():
            for t in range(1, H + 1):
                solver.Add(ys[t] >= ys[t - 1])

        def started(c, t):
            return Y[c][min(t, H)] if t >= 0 else 0

        def ended(c, t):
            return started(c, t - length[c])

        def forward_of(c, k, kept=None) -> bool:
            """Whether class c runs a forward of segment k (kept or dropped, where asked)."""
            if c[0] in ("FK", "FD") and c[1] == k:
                return kept is None or kept == (c[0] == "FK")
            return c[0] == "P" and c[1] == k and (kept is None or kept == c[2])

        def backward_of(c, k, kinds) -> bool:
            """Whether class c runs a backward piece of segment k of `kinds` (or a pair's)."""
            return (c[0] in kinds and c[1] == k) or (c[0] == "P" and c[3] == k)

        forwards = {k: [c for c in length if forward_of(c, k)] for k in ks}
        kept_forwards = {k: [c for c in length if forward_of(c, k, True)] for k in ks}
        dropped_forwards = {k: [c for c in length if forward_of(c, k, False)] for k in ks}
        backwards = {k: [c for c in length if backward_of(c, k, ("B", "I"))] for k in ks}
        frees = {k: [c for c in length if backward_of(c, k, ("B", "W"))] for k in ks}
        steps_of = {
            k: {name: down(v) for name, v in times.items()} for k, times in self.times.items()
        }
        for k in ks:
            n = b.count[k]
            solver.Add(sum(ended(c, H) for c in forwards[k]) == n)
            # a backward's output runs down the segments below it before the run can end
            solver.Add(sum(ended(c, H - steps_of[k]["tail"]) for c in backwards[k]) == n)
            if b.split:
                solver.Add(ended(("W", k), H) == started(("I", k), H))
            if self.recompute:
                solver.Add(started(("R", k), H) == sum(started(c, H) for c in dropped_forwards[k]))
        for t in range(H + 1):
            solver.Add(sum(started(c, t) - started(c, t - d) for c, d in length.items()) <= 1)
            held = []
            for i, k in enumerate(ks):
                # the n-th forward: its head, then one spacing apart
                head, spacing, n = steps_of[k]["head"], steps_of[k]["spacing"], b.count[k]
                if head > 0 or spacing > 0:
                    allowed = (
                        0 if t < head else n if spacing == 0 else min(n, 1 + (t - head) // spacing)
                    )
                    solver.Add(sum(started(c, t) for c in forwards[k]) <= allowed)
                # a backward after a forward's output and the round trip, on a held activation
                trip = steps_of[k]["trip"]
                begun = sum(started(c, t) for c in backwards[k])
                solver.Add(begun <= sum(ended(c, t - trip) for c in forwards[k]))
                if self.recompute:
                    solver.Add(
                        begun
                        <= sum(ended(c, t - trip) for c in kept_forwards[k]) + ended(("R", k), t)
                    )
                    solver.Add(
                        started(("R", k), t) <= sum(ended(c, t) for c in dropped_forwards[k])
                    )
                if b.split:
                    solver.Add(started(("W", k), t) <= ended(("I", k), t))
                # the n-th input gradient: the first, then one gap apart
                gap, first = steps_of[k]["gap"], steps_of[k]["first"]
                if gap > 0:
                    solver.Add(begun <= (0 if t < first else 1 + (t - first) // gap))
                if self.rooms is not None:
                    count = sum(started(c, t) for c in kept_forwards[k])
                    if self.recompute:
                        count += started(("R", k), t)
                    count -= sum(ended(c, t) for c in frees[k])
                    held.append(count * (1.0 / self.rooms[i]))
            if held:
                solver.Add(sum(held) <= 1 + 1e-9)
        return _Counts(started, ended, forwards, backwards)


class _Pipeline:
    """[Note: the whole pipeline's relaxation] Every stage's program in one, on one time
    step: each segment's n-th forward starts no sooner than the segment below's n-th forward
    output and the hop between them, and its n-th backward no sooner than the segment above's
    n-th input gradient and the hop, so the other stages are what they run, not heads and
    round trips. Any order gives a point as it gives one of each stage's (its start times
    rounded down: a sum of floors is at most the floor of the sum); it proves more where the
    gap is between stages. At p = 2, m = 4, 1:2:1, comm 0, a 1.5x last stage, 0.6x 1F1B's
    activations, the V in pairs with split backwards: 19.0, where its busiest stage alone
    proves 18.75 and the sums 17.77 (no order without pairs beats 19.0). Its size is every
    stage's, so it is solved where that stays small (`MAX_PIPELINE_SIZE`)."""

    def __init__(self, bound, rooms, recompute: bool):
        self.b = bound
        self.stages = [
            _Stage(bound, bound.on[s], None if rooms is None else rooms[s], recompute)
            for s in range(bound.p)
            if bound.on[s]
        ]

    def step(self, high: float) -> float:
        durations = [d for stage in self.stages for d in stage.durations()]
        b = self.b  # the hops between a replica's segments, either way
        hops = [
            hop
            for k in range(len(b.place))
            if k > b.first[k]
            for hop in (b.hop(k - 1, k), b.hop(k, k - 1))
        ]
        others = [v for stage in self.stages for v in stage.others()] + hops
        return _step(durations, others, high)

    def size(self, steps: int) -> int:
        """Its variables at `steps`: a count per class and step."""
        return sum(len(stage.classes) for stage in self.stages) * (steps + 1)

    def admits(self, steps: int, dt: float, deadline: float) -> bool | None:
        """Whether the whole pipeline's relaxation has a point whose computes all end by
        step `steps`; None where the solver ran out of time."""
        b = self.b

        def build(solver) -> None:
            counts = {}
            for stage in self.stages:
                rows = stage.rows(solver, steps, dt)
                counts.update(dict.fromkeys(stage.ks, rows))
            for k in range(len(b.place)):
                mine = counts[k]
                below = counts[k - 1] if k > b.first[k] else None
                above = counts[k + 1] if k < b.end[k] else None
                up = math.floor(b.hop(k - 1, k) / dt + 1e-9) if below is not None else 0
                back = math.floor(b.hop(k + 1, k) / dt + 1e-9) if above is not None else 0
                for t in range(steps + 1):
                    if below is not None:  # the n-th forward after the n-th output below
                        solver.Add(
                            mine.begun(mine.forwards[k], t)
                            <= below.done(below.forwards[k - 1], t - up)
                        )
                    if above is not None:  # the n-th backward after the n-th gradient above
                        solver.Add(
                            mine.begun(mine.backwards[k], t)
                            <= above.done(above.backwards[k + 1], t - back)
                        )

        return _solve(deadline, build)


class _Counts:
    """One stage's counts in a program: `started(c, t)`, `ended(c, t)`, and per segment the
    classes that run a forward of it (`forwards`) or an input-gradient piece (`backwards`)."""

    def __init__(self, started, ended, forwards, backwards):
        self.started, self.ended = started, ended
        self.forwards, self.backwards = forwards, backwards

    def begun(self, classes, t: int):
        return sum(self.started(c, t) for c in classes)

    def done(self, classes, t: int):
        return sum(self.ended(c, t) for c in classes)


def _solve(deadline: float, build) -> bool | None:
    """Whether the program `build(solver)` adds has a point; None where time ran out."""
    from ortools.linear_solver import pywraplp

    seconds = deadline - time.monotonic()
    if seconds <= 0:
        return None
    solver = pywraplp.Solver.CreateSolver("HIGHS")
    if solver is not None:  # its interior point: far faster on the whole pipeline's program
        solver.SetSolverSpecificParametersAsString(
            "solver ipm\nrun_crossover off\noutput_flag false"
        )
    else:
        solver = pywraplp.Solver.CreateSolver("GLOP")
    solver.SetTimeLimit(max(1, int(seconds * 1000)))
    build(solver)
    status = solver.Solve()
    if status == pywraplp.Solver.OPTIMAL:
        return True
    if status == pywraplp.Solver.INFEASIBLE:
        return False
    return None
