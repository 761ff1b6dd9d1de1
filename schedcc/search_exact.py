"""`solve_exact`: the optimum of a relaxation of the simulator, by CP-SAT (`schedcc.search`).

The model's optimum is a lower bound on every order's simulated makespan ([Note: the exact
model]); CP-SAT proves a bound on that optimum within its time limit, and its best solution is
an order that `schedcc.search` compiles and simulates like any other. `ortools` is imported
only here, and only when a model is solved: `pip install "schedcc[search]"`.

[Note: the exact model] One CP-SAT model per placement (looped, or V and its waves, any chunks per
stage; eagerly, DualPipe's replicas and overlapped pairs too, [Note: pairs in the exact model])
and memory limit, in integer ticks (every cost rounded down). Its variables:
- an interval per compute: the forward `F` of each microbatch i on each segment k, its
  backward `B`, or `I` then `W` (with a split backward; a whole `B` stays a choice where it
  costs less than `I + W`, else `I` then `W` back to back does what it does no later), and
  with `recompute` an optional `R` between the forward and the backward;
- one no-overlap per stage over its computes;
- the dependencies of each microbatch: its forwards up the segments, the loss turning round on
  the last, its input gradients down; where a dependency crosses stages, a *meeting* time
  `M` no earlier than the producer's end, the consumer starting no earlier than `M` plus the
  receiver's comm, and no other compute of either stage running inside `[M, M + its comm)`
  (nor across `M`, without comm); the meetings of one stage may overlap each other (a comm
  group holds many messages);
- with a memory limit in whole-stage microbatches, a cumulative per stage of capacity
  `N = floor(limit * v)` chunk activations over the intervals each activation is held: from
  its forward (or its `R`) to its last backward piece; with a limit in bytes (a
  `costs.memory`), the same intervals at their bytes, a recomputed forward's input, each
  segment's gradients, beside the parameters and optimizer state ([Note: bytes in the exact
  model]);
- the makespan, no earlier than every compute's end (and than `lower`, a bound given).

It is a relaxation of the rendezvous model the simulator times ([Note: the rendezvous model]
in `schedcc.semantics.units`): take any order of the placement that validates and fits, and
its simulated timeline with every time rounded down to a tick. Each compute keeps its order on
its stage and takes at least its rounded cost. A cross-stage dependency travels by a send after
the producer and a receive before the consumer; with `P` and `Q` the posted times of their two
comm groups and `M = max(P, Q) >= the producer's end`, each group is done no earlier than `M`
plus its stage's comm (a group is done when every partner is posted, plus its comm), and its
stage runs nothing from its posting to its end: no compute of either stage overlaps
`[M, M + comm)` or runs across `M`.
At the start of a compute the activations held in time are those the program holds at it (one
compute at a time per stage), so the cumulative holds whenever the program's peak does. The
makespan (updates and trailing groups included) is no earlier than any compute's end. So every
such order is a solution of the model with its simulated makespan, rounded down: the model's
optimum, and CP-SAT's proven bound on it, is at most every order's makespan. It leaves out
what the rendezvous costs beyond that (a group waiting for partners of other meetings, the
comm groups the compiler places where both stages are not idle, the updates), a weight delay,
and offloads unless asked for: the bound holds for an order with those (but offloads, whose
held count drops, only without the limit, or with them in the model), the model just does not
find them. Overlapped pairs it leaves out unless asked for (eagerly): a pair takes less than
its two computes, so without them the bound is none for an order in pairs.
Orders with a microbatch's forwards out of step are allowed; where every microbatch costs the
same, the forwards on each replica's first segment are taken in microbatch order (relabel any
solution's microbatches by them: the same makespan).

The solution becomes an order: each stage's computes sorted by start, and each crossing's send
and receive at its meeting (`SA3.1` on one stage, `RA3.1` on the other), so the compiler keeps
these comm groups instead of planning its own ([Note: meeting time]). It validates (every pair
meets at one moment, so the walk runs forward in time) and fits the limit (the cumulative is
the program's count). The simulator runs it no later than the model's times: a compute starts
when its stage is free, a comm group is done once every partner group is posted, no later than
the latest of its meetings, plus its comm, before the next compute's start in the model. So
where CP-SAT proves its solution optimal, the simulated makespan is the optimum (per-chunk comm
costs aside: a group costs its first op's).

[Note: the eager exact model] With `eager=True` the model is one of the eager timeline
([Note: eager simulation] in `schedcc.simulate_eager`: sends that never wait, a message in
flight for the receive's comm, no stage's time taken): a crossing has no meeting, its consumer
starts no earlier than the producer's end plus the receiver's comm, and an `O` is issued at its
forward's end (a comm group holds its stage up for nothing). Every order that validates and
fits is a solution with its eager timeline's times, rounded down (each compute at its start,
no two of a stage at once, each after what it needs has arrived), so the optimum bounds every
eager makespan. A solution's order is its computes (and copies) by start, without comm: the
compiler places the groups, which eagerly only say in which order each peer's messages go, and
the eager simulator runs each compute no later than the model does (per-chunk comm costs aside:
the model takes a stage's least), so a proven optimum is the eager makespan
(tests/simulate/test_search_exact.py checks both).

[Note: pairs in the exact model] With `pairs=True` (eager only) the model covers DualPipe's
layouts: model replicas, each microbatch through its own replica's block of segments, and
overlapped pairs (`F3 +B1`, `schedcc.rules.overlap`). Each forward, and each whole backward of
another microbatch on the same stage, may run as one pair: a literal per candidate pair; its
interval on the stage, starting where both computes start and ending for both at the pair's
cost (the forward's, then what the pair's backward takes beyond its own forward,
`overlapped_pair`, and its receive's take, as the simulators price it); and each of the two
runs alone or in exactly one pair (a backward in a pair is whole: it frees its activation at
the pair's end). The forward's output leaves at the pair's end, as the simulators send it, and
both activations are held across the pair. Every order of the layout that validates and fits,
in pairs or not, is then a solution with its eager timeline's times, rounded down (a pair at
its forward's start; `add_hint` reads `F3 +B1` so, and tests/simulate/test_search_exact.py
checks the built-ins' and list scheduling's orders), so the optimum bounds them all; a
solution's order writes each pair as `F3 +B1` at its start. Pairs of one microbatch are left
out: its backward on a stage comes after all its forwards. A layout with a weight delay
(2BW's) is not modelled.

[Note: offloads in the exact model] With `offload=True` and a limit, each activation that is not
recomputed may be offloaded (`schedcc.rules.offload`): a literal; an `O` interval and an `L`
interval on its stage's copy lane (one no-overlap per stage over them, each its copy cost,
`CostModel.offload` and `reload`), the `O` no earlier than where it is issued, the `L` after the
`O`'s end and before the backward's start. An `O` is issued after its forward and, where the
activation crosses to another stage, after the send's comm group is done (its meeting plus the
stage's comm: the device keeps an output until it leaves); the activation is held from its
forward to there and again from the `L`'s start to its last backward piece. It stays a
relaxation: in an order that offloads, the bytes drop where its `O` is issued, no earlier than
that, and come back where its `L` is issued, no later than the reload starts; the copy lane
runs its copies one at a time no earlier than their issue, and a backward waits for its reload.
In the order written from a solution each `O` is placed where it is issued and each `L` where
its copy starts, so that where the simulator keeps the model's times the program holds no more
than the cumulative counts (a reload placed after a compute that was running is issued at that
compute's end: later, holding less, its backward perhaps waiting); the search times the order
and checks its memory again, as every candidate's. Without a limit
there is nothing to offload for and the model has no copies.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence

import attrs

from schedcc.costs import CostModel, overlapped_pair, segment_takes
from schedcc.errors import ScheduleConfigError
from schedcc.ir import (
    Compute,
    Forward,
    Offload,
    OverlappedBackward,
    RecvActivation,
    RecvGrad,
    Reload,
    SendActivation,
    SendGrad,
)
from schedcc.semantics.stage_bytes import resident_parameters
from schedcc.tune import _per_chunk

__all__ = ["ExactSolution", "available", "require_ortools", "solve_exact"]

_INSTALL = 'pip install "schedcc[search]" (or pip install ortools)'


def available() -> bool:
    """Whether CP-SAT (`ortools`) can be imported."""
    try:
        require_ortools()
    except ScheduleConfigError:
        return False
    return True


def require_ortools():
    """ortools's `cp_model` module.

    Raises:
        ScheduleConfigError: ortools is not installed; the message says how to install it.
    """
    try:
        from ortools.sat.python import cp_model
    except ImportError:
        raise ScheduleConfigError(
            f"the exact search needs ortools's CP-SAT solver: {_INSTALL}; or search with "
            "method='heuristic' (--method heuristic)"
        ) from None
    return cp_model


@attrs.frozen
class ExactSolution:
    """What CP-SAT found for one placement ([Note: the exact model]).

    Attributes:
        orders: per stage, the best solution's computes as text (`F3.1`, `I0`, `R2`), or
            None when it found none in time.
        makespan: that solution's makespan in the model (cost units; inf without one).
        bound: the proven lower bound on every order's simulated makespan (cost units).
        optimal: whether CP-SAT proved `makespan` optimal for the model.
        seconds: the solve's wall time.
    """

    orders: tuple[tuple[str, ...], ...] | None
    makespan: float
    bound: float
    optimal: bool
    seconds: float


def solve_exact(
    num_stages: int,
    num_microbatches: int,
    costs: CostModel,
    family,
    *,
    memory_limit: float | Sequence[float] | None = None,
    recompute: bool = False,
    offload: bool = False,
    data_parallel: int = 1,
    zero: int = 0,
    time_limit: float = 1.0,
    hint=None,
    upper: float | None = None,
    lower: float = 0.0,
    num_workers: int = 2,
    seed: int = 0,
    eager: bool = False,
    pairs: bool = False,
) -> ExactSolution:
    """Solve one placement's model ([Note: the exact model]) within `time_limit` seconds.

    Args:
        num_stages, num_microbatches: the shape.
        costs: per-stage costs at v = 1 ([Note: tune's units]).
        family: the placement (`schedcc.search`'s `_Family`: looped, V, or DualPipe's model
            replicas, each microbatch through its own replica's segments); its `split` allows
            split backwards (whole ones stay allowed).
        memory_limit: per stage (a number or one per stage): whole-stage microbatch
            activations, or bytes with a `costs.memory` ([Note: bytes in the exact model]);
            None leaves memory out.
        recompute: allow recomputed forwards (`R`).
        offload: allow offloaded activations (`O` after the forward, `L` before the backward,
            on the stage's copy lane) under a memory limit ([Note: offloads in the exact
            model]).
        data_parallel, zero: what the bytes a stage holds depend on (with `costs.memory`).
        hint: a `Timeline` of an order of this placement, to start from.
        upper: a makespan some order reaches (cost units): solutions above it are cut off,
            and the bound is `upper` where none is below it.
        lower: a makespan no order beats (e.g. `lower_bound`'s), to start the bound from.
        num_workers, seed: CP-SAT's (one worker runs one strategy, and proves far less).
        eager: model the eager timeline (`simulate(..., eager=True)`) instead of the
            rendezvous one ([Note: the eager exact model]).
        pairs: allow overlapped pairs (`F3 +B1`, DualPipe's; [Note: pairs in the exact
            model]); eager only.

    Raises:
        ScheduleConfigError: ortools is not installed (the message says how to install it),
            or `pairs` without `eager`.

    >>> from schedcc.search import _Family
    >>> found = solve_exact(2, 2, CostModel(), _Family(1, False, False), time_limit=5)
    >>> found.makespan, found.bound, found.optimal
    (9.0, 9.0, True)
    """
    if pairs and not eager:
        raise ScheduleConfigError(
            "solve_exact: overlapped pairs are modelled in the eager timeline only (eager=True)"
        )
    cp_model = require_ortools()
    started = time.monotonic()
    built = _Model(cp_model, num_stages, num_microbatches, costs, family, eager=eager, pairs=pairs)
    room = _room(memory_limit, built, costs, data_parallel=data_parallel, zero=zero)
    built.build(room, recompute, upper, lower, offload=offload and room is not None)
    if hint is not None:
        built.add_hint(hint)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.05, float(time_limit))
    solver.parameters.num_workers = num_workers
    solver.parameters.random_seed = seed
    solver.parameters.linearization_level = 2  # scheduling cuts: the bound rises sooner
    status = solver.solve(built.model)
    seconds = time.monotonic() - started
    scale = built.scale
    if status == cp_model.INFEASIBLE:  # nothing at or below `upper`
        return ExactSolution(None, math.inf, built.horizon / scale, False, seconds)
    bound = max(solver.best_objective_bound, built.floor) / scale
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return ExactSolution(None, math.inf, bound, False, seconds)
    return ExactSolution(
        built.orders(solver),
        solver.objective_value / scale,
        bound,
        status == cp_model.OPTIMAL,
        seconds,
    )


@attrs.frozen
class _Room:
    """What the memory part of the model holds a stage to, in integer units: at most
    `capacity[s]` at once, where each held activation of segment k takes `activations[k]`, a
    recomputed forward's input `inputs[k]` until its `R`, and segment k's gradients
    `gradients[k]` from its first weight gradient on ([Note: bytes in the exact model])."""

    capacity: list[int]
    activations: list[int]
    inputs: list[int]
    gradients: list[int]


def _room(memory_limit, built: _Model, costs: CostModel, *, data_parallel: int, zero: int):
    """The `_Room` of `memory_limit` for the model's placement, or None (no limit).

    [Note: bytes in the exact model] Without a `costs.memory` the limit counts whole-stage
    microbatches: a stage cut in v chunks holds `floor(limit * v)` chunk activations, each
    one unit, and a recomputed forward holds nothing until its `R`. With one, the limit is a
    stage's bytes, counted as `schedcc.semantics.stage_bytes` counts them (the simulator's
    `peak_bytes`, which the search holds an order to): its parameters (the resident part under
    ZeRO-3) and optimizer state throughout, taken off the capacity; each held activation's
    bytes, a recomputed forward's input bytes from its forward to its `R`; and without ZeRO-2
    or 3 each segment's gradients from the end of its first weight gradient (`B` or `W`) to
    the end, when the program's step frees them. A unit is a ten-thousandth of the largest
    limit, every size rounded down and the capacity too: at any moment the model holds no more
    than the program does right before or right after the compute running then, so every
    order that fits is a solution and the bound stays a bound; a solution may not fit by the
    rounding, and the search checks every order it times against the bytes.
    """
    if memory_limit is None:
        return None
    p = built.p
    limits = (
        [float(memory_limit)] * p
        if isinstance(memory_limit, (int, float))
        else [float(x) for x in memory_limit]
    )
    n = built.num_segments
    if costs.memory is None:
        capacity = [math.floor(lim * built.share * (1 + 1e-9) + 1e-9) for lim in limits]
        return _Room(capacity, [1] * n, [0] * n, [0] * n)
    memory = _per_chunk(costs, built.share, built.place).memory
    unit = max(limits) / 10_000 or 1.0

    def units(value: float) -> int:
        return math.floor(value / unit + 1e-9)

    static = [0.0] * p
    for k, (stage, _) in enumerate(built.place):
        params = memory.at("parameters", k)
        state = memory.at("optimizer", k)
        static[stage] += resident_parameters(params, zero=zero, data_parallel=data_parallel)
        static[stage] += state / data_parallel if zero >= 1 else state
    return _Room(
        [units(lim * (1 + 1e-9) - static[s]) for s, lim in enumerate(limits)],
        [units(memory.at("activations", k)) for k in range(n)],
        [units(memory.at("inputs", k)) for k in range(n)],
        [units(memory.at("gradients", k)) if zero < 2 else 0 for k in range(n)],
    )


def _scale(values) -> int:
    """Ticks per cost unit: a power of ten giving the largest cost 1,000 to 10,000 ticks."""
    largest = max((v for v in values if v > 0), default=1.0)
    return 10 ** max(0, 4 - math.ceil(math.log10(largest)))


class _Model:
    """The CP-SAT model of one placement ([Note: the exact model]) and its variables."""

    def __init__(
        self, cp_model, p: int, m: int, costs: CostModel, family, *, eager=False, pairs=False
    ):
        self.model = cp_model.CpModel()
        self.p, self.m, self.split = p, m, family.split
        self.eager = eager  # [Note: the eager exact model]
        self.paired = pairs  # [Note: pairs in the exact model]
        self.place = family.segments(p)
        self.share = family.share
        self.num_segments = len(self.place)
        self.seg_of = {sc: k for k, sc in enumerate(self.place)}
        # each model replica's segments are a block; a microbatch runs its replica's
        length = self.num_segments // family.num_replicas
        replica = family.replicas or (0,) * m
        self.blocks = [range(replica[i] * length, (replica[i] + 1) * length) for i in range(m)]
        self.keys = [(i, k) for i in range(m) for k in self.blocks[i]]
        scaled = _per_chunk(costs, family.share, self.place)
        models = [scaled.at(s, c) for s, c in self.place]
        chunks = max(c for _, c in self.place) + 1
        comm = [min(scaled.at(s, c).comm for c in range(chunks)) for s in range(p)]
        factors = [costs.per_microbatch[i] if costs.per_microbatch else 1.0 for i in range(m)]
        self.alike = len(set(factors)) == 1
        fields = ("forward", "backward", "backward_input", "backward_weight")
        every = [getattr(x, f) * a for x in models for f in fields for a in set(factors)]
        copies = [cost for x in models for cost in (x.offload, x.reload)]
        self.scale = _scale(every + comm + copies)

        def tick(value: float) -> int:
            return math.floor(value * self.scale + 1e-9)

        self.tick = tick
        self.comm = [tick(c) for c in comm]
        # what a forward's and a backward's messages from another stage add ([Note: a
        # receive's take] in `schedcc.costs`)
        takes = segment_takes(self.place, models, length)
        self.cost = [
            [
                {
                    "F": tick(x.forward * a + up),
                    "B": tick(x.backward * a + down),
                    "I": tick(x.backward_input * a + down),
                    "W": tick(x.backward_weight * a),
                    "R": tick((x.forward if x.recompute is None else x.recompute) * a),
                    # a pair's backward: what the pair takes beyond its forward
                    "P": tick((overlapped_pair(x) - x.forward) * a + down),
                }
                for x, (up, down) in zip(models, takes, strict=True)
            ]
            for a in factors
        ]
        self.copy = [(tick(x.offload), tick(x.reload)) for x in models]  # copies: unscaled

    # -- building ------------------------------------------------------------------------------

    def build(
        self, room, recompute: bool, upper: float | None, lower: float, *, offload: bool = False
    ) -> None:
        add = self.model
        serial = sum(self.cost[i][k][code] for i, k in self.keys for code in "FBIWR")
        serial += 2 * len(self.keys) * max(self.comm, default=0)
        if offload:
            serial += sum(sum(self.copy[k]) for _, k in self.keys)
        self.horizon = serial if upper is None else min(serial, self.tick(upper))
        self.floor = min(self.tick(lower), self.horizon)
        self.ops = {}  # (code, i, k) -> (start var, size, presence literal or None)
        self.ends = {}  # (code, i, k) -> its end var, where it may run in a pair
        self.overlapped = []  # (literal, forward's key, backward's key, the pair's size)
        self.alone_of = {}  # (code, i, k) -> its literal of running alone, where it may pair
        self.intervals = {}  # (code, i, k) -> its interval variable
        self.spans = {}  # (i, k) -> (backward start, gradient end, last end, whole, recomputed)
        self.held = {}  # (i, k) -> [(held interval's size var, "F" or "R": where it begins)]
        self.makespan = add.new_int_var(self.floor, self.horizon, "makespan")
        self.meetings = []  # (var, producer stage, consumer stage, i, k, j)
        self.sides = []  # (literal: the compute before the meeting, its key, meeting index)
        self.copies = {}  # (i, k) -> (offloaded literal, O's issue, O's start, L's start)
        rec = recompute and room is not None
        for i, k in self.keys:
            self._computes(i, k, rec)
            if offload:
                self._copies(i, k)
        for i in range(self.m):
            self._dependencies(i)
        if offload:
            self._copy_lanes()
        self.on_stage = [[key for key in self.ops if self._stage(key) == t] for t in range(self.p)]
        pair_intervals = self._pairs() if self.paired else [[] for _ in range(self.p)]
        for keys, more in zip(self.on_stage, pair_intervals, strict=True):
            add.add_no_overlap([self._interval(key) for key in keys] + more)
        self._meet()
        if room is not None:
            self._memory(room)
        if self.alike:  # each replica's forwards on its first segment in microbatch order
            for block in {block.start for block in self.blocks}:
                batch = [i for i in range(self.m) if self.blocks[i].start == block]
                for i, j in itertools.pairwise(batch):
                    add.add(self._start("F", i, block) <= self._start("F", j, block))
        add.minimize(self.makespan)

    def _stage(self, key) -> int:
        return self.place[key[2]][0]

    def _op(self, code: str, i: int, k: int, present=None):
        size = self.cost[i][k][code]
        start = self.model.new_int_var(0, max(0, self.horizon - size), f"{code}{i}.{k}")
        self.ops[code, i, k] = (start, size, present)
        return start

    def _start(self, code, i, k):
        return self.ops[code, i, k][0]

    def _end(self, code, i, k):
        if (code, i, k) in self.ends:  # it may run in a pair
            return self.ends[code, i, k]
        start, size, _ = self.ops[code, i, k]
        return start + size

    def _interval(self, key):
        if key not in self.intervals:
            start, size, present = self.ops[key]
            name = "{}{}.{}".format(*key)
            self.intervals[key] = (
                self.model.new_fixed_size_interval_var(start, size, name)
                if present is None
                else self.model.new_optional_fixed_size_interval_var(start, size, present, name)
            )
        return self.intervals[key]

    def _computes(self, i: int, k: int, rec: bool) -> None:
        """The intervals of microbatch i on segment k, and its backward's start, gradient's
        end and last piece's end as `self.spans[i, k]`; with pairs, its forward and whole
        backward each alone or in a pair ([Note: pairs in the exact model])."""
        add, cost = self.model, self.cost[i][k]
        self._op("F", i, k, self._alone("F", i, k))
        whole = None
        if not self.split:
            self._op("B", i, k, self._alone("B", i, k))
            span = (self._start("B", i, k), self._end("B", i, k), self._end("B", i, k))
        elif cost["B"] >= cost["I"] + cost["W"] and not self.paired:
            self._op("I", i, k)
            self._op("W", i, k)
            span = (self._start("I", i, k), self._end("I", i, k), self._end("W", i, k))
        else:  # a whole backward (alone or, with pairs, in one) or its two pieces
            whole = add.new_bool_var(f"whole{i}.{k}")
            alone = self._alone("B", i, k)
            if alone is not None:
                add.add_implication(alone, whole)
            self._op("B", i, k, whole if alone is None else alone)
            self._op("I", i, k, ~whole)
            self._op("W", i, k, ~whole)
            begin, grad, last = (add.new_int_var(0, self.horizon, "") for _ in range(3))
            for var, b_expr, iw_expr in (
                (begin, self._start("B", i, k), self._start("I", i, k)),
                (grad, self._end("B", i, k), self._end("I", i, k)),
                (last, self._end("B", i, k), self._end("W", i, k)),
            ):
                add.add(var == b_expr).only_enforce_if(whole)
                add.add(var == iw_expr).only_enforce_if(~whole)
            span = (begin, grad, last)
        if self.split:
            add.add(self._start("W", i, k) >= self._end("I", i, k))
        add.add(span[0] >= self._end("F", i, k))
        add.add(self.makespan >= span[2])
        recomputed = None
        if rec:
            recomputed = add.new_bool_var(f"rec{i}.{k}")
            self._op("R", i, k, recomputed)
            add.add(self._start("R", i, k) >= self._end("F", i, k)).only_enforce_if(recomputed)
            add.add(span[0] >= self._end("R", i, k)).only_enforce_if(recomputed)
        self.spans[i, k] = (*span, whole, recomputed)

    def _alone(self, code: str, i: int, k: int):
        """With pairs, the literal of `(code, i, k)` running alone, and its end as a variable
        (a pair's end where it runs in one); without, None: it always runs alone."""
        if not self.paired:
            return None
        alone = self.model.new_bool_var(f"alone{code}{i}.{k}")
        end = self.model.new_int_var(0, self.horizon, f"end{code}{i}.{k}")
        self.ends[code, i, k] = end
        self.alone_of[code, i, k] = alone
        return alone

    def _pairs(self) -> list[list]:
        """Per stage, the optional interval of each overlapped pair it may run: a forward and a
        whole backward of another microbatch, starting together and both ending at the pair's
        end ([Note: pairs in the exact model]). Each forward runs alone or in one pair, each
        whole backward too."""
        add = self.model
        out: list[list] = [[] for _ in range(self.p)]
        partners: dict[tuple, list] = {key: [] for key in self.alone_of}
        for t, keys in enumerate(self.on_stage):
            forwards = [key for key in keys if key[0] == "F"]
            backwards = [key for key in keys if key[0] == "B"]
            for f in forwards:
                for b in backwards:
                    if f[1] == b[1]:  # a microbatch's backward follows its forward
                        continue
                    size = self.cost[f[1]][f[2]]["F"] + self.cost[b[1]][b[2]]["P"]
                    x = add.new_bool_var("pair{}{}.{}".format(*f) + "{}{}.{}".format(*b))
                    start = self._start(*f)
                    add.add(self._start(*b) == start).only_enforce_if(x)
                    add.add(self.ends[f] == start + size).only_enforce_if(x)
                    add.add(self.ends[b] == start + size).only_enforce_if(x)
                    out[t].append(add.new_optional_fixed_size_interval_var(start, size, x, ""))
                    partners[f].append(x)
                    partners[b].append(x)
                    self.overlapped.append((x, f, b, size))
        for key, lits in partners.items():
            alone = self.alone_of[key]
            code, i, k = key
            start, size, _ = self.ops[key]
            add.add(self.ends[key] == start + size).only_enforce_if(alone)
            whole = self.spans[i, k][3] if code == "B" else None
            add.add(alone + sum(lits) == (1 if whole is None else whole))
        return out

    def _copies(self, i: int, k: int) -> None:
        """Microbatch i's activation on segment k, offloaded or not ([Note: offloads in the
        exact model]): `O` after its forward, `L` after the `O` and before its backward."""
        add = self.model
        off = add.new_bool_var(f"off{i}.{k}")
        out, back = self.copy[k]
        drop = add.new_int_var(0, self.horizon, f"drop{i}.{k}")  # where the O is issued
        o_start = add.new_int_var(0, max(0, self.horizon - out), f"O{i}.{k}")
        l_start = add.new_int_var(0, max(0, self.horizon - back), f"L{i}.{k}")
        begin, _, _, _, recomputed = self.spans[i, k]
        add.add(o_start >= drop).only_enforce_if(off)
        add.add(l_start >= o_start + out).only_enforce_if(off)
        add.add(begin >= l_start + back).only_enforce_if(off)
        if recomputed is not None:
            add.add_implication(off, ~recomputed)  # a recomputed forward saves nothing
        self.copies[i, k] = (off, drop, o_start, l_start)

    def _copy_lanes(self) -> None:
        """One copy lane per stage: its copies do not overlap each other; and an activation is
        offloaded only after its send left (the device keeps an output until it leaves)."""
        add = self.model
        lanes = [[] for _ in range(self.p)]
        for (_, k), (off, _, o_start, l_start) in self.copies.items():
            out, back = self.copy[k]
            lane = lanes[self.place[k][0]]
            lane.append(add.new_optional_fixed_size_interval_var(o_start, out, off, ""))
            lane.append(add.new_optional_fixed_size_interval_var(l_start, back, off, ""))
        for lane in lanes:
            add.add_no_overlap(lane)
        sent = {(i, k): (meet, s) for meet, s, _, i, k, j in self.meetings if j == k + 1}
        for (i, k), (_, drop, _, _) in self.copies.items():
            ready = [self._end("F", i, k)]
            if (i, k) in sent:  # issued once the send's comm group is done
                meet, s = sent[i, k]
                ready.append(meet + self.comm[s])
            add.add_max_equality(drop, ready)

    def _dependencies(self, i: int) -> None:
        """Microbatch i's forwards up, the turn on the last segment, its gradients down; a
        meeting on each crossing; through its replica's segments."""
        block = self.blocks[i]
        for k in block[:-1]:
            self._link(self._end("F", i, k), self._start("F", i, k + 1), k, k + 1, i)
        for k in block[:0:-1]:
            _, grad, _, _, _ = self.spans[i, k]
            self._link(grad, self.spans[i, k - 1][0], k, k - 1, i)

    def _link(self, ready, consumer, k: int, j: int, i: int) -> None:
        """Segment k's result `ready` feeds segment j's compute starting at `consumer`."""
        s, t = self.place[k][0], self.place[j][0]
        if s == t:
            self.model.add(consumer >= ready)
            return
        if self.eager:  # in flight: no meeting ([Note: the eager exact model])
            self.model.add(consumer >= ready + self.comm[t])
            return
        meet = self.model.new_int_var(0, self.horizon, f"M{i}.{k}.{j}")
        self.model.add(meet >= ready)
        self.model.add(consumer >= meet + self.comm[t])
        self.meetings.append((meet, s, t, i, k, j))

    def _meet(self) -> None:
        """No compute of either stage inside a meeting's `[M, M + comm)` (or at `M`, without
        comm): a literal per meeting and compute but its producer and consumer (the compute
        before the meeting, or after it). Meetings may overlap each other (a comm group holds
        many messages)."""
        add = self.model
        for n, (meet, s, t, i, k, j) in enumerate(self.meetings):
            codes = "F" if j > k else "BI"  # the producer's and the consumer's
            ordered = {(code, i, x) for code in codes for x in (k, j)}
            for stage in (s, t):
                length = self.comm[stage]
                for key in self.on_stage[stage]:
                    if key in ordered:
                        continue
                    start, size, present = self.ops[key]
                    before = add.new_bool_var("")
                    extra = [] if present is None else [present]
                    add.add(start + size <= meet).only_enforce_if([before, *extra])
                    add.add(start >= meet + length).only_enforce_if([~before, *extra])
                    self.sides.append((before, key, n))

    def _memory(self, room: _Room) -> None:
        """Per stage, at most `room.capacity` held at once ([Note: bytes in the exact model]):
        each activation from its forward (or its `R`) to its last backward piece, a recomputed
        forward's input from the forward to its `R`, each segment's gradients from its first
        weight gradient on."""
        add = self.model
        held = [[] for _ in range(self.p)]  # per stage, (interval, demand)
        for (i, k), (_, _, last, _, recomputed) in self.spans.items():
            s = self.place[k][0]
            copied = self.copies.get((i, k))
            if copied is not None:  # held until its O is issued and from its L on, offloaded
                off, drop, _, l_start = copied
                size = add.new_int_var(0, self.horizon, "")
                until = add.new_optional_interval_var(self._start("F", i, k), size, drop, off, "")
                size = add.new_int_var(0, self.horizon, "")
                back = add.new_optional_interval_var(l_start, size, last, off, "")
                held[s] += [(until, room.activations[k]), (back, room.activations[k])]
            if recomputed is None and copied is None:
                size = add.new_int_var(0, self.horizon, "")
                interval = add.new_interval_var(self._start("F", i, k), size, last, "")
                held[s].append((interval, room.activations[k]))
                self.held[i, k] = [(size, "F")]
                continue
            kept = ~recomputed if recomputed is not None else None
            if copied is not None:  # held whole: neither recomputed nor offloaded
                kept = add.new_bool_var("")
                others = [copied[0]] + ([recomputed] if recomputed is not None else [])
                add.add_bool_or([kept, *others])
                for other in others:
                    add.add_implication(kept, ~other)
            options = [("F", kept)] + ([("R", recomputed)] if recomputed is not None else [])
            parts = []
            for code, lit in options:
                size = add.new_int_var(0, self.horizon, "")
                begin = self._start(code, i, k)
                interval = add.new_optional_interval_var(begin, size, last, lit, "")
                held[s].append((interval, room.activations[k]))
                parts.append((size, code))
            self.held[i, k] = parts
            if room.inputs[k] and recomputed is not None:
                size = add.new_int_var(0, self.horizon, "")
                begin, until = self._start("F", i, k), self._start("R", i, k)
                interval = add.new_optional_interval_var(begin, size, until, recomputed, "")
                held[s].append((interval, room.inputs[k]))
        for k in range(self.num_segments):
            batch = [i for i in range(self.m) if k in self.blocks[i]]
            if room.gradients[k] and batch:
                first = add.new_int_var(0, self.horizon, "")
                add.add_min_equality(first, [self.spans[i, k][2] for i in batch])
                size = add.new_int_var(0, self.horizon, "")
                interval = add.new_interval_var(first, size, self.makespan, "")
                held[self.place[k][0]].append((interval, room.gradients[k]))
        for s in range(self.p):
            intervals = [interval for interval, demand in held[s] if demand > 0]
            demands = [demand for _, demand in held[s] if demand > 0]
            add.add_cumulative(intervals, demands, max(room.capacity[s], 0))

    # -- hint and solution ---------------------------------------------------------------------

    def add_hint(self, timeline) -> None:
        """Start from `timeline`'s order: its compute starts, meetings and choices, in ticks
        ([Note: the exact model]: a timeline of the placement is a solution)."""
        starts, posted, copied = {}, {}, {}
        paired = {}  # a pair's backward's key -> its forward's
        forward = [None] * self.p  # each stage's last forward
        for stage, op, start, _ in timeline.events:
            k = self.seg_of.get((stage, getattr(op, "chunk", 0)))
            if k is None:
                return  # another placement
            if type(op) is OverlappedBackward and self.paired and forward[stage] is not None:
                key = ("B", op.microbatch, k)
                paired[key] = forward[stage]
                starts[key] = starts[forward[stage]]  # the pair starts with its forward
            elif isinstance(op, Compute):
                starts[op.code, op.microbatch, k] = self.tick(start)
                if type(op) is Forward:
                    forward[stage] = (op.code, op.microbatch, k)
            elif isinstance(op, (SendActivation, RecvActivation, SendGrad, RecvGrad)):
                posted.setdefault(_transfer(op, k), []).append(self.tick(start))
            elif isinstance(op, (Offload, Reload)):
                copied[op.code, op.microbatch, k] = self.tick(start)
        values = self._hint_computes(starts, paired)
        if values is None:
            return
        for (i, k), (off, _, o_start, l_start) in self.copies.items():
            values[off] = int(("O", i, k) in copied and ("L", i, k) in copied)
            if values[off]:
                values[o_start], values[l_start] = copied["O", i, k], copied["L", i, k]
        for meet, _, _, i, k, j in self.meetings:
            ready = values[self._start("F", i, k)] + self.cost[i][k]["F"]
            kind = "act"
            if j < k:
                kind, ready = "grad", starts.get(("I", i, k), starts.get(("B", i, k)))
                ready += self.cost[i][k]["I" if ("I", i, k) in starts else "B"]
            values[meet] = max([*posted.get((kind, i, k), []), ready])
        for before, key, n in self.sides:
            start = values.get(self.ops[key][0])
            if start is not None:
                values[before] = int(start + self.ops[key][1] <= values[self.meetings[n][0]])
        for var, value in values.items():
            self.model.add_hint(var, value)

    def _hint_computes(self, starts: dict, paired: dict) -> dict | None:
        """Values of the compute variables from `starts` (`(code, i, k)` -> tick; a whole
        backward is split into I then W where the model has no B) and `paired` (a pair's
        backward's key -> its forward's), or None where the order has a compute the model
        lacks (another backward form)."""
        for (code, i, k), start in list(starts.items()):
            if code == "B" and ("B", i, k) not in self.ops:
                del starts[code, i, k]
                starts["I", i, k] = start
                starts["W", i, k] = start + self.cost[i][k]["I"]
        if any(key not in self.ops for key in starts):
            return None
        values, end = {}, {}
        for key, (var, size, present) in self.ops.items():
            if key in starts:
                values[var] = starts[key]
                end[key] = starts[key] + size
            elif present is None:
                return None
        in_pair = {f: b for b, f in paired.items()}
        for x, f, b, size in self.overlapped:
            values[x] = int(paired.get(b) == f)
            if values[x]:
                end[f] = end[b] = starts[f] + size
        for key, alone in self.alone_of.items():
            values[alone] = int(key in starts and key not in paired and key not in in_pair)
            if key in end:
                values[self.ends[key]] = end[key]
        for (i, k), (_, _, _, whole, recomputed) in self.spans.items():
            if whole is not None:
                values[whole] = int(("B", i, k) in starts)
            if recomputed is not None:
                values[recomputed] = int(("R", i, k) in starts)
            last = end["W" if ("W", i, k) in starts else "B", i, k]
            begins = "R" if ("R", i, k) in starts else "F"
            for size, code in self.held.get((i, k), ()):
                if code == begins:
                    values[size] = last - starts[code, i, k]
        values[self.makespan] = max(self.floor, *end.values())
        return values

    def orders(self, solver) -> tuple[tuple[str, ...], ...]:
        """Each stage's present computes by start (`F3.1`, `I0`, `R2`, a pair `F3.1 +B1`), each
        crossing's send and receive at its meeting (`SA3.1`, `RG0`), so the compiler keeps the
        model's comm groups instead of placing its own, and each offloaded activation's `O`
        where it is issued and `L` where its copy starts (`O3.1`, `L3.1`)."""
        rank = {"F": 0, "R": 1, "B": 2, "I": 2, "W": 3}
        rows: list[list] = [[] for _ in range(self.p)]
        for (code, i, k), (start, size, present) in self.ops.items():
            if present is not None and not solver.boolean_value(present):
                continue
            at = solver.value(start)
            stage, chunk = self.place[k]
            rows[stage].append(((at, 1, at + size, rank[code], i), (_text(code, i, chunk),)))
        for x, (_, i, k), (_, j, n), size in self.overlapped:
            if solver.boolean_value(x):  # `F3.1 +B1`: the forward, then its pair's backward
                at = solver.value(self._start("F", i, k))
                stage, chunk = self.place[k]
                texts = (_text("F", i, chunk), _text("+B", j, self.place[n][1]))
                rows[stage].append(((at, 1, at + size, 0, i), texts))
        for n, (meet, s, t, i, k, j) in enumerate(self.meetings):
            at = solver.value(meet)  # before a compute starting then (its consumer)
            send, recv = ("SA", "RA") if j > k else ("SG", "RG")
            rows[s].append(((at, 0, n), (_text(send, i, self.place[k][1]),)))
            rows[t].append(((at, 0, n), (_text(recv, i, self.place[j][1]),)))
        after = len(self.meetings)  # a copy after the sends of its time, before its computes
        for (i, k), (off, drop, _, l_start) in self.copies.items():
            if solver.boolean_value(off):
                stage, chunk = self.place[k]
                for code, issued in (("O", drop), ("L", l_start)):
                    at = solver.value(issued)
                    rows[stage].append(((at, 0, after, code == "L"), (_text(code, i, chunk),)))
        return tuple(tuple(text for _, texts in sorted(row) for text in texts) for row in rows)


def _text(code: str, microbatch: int, chunk: int) -> str:
    return f"{code}{microbatch}.{chunk}" if chunk else f"{code}{microbatch}"


def _transfer(op, k: int) -> tuple[str, int, int]:
    """`(kind, microbatch, producing segment)` of a comm op on segment k."""
    if isinstance(op, SendActivation):
        return "act", op.microbatch, k
    if isinstance(op, RecvActivation):
        return "act", op.microbatch, k - 1
    if isinstance(op, SendGrad):
        return "grad", op.microbatch, k
    return "grad", op.microbatch, k + 1
