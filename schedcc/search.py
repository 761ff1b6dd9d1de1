"""`search`: find a compute order for a shape, its costs and a memory limit, proven and timed.

`search(p, m, costs=..., memory_limit=...)` builds orders of F/B (or F/I/W) per stage, with
recomputation where memory asks for it, for each placement it is given (looped with one to four
chunks per stage, or a V and, at more chunks, a wave), and keeps the fastest that validates and
fits. Every candidate is a
`FoundOrder` schedule compiled by `schedcc.compile` (so the validator proves it) and timed by
`schedcc.simulate`; a candidate that does not validate or does not fit is dropped.

[Note: the search] Three sources of candidates, all timed by the simulator:
1. every built-in order (`registered_classes`) at each searched chunk count, and with full
   recomputation those that do not fit without it, in their own layout (DualPipe's replicas,
   2BW's delay, 1F1B-offload's offloads and reloads), replayed as `FoundOrder`s (some that
   split their backwards with each `I` and its `W` run as one `B` too: [Note: built-ins with
   whole backwards]): the search starts from the best of what exists, and times them all
   whatever `time_limit` says (an eager search on the quick clock of item 3, the simulator
   timing each layout's fastest); and, while time is left, each that fits only recomputing
   every forward again, with the recomputations its limit does not need dropped on the quick
   clock (`fewer_recomputes`);
2. list scheduling: each stage, whenever it is free, runs the ready compute it ranks first
   (a backward before a forward or the other way round, a weight gradient at once or only in
   gaps, the deeper or the shallower chunk first), under a cap on the microbatches it has in
   flight and under its memory budget: a forward that would not fit keeps only its input and is
   recomputed (`R`) later, when its memory is free, and so is one that would take the room an
   earlier recomputed microbatch needs back before its backward (`_Rule.owed`: no stage holds
   what it cannot free); many rules and seeded ties, ranked by the list scheduler's own clock,
   the best few timed by the simulator (eagerly, only those the quick clock of item 3 times
   fastest: it gives the simulator's makespan, at a fiftieth of the cost). Under a limit the
   rules run again, the best first while time is left, choosing otherwise what to recompute
   (`_variants`: holding whatever fits now, which may get stuck but recomputes less; with
   several chunks a stage, every forward of each stage's lowest chunk, the one held longest;
   a rule that pairs, keeping room for a pair, `_Rule.room_for_pair`, or, while that phase's
   time lasts, pairing on the busiest stages only, `_Rule.busiest_pairs`), and the best few of
   those are timed too. In a layout a built-in runs in overlapped pairs (DualPipe's, each
   replica's microbatches through its own segments; DualPipe-V's V), half the rules also run a
   ready forward and a ready backward as one pair (`F3 +B1`, `_Rule.pairs`).
   List scheduling takes half the time the built-ins leave, evenly over the placements and
   those layouts (at least four rules each), but those whose bound the best order found
   already meets ([Note: hopeless layouts]);
3. local search from the best (then, while time is left, from the best of each other placement
   and layout in turn, and of each layout list scheduling's best order and the best given one
   apart, [Note: a walk from each origin]; each walk taking at most half the time left while
   others wait, and again from each one's best while a round finds a faster order; none from a
   layout that cannot beat the best), until `time_limit` or `max_evaluations`. The climb: two
   adjacent computes of a stage swapped or a recomputation dropped, the stages that idle most
   first, then a compute moved one or two places on every stage that runs it, the first move
   that is faster kept, until none is. With `eager=True` it runs on a quick clock
   (`schedcc.search_local`, [Note: the quick clock]), and from its local optimum an iterated
   local search: random moves (a compute moved up to six places on its stage, or on every stage
   that runs it, a recomputation dropped; in a layout run in overlapped pairs, DualPipe's, a
   pair made or parted, with split backwards its backward joined or split), each kept where
   the clock times it no slower (a lower makespan, or the same with the stages ending earlier
   in sum); after `_PATIENCE` moves without a gain, a few random moves away from the best
   order of the walk (a compute moved, a recomputation added before a backward), until
   `_ROUNDS` such restarts in a row find nothing better. Each order the clock times faster
   than every one timed before is compiled and simulated. In the rendezvous model, whose comm
   groups' waits are not on the clock, the simulator times each move of the climb, and the
   walk follows in the time left, the clock's eager time choosing which orders the simulator
   times; an order with copies only climbs, on the simulator;
4. with `method="exact"`: per placement, CP-SAT's best order for a relaxation of the simulator
   (`schedcc.search_exact`, [Note: the exact model]; with `offload=True`, its offloads too;
   eagerly, and asked for by name, each layout a fitting order runs in overlapped pairs, with
   pairs: [Note: pairs in the exact model]), started from the best order found at that
   placement, in the time left (then local search from it, if it is the best).

With `eager=True` every source times its candidates eagerly (`simulate(..., eager=True)`: sends
that never wait, as the distributed engine runs), list scheduling's clock keeps a send's comm in
flight instead of on its stage, and the bound and the exact model are those of the eager
timeline.

`SearchResult.bound` is `schedcc.search_bound.lower_bound` ([Note: the lower bound] there), the
least over every layout the search may return an order of ([Note: what the bound covers]); with
`method="exact"`, each placement's (and layout's in pairs) is the larger of it and CP-SAT's
proven bound.

[Note: the exact method's rule] `method="auto"` solves the exact model when ortools is
installed, no `max_evaluations` is given (CP-SAT under a time limit does not give the same
answer on every machine) and the largest placement searched has at most `EXACT_MAX_PAIRS`
(microbatch, segment) pairs (p * m * v): beyond that CP-SAT rarely improves on the heuristic
or on `lower_bound` within seconds (docs/performance.md, "Searched orders against the exact
optimum"). The heuristic then gets 70% of `time_limit`, the exact model the rest ([Note: the
exact method's time]); asked for by name (`method="exact"`), the exact model gets 60%. At 3 s a
shape on the eager p = 4 grid, 40% left the heuristic too little at m = 8 (orders up to 15.5%
slower than the heuristic's alone), where 70% finds its orders (at most 1% slower) and keeps
CP-SAT's proven bounds at m = 4 (docs/performance.md, "The grid under the default method").

[Note: the search's offloads] With `offload=True` and a limit, an order that does not fit is
offloaded where a stage is over it, as `compile(offload=ByteLimit(...))` places copies
(`schedcc.passes.insert_offload`): at each point over the stage's budget, the forward held there
that comes back last, until the stage fits or nothing more can go. A stage's budget is its limit
less what else it holds at its peak (parameters, gradients, optimizer state; in whole-stage
microbatches, the limit itself), lowered by what the offloaded order still holds over the limit,
up to three tries. Each is timed with its copies on its stage's copy lane (`CostModel.offload`,
`reload`: free by default, so that an order whose activations can all go fits at its unlimited
makespan), and the one returned is compiled again from its orders with the copies, so that the
written schedule carries them. Every source then adds offloaded orders: the built-ins that do
not fit (once all are timed, the fastest first, while time is left), list scheduling without a
budget and with twice the budget (recomputing where even that is over) beside the one with the
budget, local search (from an offloaded order, its computes moved and the copies placed again;
from one without copies, a move that leaves the limit offloaded), and the exact model, solved
also without the limit at every placement. The bound leaves the memory terms out:
they do not hold for an order that offloads. An order no faster than the best found is not
offloaded: copies only add waits (a stage's order and comm groups are the same with them).
"""

from __future__ import annotations

import heapq
import math
import random
import textwrap
import time
from collections.abc import Iterable, Sequence
from typing import ClassVar

import attrs

from schedcc.compiler import compile, computes
from schedcc.costs import CostModel, overlapped_pair
from schedcc.errors import ScheduleConfigError, ScheduleError
from schedcc.ir import (
    Compute,
    Copy,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
    parse,
)
from schedcc.memory_model import MemoryModel
from schedcc.passes.insert_offload import ByteLimit
from schedcc.program import Program
from schedcc.registry import build_schedule, registered_classes
from schedcc.schedule import Schedule
from schedcc.search_bound import _Bound, closing, lower_bound
from schedcc.search_exact import available, require_ortools, solve_exact
from schedcc.search_local import (
    QuickClock,
    fewer_recomputes,
    held_sizes,
    kick,
    move,
    neighbours,
)
from schedcc.search_relax import relaxed_pipeline_bound, relaxed_stage_bound
from schedcc.simulate import Timeline, simulate
from schedcc.sizes import parse_size
from schedcc.tune import _per_chunk, names_one_cut, other_cut, tied_at_cuts

__all__ = [
    "EXACT_MAX_PAIRS", "MAX_CHUNKS", "METHODS", "PLACEMENTS", "FoundOrder", "LayoutBound",
    "SearchResult", "lower_bound", "placement_name", "search",
]

#: The placements `search` can search: looped (segment k on stage k % p, chunk k // p) and the
#: V (two chunks: down the stages and back up, as zb-v; at more chunks a wave, each odd chunk
#: back up: Hanayo's at v = 4).
PLACEMENTS = ("looped", "v")
#: The most chunks per stage `search` builds orders for (`num_chunks`).
MAX_CHUNKS = 4
#: How `search` finds orders: "heuristic" ([Note: the search], 1-3), "exact" (and CP-SAT, 4), or
#: "auto" ([Note: the exact method's rule]).
METHODS = ("auto", "heuristic", "exact")
#: The most (microbatch, segment) pairs of one placement for which "auto" solves the exact model.
EXACT_MAX_PAIRS = 64
_EXACT_WORKERS = 2  # CP-SAT's workers
_LISTED = "list scheduling"  # the source of an order list scheduling made
_PATIENCE = 1000  # local search's moves on the quick clock without a gain before a restart
_ROUNDS = 20  # and its restarts in a row without a better order before it stops
#: The heuristic's share of the time where the exact model is solved too, by the method asked
#: for ([Note: the exact method's rule]).
_HEURISTIC_SHARE = {"exact": 0.4, "auto": 0.7}
#: Under "auto", the seconds CP-SAT needs before the models in pairs are solved too ([Note: the
#: exact model's pairs] in `_Searcher.exact`).
_PAIRED_SECONDS = 2.0
#: Under `_Rule.busiest_pairs`, the stages that pair: those whose computes, run alone, take at
#: least this share of the most any stage's take.
_BUSIEST = 0.97


class FoundOrder(Schedule):
    """Base of a schedule that replays a fixed compute order (what `schedcc.search` writes).

    A subclass sets `shape = (p, m, v)`, `vshape` (the V placement, or at more chunks a wave:
    chunk c runs down the stages for even c and back up for odd; else looped) and `orders`,
    one string per stage of instructions as `schedcc.ir.parse` reads them (`F3.1`, `I0`, `R2`, `O2`,
    ...) for one batch; each further batch replays it on its own microbatches.

    >>> class Mine(FoundOrder):
    ...     shape = (2, 2, 1)
    ...     orders = ("F0 F1 B0 B1", "F0 B0 F1 B1")
    >>> [str(op) for op in Mine(2, 2, num_batches=2).order(1)]
    ['F0', 'B0', 'F1', 'B1', 'F2', 'B2', 'F3', 'B3']
    """

    name = "found"
    shape: ClassVar[tuple[int, int, int]] = (1, 1, 1)
    vshape: ClassVar[bool] = False
    orders: ClassVar[tuple[str, ...]] = ()
    #: `(stage, chunk)` of each segment, where neither looped nor the V (empty: `vshape`).
    places: ClassVar[tuple[tuple[int, int], ...]] = ()
    #: The model replica of each microbatch of a batch ([Note: replicas]; empty: all 0).
    replicas: ClassVar[tuple[int, ...]] = ()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.chunks = (cls.shape[2],)  # the one v it was found for (and so its default)

    def check(self) -> None:
        shape = (self.num_stages, self.num_microbatches, self.num_chunks)
        if shape != tuple(self.shape):
            p, m, v = self.shape
            raise ScheduleConfigError(
                f"{type(self).__name__} is an order found for p={p}, m={m}, v={v}, not p="
                f"{shape[0]}, m={shape[1]}, v={shape[2]}; run schedcc search at that shape"
            )
        if len(self.orders) != self.num_stages:
            raise ScheduleConfigError(
                f"{type(self).__name__}.orders has {len(self.orders)} stages, shape says "
                f"{self.num_stages}"
            )

    def placement(self, segment: int) -> tuple[int, int]:
        if self.places:
            return tuple(self.places[segment])
        p = self.num_stages
        chunk, offset = divmod(segment, p)
        if self.vshape and chunk % 2:
            return p - 1 - offset, chunk
        return offset, chunk

    def replica_of(self, microbatch: int) -> int:
        return self.replicas[microbatch] if self.replicas else 0

    def order(self, stage: int):
        ops = [parse(text) for text in self.orders[stage].split()]
        for batch in range(self.num_batches):
            offset = batch * self.num_microbatches
            yield from (attrs.evolve(op, microbatch=op.microbatch + offset) for op in ops)


@attrs.frozen
class LayoutBound:
    """One layout's lower bound (`SearchResult.layout_bounds`).

    Attributes:
        layout: its placement: "looped", "V", "wave", "two replicas" (DualPipe's), "a
            weight delay" (2BW's) or "its own placement" (a built-in's), at `num_chunks`.
        num_chunks: chunks per stage.
        split: its backwards split into `I` and `W` (else whole `B`s).
        pairs: its forwards and backwards may run as overlapped pairs.
        offloads: its orders may offload activations, so it is bounded without the limit.
        bound: no order of the layout is faster ([Note: the lower bound]).
        bound_from: "lower_bound", "CP-SAT" (the exact model's proven bound) or
            "relaxation" (a stage's time-indexed relaxation: [Note: the stage relaxation]).
    """

    layout: str
    num_chunks: int
    split: bool
    pairs: bool
    offloads: bool
    bound: float
    bound_from: str = "lower_bound"

    def __str__(self) -> str:
        kind = [f"{self.layout} v={self.num_chunks}", "F/I/W" if self.split else "F/B"]
        kind += ["in pairs"] if self.pairs else []
        kind += ["offloading"] if self.offloads else []
        return f"{' '.join(kind)} {self.bound:g}"


@attrs.frozen(eq=False)
class SearchResult:
    """What `search` found.

    Attributes:
        schedule: the found order, a `FoundOrder` instance at the searched shape.
        program: it compiled (validated).
        timeline: it simulated under the costs (per chunk, as `schedcc.tune` scales them).
        bound: the lower bound on the makespan ([Note: the lower bound]).
        source: where the order came from: a built-in's name, "list scheduling", and
            "+ local search" when that improved it.
        evaluations: how many candidates the simulator timed.
        seconds: how long the search took.
        bound_from: which bound `bound` is: "lower_bound" ([Note: the lower bound]),
            "CP-SAT" (the exact model's proven bound, [Note: the exact model]) or
            "relaxation" (a stage's time-indexed relaxation, `search(..., prove=...)`).
        method: "heuristic" or "exact" (what "auto" chose).
        eager: whether `timeline` and `bound` are of the eager timeline (sends that never
            wait, as the distributed engine runs) rather than the rendezvous one.
        layout_bounds: the bound of each layout the search may return an order of, the least
            first (`bound` is the first's): how fast any order of that layout can be, so
            where the least is of a layout in overlapped pairs, the first without them says
            what no order without pairs beats ([Note: what the bound covers]).
    """

    schedule: FoundOrder
    program: Program
    timeline: Timeline
    bound: float
    source: str
    evaluations: int
    seconds: float
    bound_from: str = "lower_bound"
    method: str = "heuristic"
    eager: bool = False
    layout_bounds: tuple[LayoutBound, ...] = ()

    @property
    def makespan(self) -> float:
        return self.timeline.makespan

    @property
    def gap(self) -> float:
        """How far above the bound the makespan is, as a fraction (0.03: 3% above)."""
        return self.makespan / self.bound - 1 if self.bound > 0 else 0.0

    @property
    def without_pairs(self) -> float | None:
        """Where the bound is of a layout in overlapped pairs, the least bound of a layout
        without them: what no order without pairs beats (`layout_bounds`); else None."""
        if not self.layout_bounds or not self.layout_bounds[0].pairs:
            return None
        return min((b.bound for b in self.layout_bounds if not b.pairs), default=None)

    @property
    def peak_bytes(self) -> tuple[float, ...] | None:
        """Per stage, the most bytes held at once (None without a memory model)."""
        return self.timeline.peak_bytes if self.timeline.costs.memory is not None else None

    @property
    def peak_activations(self) -> tuple[float, ...]:
        """Per stage, the most microbatch activations held, in whole-stage microbatches."""
        share = self.schedule.num_chunks // type(self.schedule).num_replicas
        return tuple(round(n / share, 3) for n in self.timeline.peak_activations)

    def to_python(self, class_name: str = "Found") -> str:
        """A short Python file defining `class_name`, a `FoundOrder` replaying this order."""
        schedule = self.schedule
        p, m, v = schedule.shape
        kind = placement_name(type(schedule))
        timed = " (eager: sends that never wait)" if self.eager else ""
        alone = self.without_pairs
        beats = "" if alone is None else f"; no order without overlapped pairs beats {alone:g}"
        lines = [
            f'"""An order found by schedcc search: p={p}, m={m}, v={v} ({kind} placement).',
            "",
            f"Simulated makespan{timed} {self.makespan:g}, lower bound {self.bound:g} "
            f"({self.gap:.1%} above it{beats}); from {self.source}.",
            f"Check it with: schedcc verify --schedule THIS_FILE.py:{class_name} -p {p} -m {m}"
            f" -v {v}",
        ]
        if self.eager:
            lines.append(
                f"Draw it as it was timed: schedcc show --schedule THIS_FILE.py:{class_name} "
                "--eager"
            )
        lines += [
            '"""',
            "",
            "from schedcc.search import FoundOrder",
            "",
            "",
            f"class {class_name}(FoundOrder):",
            f'    """Found by schedcc search for p={p}, m={m}, v={v}: makespan '
            f'{self.makespan:g} (bound {self.bound:g})."""',
            "",
            f'    name = "{class_name.lower()}"',
            f"    shape = ({p}, {m}, {v})",
            f"    vshape = {schedule.vshape}",
        ]
        if schedule.places:
            lines += [
                f"    places = {tuple(schedule.places)}",
                f"    replicas = {tuple(schedule.replicas)}",
                f"    num_replicas = {type(schedule).num_replicas}",
                f"    weight_delay = {type(schedule).weight_delay}",
            ]
        lines += [
            "    orders = (",
        ]
        for stage, text in enumerate(schedule.orders):
            lines.append(f"        # stage {stage}")
            pieces = textwrap.wrap(text, 80, break_on_hyphens=False) or [""]
            for n, piece in enumerate(pieces):
                end = " " if n + 1 < len(pieces) else ""
                lines.append(f'        "{piece}{end}"')
            lines[-1] += ","
        lines.append("    )")
        return "\n".join(lines) + "\n"


def placement_name(cls: type[FoundOrder]) -> str:
    """How a found order places its segments: "looped", "V", "wave" (a V at more chunks),
    "two replicas" (DualPipe's), "a weight delay" (2BW's) or "its own placement" (another
    built-in's, replayed)."""
    return _placement(cls.places, cls.num_replicas, cls.weight_delay, cls.vshape, cls.shape[2])


def _layout_name(family: _Family) -> str:
    """`placement_name` of a search's layout (`LayoutBound.layout`)."""
    return _placement(
        family.places, family.num_replicas, family.weight_delay, family.vshape, family.num_chunks
    )


def _placement(places, num_replicas: int, weight_delay: int, vshape: bool, chunks: int) -> str:
    """The name `placement_name` gives a found order's class and `_layout_name` a layout."""
    if places:
        if num_replicas > 1:
            return "two replicas"
        return "a weight delay" if weight_delay else "its own placement"
    if not vshape:
        return "looped"
    return "V" if chunks == 2 else "wave"


def search(
    num_stages: int,
    num_microbatches: int,
    *,
    num_chunks: int | Iterable[int] = (1, 2),
    placement: str | Iterable[str] = PLACEMENTS,
    costs: CostModel | None = None,
    memory: MemoryModel | None = None,
    memory_limit: float | str | Sequence | None = None,
    split_backward: bool | Iterable[bool] = (False, True),
    recompute: bool = False,
    offload: bool = False,
    data_parallel: int = 1,
    zero: int = 0,
    tied: Iterable[Iterable[int]] = (),
    grad_norm: bool = False,
    builtins: bool = True,
    start: Iterable[type[Schedule]] = (),
    time_limit: float = 10.0,
    max_evaluations: int | None = None,
    seed: int = 0,
    method: str = "auto",
    eager: bool = False,
    prove: float = 0.0,
) -> SearchResult:
    """The fastest order found for this shape, its costs and memory limit ([Note: the search]).

    Args:
        num_stages, num_microbatches: the shape `p`, `m` (one batch; the order replays per
            batch).
        num_chunks: chunks per stage to try (1 to `MAX_CHUNKS`, one or several).
        placement: "looped", "v" (the V at two chunks per stage, a wave beyond: chunk c runs
            down the stages for even c and back up for odd, Hanayo's W at v = 4; "wave" says
            the same), or both; "v" applies to v >= 2 only.
        costs: per-stage costs at v = 1, as `schedcc.tune` takes them ([Note: tune's units]: a
            chunk of two costs half); `CostModel.per_stage` for unequal stages,
            `CostModel.per_segment` for unequal segments (each its own in any placement, [Note:
            segment costs]), `CostModel.from_trace` for measured ones (both).
        memory: the bytes per stage at v = 1 ([Note: tune's units]), or measured per segment
            (`MemoryModel.from_trace`, `measure_memory`: then only orders of the cut they were
            measured on are searched, [Note: a measured cut]); default `costs.memory`.
        memory_limit: per stage (a number, or one per stage): with a memory model, the most
            bytes each stage may hold (`Timeline.peak_bytes`; sizes such as "12GiB" too);
            without one, the most microbatch activations, in whole-stage microbatches (1F1B's
            stage 0 holds p). None: no limit.
        split_backward: orders of F/B (False), F/I/W (True) or both.
        recompute: let the search recompute forwards (`R`) where memory asks for it, and try
            the built-ins with full recomputation.
        offload: let the search offload activations to host memory (`O` after a forward, `L`
            ahead of its backward, on the stage's copy lane, priced by `CostModel.offload` and
            `reload`) where an order does not fit the limit ([Note: the search's offloads]).
        data_parallel, zero: as in `schedcc.compile`.
        tied, grad_norm: as in `schedcc.compile`, for every order timed: the collectives that
            sum a tied group's gradients (`ReduceTied`) and take the global gradient norm
            (`GradNorm`) cost what `costs.reduce` and `costs.norm` say, as in the run they
            stand for. Searching several cuts (v = 1 and 2), name segments that hold at every
            cut: 0 the first, -1 the last (`[(0, -1)]` an LM head tied to the embedding).
        builtins: start from the built-in orders at the same placement.
        start: more schedule classes to start from (e.g. an order found before, to improve
            it); those with another placement or shape are left out.
        time_limit: seconds the search may take beyond timing the built-ins (it stops before
            a candidate that might not finish in time).
        max_evaluations: stop after this many simulated candidates too (for a search that must
            give the same answer on every machine).
        seed: the seed of the ties' random order (and CP-SAT's).
        method: "heuristic", "exact" (also CP-SAT's optimum of a relaxation per placement,
            [Note: the exact model]; needs `pip install "schedcc[search]"`) or "auto" (exact
            where it helps: [Note: the exact method's rule]).
        eager: time every candidate as the distributed engine runs it on every transport,
            sends that never wait (`simulate(..., eager=True)`, [Note: eager simulation]), and
            bound that timeline ([Note: the lower bound], [Note: the eager exact model]);
            default: the rendezvous model the validator proves (a comm group takes its stage's
            time once its partners are posted).
        prove: seconds more, after the search, to raise the lower bound by a time-indexed
            linear relaxation of each stage ([Note: the stage relaxation] in
            `schedcc.search_relax`), the least layouts' first, then where time remains and
            it is small, of the whole pipeline ([Note: the whole pipeline's relaxation]);
            needs `pip install "schedcc[search]"`. 0: the analytic bound (and CP-SAT's)
            only.

    Returns:
        A `SearchResult`: the schedule, its program and timeline, and the lower bound.

    Raises:
        ScheduleConfigError: a bad argument, no order fits the memory limit (the message
            says the least that fits, where one was found), or "exact" or `prove` without
            ortools.

    >>> import schedcc
    >>> result = schedcc.search(2, 4, num_chunks=1, split_backward=False, time_limit=5)
    >>> result.makespan, result.bound
    (15.0, 15.0)
    """
    started = time.monotonic()
    costs = CostModel() if costs is None else costs
    if not isinstance(costs, CostModel):
        raise ScheduleConfigError(f"search: costs must be a CostModel, got {costs!r}")
    if memory is not None:
        if not isinstance(memory, MemoryModel):
            raise ScheduleConfigError(f"search: memory must be a MemoryModel, got {memory!r}")
        costs = attrs.evolve(costs, memory=memory)
    for arg, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleConfigError(f"search: {arg} must be a positive integer, got {value!r}")
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
        raise ScheduleConfigError(f"search: data_parallel must be >= 1, got {data_parallel!r}")
    if zero not in (0, 1, 2, 3) or isinstance(zero, bool):
        raise ScheduleConfigError(f"search: zero must be 0, 1, 2 or 3, got {zero!r}")
    flags = (("recompute", recompute), ("offload", offload), ("eager", eager))
    for arg, value in (*flags, ("grad_norm", grad_norm)):
        if not isinstance(value, bool):
            raise ScheduleConfigError(f"search: {arg} must be True or False, got {value!r}")
    if max_evaluations is not None and (
        isinstance(max_evaluations, bool)
        or not isinstance(max_evaluations, int)
        or max_evaluations < 1
    ):
        raise ScheduleConfigError(
            f"search: max_evaluations must be a positive integer or None, got {max_evaluations!r}"
        )
    if not isinstance(time_limit, (int, float)) or not 0 < time_limit < math.inf:
        raise ScheduleConfigError(f"search: time_limit must be seconds > 0, got {time_limit!r}")
    if isinstance(prove, bool) or not isinstance(prove, (int, float)) or not 0 <= prove < math.inf:
        raise ScheduleConfigError(f"search: prove must be seconds >= 0, got {prove!r}")
    if prove > 0:
        require_ortools()
    limits = _limits(memory_limit, num_stages, costs.memory is not None)
    families = _families(num_stages, num_chunks, placement, split_backward)
    cuts = sorted({num_stages * family.share for family in families})
    tied = tied_at_cuts(tied, cuts, "search")  # one cut, where an index is above 0
    sized = _sized(families, num_stages, costs.memory)
    chosen = _method(method, num_stages, num_microbatches, families, max_evaluations)
    share = 1.0 if chosen == "heuristic" else _HEURISTIC_SHARE[method]  # the heuristic's time
    # the larger models in pairs where asked for, or given time ([Note: the exact model's pairs])
    paired = method == "exact" or (1 - share) * time_limit >= _PAIRED_SECONDS
    method = chosen
    searcher = _Searcher(
        num_stages,
        num_microbatches,
        costs,
        limits,
        recompute,
        offload,
        data_parallel,
        zero,
        started + share * time_limit,
        max_evaluations,
        random.Random(seed),
        eager=eager,
        tied=tied,
        grad_norm=grad_norm,
        tied_cut=cuts[0] if names_one_cut(tied) else None,
    )
    seeds = _seeds(start) + (list(registered_classes().items()) if builtins else [])
    searcher.seed(seeds, families, recomputed=False)
    if recompute:
        searcher.seed(seeds, families, recomputed=True)
    for recomputed in (False, True) if recompute else (False,):  # [Note: built-ins with whole
        searcher.seed(seeds, families, recomputed=recomputed, whole=True)  # backwards]
    searcher.offload_seeds()
    if recompute:
        searcher.fewer_recomputes(share=0.2)
    # half the time left, evenly over the placements and the layouts run in overlapped pairs
    # (DualPipe's) that might beat the best found
    layouts = searcher.paired_layouts()  # {family: one order of it in pairs}
    todo = [(f, layouts.pop(f, ())) for f in sized] + list(layouts.items())
    todo = [(family, pairs) for family, pairs in todo if not searcher.hopeless(family, pairs)]
    for k, (family, pairs) in enumerate(todo):
        if not searcher.hopeless(family, pairs):
            searcher.list_schedule(family, share=1 / (2 * len(todo) - k), pairs=bool(pairs))
    searcher.improve()
    if method == "exact" and searcher.best is not None:
        left = max(started + time_limit - time.monotonic(), 0.25 * time_limit)
        searcher.exact(sized, time.monotonic() + left, seed, pairs=paired)
    best = searcher.final()
    if best is None:
        raise ScheduleConfigError(searcher.nothing_fits())
    bounds = searcher.bounds(sized, time.monotonic() + prove if prove > 0 else None)
    return SearchResult(
        schedule=best.program.schedule,
        program=best.program,
        timeline=best.timeline,
        bound=bounds[0].bound,
        source=best.source,
        evaluations=searcher.evaluations,
        seconds=time.monotonic() - started,
        bound_from=bounds[0].bound_from,
        method=method,
        eager=eager,
        layout_bounds=tuple(bounds),
    )


def _method(method, p: int, m: int, families, max_evaluations) -> str:
    """"heuristic" or "exact" ([Note: the exact method's rule])."""
    if method not in METHODS:
        raise ScheduleConfigError(
            f"search: method must be one of {', '.join(METHODS)}, got {method!r}"
        )
    if method == "exact":
        require_ortools()
        return method
    if method == "heuristic" or max_evaluations is not None:
        return "heuristic"
    pairs = p * m * max(f.num_chunks for f in families)
    # ortools imported only where the exact model may serve (its import takes about 0.3 s of
    # the search's time)
    return "exact" if pairs <= EXACT_MAX_PAIRS and available() else "heuristic"


def _seeds(start) -> list[tuple[str, type[Schedule]]]:
    classes = [start] if isinstance(start, type) else list(start)
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, Schedule)):
            raise ScheduleConfigError(
                f"search: start takes Schedule subclasses (e.g. get_schedule('my.py:Found')), "
                f"got {cls!r}"
            )
    return [(cls.name or cls.__name__, cls) for cls in classes]


@attrs.frozen
class _Family:
    """A placement and a backward form: the kind of order one search branch builds (or, with
    `places`, the layout of a built-in it starts from: its placement, replicas, weight delay)."""

    num_chunks: int
    vshape: bool
    split: bool
    places: tuple[tuple[int, int], ...] = ()
    replicas: tuple[int, ...] = ()
    num_replicas: int = 1
    weight_delay: int = 0

    @classmethod
    def of(cls, schedule: Schedule, split: bool) -> _Family:
        """The layout of `schedule` (a built-in at the searched shape)."""
        k = range(schedule.num_segments)
        return cls(
            schedule.num_chunks,
            False,
            split,
            places=tuple(tuple(schedule.placement(i)) for i in k),
            replicas=tuple(schedule.replica_of(i) for i in range(schedule.num_microbatches)),
            num_replicas=type(schedule).num_replicas,
            weight_delay=type(schedule).weight_delay,
        )

    @property
    def share(self) -> int:
        """The chunks of one model replica per stage ([Note: tune's units])."""
        return self.num_chunks // self.num_replicas

    def segments(self, num_stages: int) -> list[tuple[int, int]]:
        """`(stage, chunk)` of each segment."""
        if self.places:
            return list(self.places)
        p, out = num_stages, []
        for segment in range(p * self.num_chunks):
            chunk, offset = divmod(segment, p)
            stage = p - 1 - offset if self.vshape and chunk % 2 else offset
            out.append((stage, chunk))
        return out


def _families(num_stages, num_chunks, placement, split) -> list[_Family]:
    chunks = (num_chunks,) if isinstance(num_chunks, int) else tuple(num_chunks)
    places = (placement,) if isinstance(placement, str) else tuple(placement)
    splits = (split,) if isinstance(split, bool) else tuple(split)
    for v in chunks:
        if isinstance(v, bool) or v not in range(1, MAX_CHUNKS + 1):
            raise ScheduleConfigError(
                f"search: num_chunks must be 1 to {MAX_CHUNKS}, got {v!r}"
            )
    places = tuple("v" if place == "wave" else place for place in places)
    for place in places:
        if place not in PLACEMENTS:
            raise ScheduleConfigError(
                f"search: placement must be one of {', '.join(PLACEMENTS)}, got {place!r}"
            )
    if not chunks or not places or not splits or any(not isinstance(s, bool) for s in splits):
        raise ScheduleConfigError(
            "search: num_chunks, placement and split_backward need at least one value each "
            f"(got {num_chunks!r}, {placement!r}, {split!r})"
        )
    found = []
    for v in sorted(set(chunks)):
        for place in places:
            if place == "v" and (v < 2 or num_stages < 2):
                continue
            found.extend(_Family(v, place == "v", s) for s in sorted(set(splits)))
    if not found:
        raise ScheduleConfigError(
            "search: the V placement (a wave) needs num_chunks of 2 or more (-v 2) and at "
            "least 2 stages; add the looped placement (placement='looped', --placement looped)"
        )
    return list(dict.fromkeys(found))


def _sized(families: list[_Family], num_stages: int, memory: MemoryModel | None) -> list[_Family]:
    """The placements measured bytes hold for ([Note: a measured cut]): all of them for sizes
    given by hand; with none, a `ScheduleConfigError` naming the chunk count to search."""
    sized = [f for f in families if other_cut(memory, num_stages, f.share) is None]
    if not sized:
        assert memory is not None
        assert memory.cut is not None
        cut, searched = memory.cut, sorted({f.num_chunks for f in families})
        chunks = f"v = {cut // num_stages}" if cut % num_stages == 0 else "no chunk count"
        raise ScheduleConfigError(
            f"search: the bytes were measured on a model cut in {cut} segments, and orders at "
            f"v = {', '.join(map(str, searched))} on {num_stages} stages cut it in "
            f"{', '.join(str(num_stages * v) for v in searched)}: search {chunks} (the cut of "
            "the run that measured them), or measure the bytes on this cut"
        )
    return sized


def _limits(memory_limit, num_stages: int, in_bytes: bool) -> tuple[float, ...] | None:
    if memory_limit is None:
        return None
    values = (
        list(memory_limit)
        if isinstance(memory_limit, Sequence) and not isinstance(memory_limit, str)
        else [memory_limit] * num_stages
    )
    if len(values) != num_stages:
        raise ScheduleConfigError(
            f"search: memory_limit has {len(values)} values for {num_stages} stages"
        )
    out = []
    for value in values:
        if in_bytes:
            value = parse_size(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ScheduleConfigError(
                f"search: memory_limit must be positive (bytes with a memory model, else "
                f"microbatch activations), got {value!r}"
            )
        out.append(float(value))
    return tuple(out)


@attrs.frozen(eq=False)
class _Candidate:
    program: Program
    timeline: Timeline
    makespan: float
    source: str
    family: _Family
    orders: tuple[tuple[str, ...], ...]
    base: tuple[tuple[str, ...], ...] | None = None  # the orders before the search's offloads


class _Searcher:
    """The search's state: the best candidate so far and what it has timed."""

    def __init__(
        self, p, m, costs, limits, recompute, offload, dp, zero, deadline, max_evals, rng,
        *, eager: bool = False, tied=(), grad_norm: bool = False, tied_cut: int | None = None,
    ):
        self.p, self.m, self.costs, self.limits = p, m, costs, limits
        self.eager = eager  # time and bound the eager timeline
        self.recompute, self.dp, self.zero = recompute, dp, zero
        # compile's options for every order
        self.options = {"data_parallel": dp, "zero": zero, "tied": tied, "grad_norm": grad_norm}
        # the cut `tied` names segments of, where it names one (an index above 0)
        self.tied_cut = tied_cut
        self.offload = offload and limits is not None
        self.deadline, self.max_evals, self.rng = deadline, max_evals, rng
        self.evaluations = 0
        self.moves = 0  # orders local search timed on the quick clock
        # at most this many, where the evaluations are counted (a walk's share of them)
        self.max_moves = math.inf if max_evals is None else 20 * max_evals
        self.slowest = 0.0  # seconds of the slowest timing, compile included
        self.best: _Candidate | None = None
        self.fitting: list[_Candidate] = []
        # the layouts of the orders that fit, and of the seeds not timed: whether an order of
        # each runs overlapped pairs, whether one offloads ([Note: what the bound covers])
        self.layouts: dict[_Family, tuple[bool, bool]] = {}
        self.fitting_builtins: set[tuple[str, int]] = set()  # (name, v)
        # the built-ins to start from with their backwards whole where they fit neither way
        self.whole_later: set[tuple[str, int]] = set()
        # the built-ins that fit recomputing every forward: (family, orders, name)
        self.recomputing: list = []
        self.least_held: float | None = None
        self.seen: set = set()
        self.exact_bounds: dict = {}  # (layout, limits) -> (CP-SAT's bound, split model)
        self.family_bounds: dict = {}  # (family, paired, limits) -> its lower_bound
        self.family_costs: dict[_Family, CostModel] = {}  # the costs in each family's units
        self.clocks: dict[_Family, QuickClock] = {}
        # seeds over the limit, to offload once every seed is timed: (makespan, family, orders,
        # source, timeline); None once they are
        self.deferred: list | None = [] if self.offload else None

    # -- budget -------------------------------------------------------------------------------

    def out_of_time(self) -> bool:
        """Whether the evaluations or the time are spent (keeping room for one more timing and
        the final one); never before a first candidate fits."""
        if self.best is None:
            return False
        if self.max_evals is not None and self.evaluations >= self.max_evals:
            return True
        return time.monotonic() + 2 * self.slowest > self.deadline

    # -- timing one candidate -----------------------------------------------------------------

    def evaluate(
        self, family: _Family, orders, source: str, program: Program | None = None
    ) -> _Candidate | None:
        """Compile (validate), simulate and check the memory of one order, or time the given
        `program` of it; the candidate if it fits (the best so far if it is faster), or fits
        once offloaded where the search may offload, else None."""
        key = (family.num_chunks, family.vshape, orders)
        if key in self.seen or other_cut(self.costs.memory, self.p, family.share) is not None:
            return None  # timed before, or of a cut the measured bytes do not hold for
        self.seen.add(key)
        self.evaluations += 1
        began = time.monotonic()
        if program is None:
            try:
                program = self._compile(family, orders)
            except ScheduleError:
                return None
        timeline = self._simulate(program, family)
        self.slowest = max(self.slowest, time.monotonic() - began)
        if self._fits(timeline, family.share):
            candidate = _Candidate(program, timeline, timeline.makespan, source, family, orders)
            return self._keep(candidate)
        if self.offload and self.deferred is not None:  # a seed: offloaded later, fastest first
            self.deferred.append((timeline.makespan, family, orders, source, timeline))
            return None
        return self._offload(family, orders, source, timeline)

    def _keep(self, candidate: _Candidate) -> _Candidate:
        self.fitting.append(candidate)
        self._may_return(candidate.family, candidate.orders)
        if self.best is None or candidate.makespan < self.best.makespan - 1e-9:
            self.best = candidate
        return candidate

    def _may_return(self, family: _Family, orders) -> None:
        """Count `family` among the layouts the search may return an order of ([Note: what
        the bound covers]): in pairs where `orders` run them, unlimited where they offload."""
        paired, offloads = self.layouts.get(family, (False, False))
        self.layouts[family] = (paired or _pairs(orders), offloads or _offloads(orders))

    def _offload(self, family: _Family, orders, source: str, timeline: Timeline):
        """The candidate of `orders` offloaded to fit ([Note: the search's offloads]), or
        None."""
        began = time.monotonic()
        offloaded = self._offloaded(family, orders, timeline)
        self.slowest = max(self.slowest, time.monotonic() - began)  # the offload pass is slow
        if offloaded is None:
            return None
        program, timeline, copied = offloaded
        if "offload" not in source:
            source += " + offload"
        return self._keep(
            _Candidate(program, timeline, timeline.makespan, source, family, copied, orders)
        )

    def offload_seeds(self) -> None:
        """The seeds over the limit, offloaded to fit, the fastest first while time is left."""
        waiting, self.deferred = sorted(self.deferred or (), key=lambda row: row[0]), None
        for _, family, orders, source, timeline in waiting:
            if self.out_of_time():
                return
            self._offload(family, orders, source, timeline)

    def fewer_recomputes(self, share: float) -> None:
        """Each built-in that fits recomputing every forward (and not without), timed again
        with the recomputations its limit does not need dropped (`fewer_recomputes`, on the
        quick clock): the fastest of each layout first, in at most `share` of the time left."""
        timed: dict[_Family, list] = {}
        for family, orders, name in self.recomputing:
            quick = self._clock(family).time_covered(orders)
            if quick is not None:  # copies or sends: the simulator alone times them
                timed.setdefault(family, []).append((quick, orders, name))
        queue = [
            (rank, quick, family, orders, name)
            for family, rows in timed.items()
            for rank, (quick, orders, name) in enumerate(sorted(rows, key=lambda r: r[0]))
        ]
        deadline = self.deadline
        self.deadline = time.monotonic() + share * max(0.0, deadline - time.monotonic())
        try:
            for _, _, family, orders, name in sorted(queue, key=lambda row: row[:2]):
                if self.out_of_time():
                    return
                fewer = fewer_recomputes(orders, self._clock(family), self.out_of_time)
                if fewer != orders:
                    self.evaluate(family, fewer, f"{name} with selective recompute")
        finally:
            self.deadline = deadline

    def _compile(self, family: _Family, orders, offload: ByteLimit | None = None) -> Program:
        schedule = _found_class(self.p, self.m, family, orders)(self.p, self.m, family.num_chunks)
        return compile(schedule, offload=offload, **self.options)

    def _unchecked(self, schedule: Schedule, recompute: bool) -> Program:
        """`schedule` compiled with the search's options but without the validator (the
        simulator validates what it times)."""
        return compile(schedule, validate=False, recompute=recompute, **self.options)

    def _offloaded(self, family: _Family, orders, timeline: Timeline):
        """`orders` (over the limit in `timeline`) with offloads where a stage is over it
        ([Note: the search's offloads]): `(program, timeline, orders with their copies)`, or
        None where offloading is not allowed or does not make it fit."""
        if not self.offload or _offloads(orders):
            return None
        if self.best is not None and timeline.makespan >= self.best.makespan - 1e-9:
            return None  # copies only add waits: it cannot beat the best
        v = family.share
        memory = timeline.costs.memory
        if memory is None:  # whole-stage microbatches: one unit a chunk's activation
            counted = MemoryModel(activations=1.0)
            budgets = [lim * v for lim in self.limits]
        else:  # the activations' share of each limit, at the order's peak
            counted = memory
            budgets = [
                lim - (held - act)
                for lim, held, act in zip(
                    self.limits, timeline.peak_bytes, timeline.peak_activation_bytes
                )
            ]
        tried = set()
        for _ in range(3 if memory is not None else 1):
            if min(budgets) < 1:
                return None
            try:
                limit = ByteLimit([math.floor(b + 1e-9) for b in budgets], counted)
                program = self._compile(family, orders, offload=limit)
                copied = _compute_orders(program, sends=_sends(orders))
                if not _offloads(copied) or copied in tried:
                    return None  # nothing (more) can go
                tried.add(copied)
            except ScheduleError:
                return None
            timeline = self._simulate(program, family)
            if self._fits(timeline, v):
                return program, timeline, copied
            over = [h - lim for h, lim in zip(self._held(timeline, v), self.limits)]
            budgets = [b - max(0.0, x) for b, x in zip(budgets, over)]
        return None

    def final(self) -> _Candidate | None:
        """The fastest candidate, as a `FoundOrder` program whose orders are all it runs
        (compiled from them and timed again: a replayed built-in, an order the search
        offloaded)."""
        for candidate in sorted(self.fitting, key=lambda c: c.makespan):
            if isinstance(candidate.program.schedule, FoundOrder) and candidate.base is None:
                return candidate
            try:
                program = self._compile(candidate.family, candidate.orders)
            except ScheduleError:  # a replayed built-in validates as the built-in does
                continue
            timeline = self._simulate(program, candidate.family)
            if self._fits(timeline, candidate.family.share):
                return attrs.evolve(candidate, program=program, timeline=timeline)
        return None

    def _simulate(self, program: Program, family: _Family) -> Timeline:
        """`program`'s timeline under the costs of `family`, eagerly where the search is."""
        return simulate(program, self._costs_of(family), eager=self.eager)

    def _costs_of(self, family: _Family) -> CostModel:
        """The costs in the units of `family`'s orders ([Note: tune's units]): per chunk, with
        per-stage memory sizes and per-segment costs on the segments its placement gives each
        stage (once per family)."""
        costs = self.family_costs.get(family)
        if costs is None:
            place = family.segments(self.p)
            costs = self.family_costs[family] = _per_chunk(self.costs, family.share, place)
        return costs

    def _held(self, timeline: Timeline, v: int) -> tuple[float, ...]:
        if timeline.costs.memory is not None:
            return timeline.peak_bytes
        return tuple(n / v for n in timeline.peak_activations)

    def _fits(self, timeline: Timeline, v: int) -> bool:
        if self.limits is None:
            return True
        held = self._held(timeline, v)
        worst = max(h / lim for h, lim in zip(held, self.limits))
        if self.least_held is None or worst < self.least_held:
            self.least_held = worst
        return all(h <= lim * (1 + 1e-9) for h, lim in zip(held, self.limits))

    def bounds(
        self, families: list[_Family], prove_until: float | None = None
    ) -> list[LayoutBound]:
        """The lower bound of each layout the search may return an order of, the least first:
        each of `families`, and the layout of every order found to fit (DualPipe's replicas,
        2BW's delay, a built-in's own places), with overlapped pairs where one of its orders
        has them (and without, apart), without the memory limit where one offloads or the
        search may offload ([Note: the lower bound]); each the larger of `lower_bound` and
        CP-SAT's where the exact model was solved for it. `SearchResult.bound` is the first.

        [Note: what the bound covers] Local search walks from every layout it found an order
        fitting in, list scheduling pairs computes in each layout a fitting order pairs them
        in, and an order that offloads keeps its copies: so an order of any of those layouts
        may be returned, by this search or one given more time, and the bound is below them
        all, whichever layout the returned order is in. A built-in not timed once
        `max_evaluations` are spent counts as though it fit. Bounding the returned order's
        layout alone claimed, at p = 4, m = 8, 1:2:1, a 1.5x last stage, 1F1B's activations,
        that zb-v's 37.5 (the best of 5 evaluations) was optimal, where DualPipe's layout in
        pairs runs 33.0."""
        # an order that offloads holds fewer activations than the memory terms count
        limits = None if self.offload else self.limits
        layouts = dict.fromkeys(families, (False, False)) | self.layouts
        kinds = {(f, paired, None if off else limits) for f, (paired, off) in layouts.items()}
        # and each layout in pairs without them: what no order without pairs beats
        kinds |= {(f, False, lim) for f, paired, lim in kinds if paired}
        found = []
        for family, overlapped, limits in kinds:
            formula = self._lower(family, limits, overlapped=overlapped)
            exact = None
            # the exact job that bounds this family's orders: a model of a built-in's layout
            # has pairs, in pairs or not it holds them; a placement's has none
            layout = attrs.evolve(family, split=False)
            if _paired(layout) or not overlapped:
                solved = [(layout, limits)]
                if self.offload and limits is None:  # solved under the limit with offloads too
                    solved.append((layout, self.limits))
                entries = [self.exact_bounds.get(key, (None, False)) for key in solved]
                # a model of whole backwards only bounds no order of split ones
                proven = [b for b, split in entries if b is not None and split >= family.split]
                exact = max(proven, default=None)
            if exact is not None:  # CP-SAT's model ends at the last compute
                exact += closing(self.costs, self.p, self.options["grad_norm"])
            value, source = formula, "lower_bound"
            if exact is not None and exact > formula * (1 + 1e-6):  # not by rounding alone
                value, source = exact, "CP-SAT"
            offloads = limits is None and self.limits is not None
            layout = _layout_name(family)
            found.append(
                (
                    LayoutBound(
                        layout, family.num_chunks, family.split, overlapped, offloads, value, source
                    ),
                    (family, overlapped, limits),
                )
            )
        if prove_until is not None:
            found = self._relaxed(found, prove_until)
        return sorted((b for b, _ in found), key=lambda b: (b.bound, str(b)))

    def _relaxed(self, found: list, until: float) -> list:
        """`found` ((LayoutBound, its kind) pairs) with the least bounds raised by the stages'
        time-indexed relaxations ([Note: the stage relaxation] in `schedcc.search_relax`),
        the least first, until `until` or no layout's bound can rise: a layout's stages in
        the order of their analytic bounds, the most first, each between that and the best
        makespan found. Where time remains, the whole pipeline's program of each layout, the
        least first, where it is small enough ([Note: the whole pipeline's relaxation])."""
        best = self.best.makespan if self.best is not None else math.inf
        end = closing(self.costs, self.p, self.options["grad_norm"])
        tried = set()
        while time.monotonic() < until:
            left = [
                (whole, i)
                for whole in (False, True)
                for i, (b, _) in enumerate(found)
                if (whole, i) not in tried and b.bound < best
            ]
            if not left:
                break
            whole, i = min(left, key=lambda pair: (pair[0], found[pair[1]][0].bound))
            tried.add((whole, i))
            layout, (family, overlapped, limits) = found[i]
            bound = _Bound(self.p, self.m, self.costs, family, overlapped, self.eager)
            rooms = bound.all_rooms(limits, self.dp, self.zero)
            if rooms is None:  # no order fits: its bound is already infinite
                continue
            value, high = layout.bound, best - end
            if whole:  # every stage's program in one
                low = value - end
                raised = relaxed_pipeline_bound(bound, rooms, self.recompute, low, high, until)
                value = max(value, raised + end)
            else:  # each stage's own, the busiest first
                stages = {s: bound.stage(s, rooms[s], self.recompute) for s in range(self.p)}
                for s in sorted(stages, key=lambda s: -stages[s]):
                    if time.monotonic() >= until or value >= best - 1e-9:
                        break
                    low = max(stages[s], value - end)
                    raised = relaxed_stage_bound(
                        bound, s, rooms[s], self.recompute, low, high, until
                    )
                    value = max(value, raised + end)
            if value > layout.bound * (1 + 1e-6):
                found[i] = (attrs.evolve(layout, bound=value, bound_from="relaxation"), found[i][1])
        return found

    def hopeless(
        self, family: _Family, orders=(), *, limited: bool = True, pairs: bool = False
    ) -> bool:
        """Whether no order of `family` can be faster than the best found: its lower bound
        (with overlapped pairs where `orders` has them; without the limit where they offload,
        the search may, or not `limited`) is no less.

        [Note: hopeless layouts] List scheduling, local search and the exact model each build
        orders of one layout, so a layout whose `lower_bound` is at or above the best makespan
        found can give nothing faster, and the search spends its time elsewhere: at p = 4,
        m = 8, comm 1F, a heavy first stage, the looped F/I/W placement's list scheduling
        meets its bound at 39.3, and the 3 s search spent a third of its time walking from
        there, where the V, bounded at 36.3, walks to 36.95 given that time
        (docs/performance.md, "Layouts that cannot win")."""
        if self.best is None:
            return False
        paired = pairs or _pairs(orders)
        limits = None if not limited or self.offload or _offloads(orders) else self.limits
        return self._lower(family, limits, overlapped=paired) >= self.best.makespan - 1e-9

    def _lower(self, family: _Family, limits, *, overlapped: bool = False) -> float:
        """`lower_bound` of `family` under `limits` (the search's, or None), once each."""
        key = (family, overlapped, limits)
        if key not in self.family_bounds:
            self.family_bounds[key] = self._lower_bound(family, limits, overlapped=overlapped)
        return self.family_bounds[key]

    def _lower_bound(self, family: _Family, limits, *, overlapped: bool = False) -> float:
        return lower_bound(
            self.p,
            self.m,
            self.costs,
            family,
            overlapped=overlapped,
            memory_limit=limits,
            recompute=self.recompute,
            data_parallel=self.dp,
            zero=self.zero,
            eager=self.eager,
            grad_norm=self.options["grad_norm"],
        )

    def exact(
        self, families: list[_Family], until: float, seed: int, *, pairs: bool = False
    ) -> None:
        """Solve each placement's exact model ([Note: the search], 4) by `until`, from its
        best order; time its solution, keep its proven bound; local search from it if it is
        the best. Where the best order offloads, its placement without the limit too; where the
        search may offload, every placement; eagerly with `pairs`, each layout a fitting order
        runs in overlapped pairs, with pairs ([Note: pairs in the exact model] in
        `schedcc.search_exact`); none whose bound the best order meets.

        [Note: the exact model's pairs] `pairs` is always `method="exact"`'s, and `"auto"`'s
        where CP-SAT has `_PAIRED_SECONDS` (2 s: a `time_limit` of 6.7 s, the default 10 s
        among them). A model in pairs has a literal per forward and backward that may pair (at
        p = 4, m = 8, 224 in DualPipe's layout): in the 0.9 s `"auto"` leaves CP-SAT at 3 s it
        returned the order it starts from, where local search would have had the time (the
        p = 4 grid: 9 shapes faster, 10 slower, 0.07% faster on average); in its 3 s at 10 s
        it found faster orders (m = 8: 9 faster, 3 slower, 0.4% faster on average;
        docs/performance.md, "The exact model in pairs").

        [Note: the exact method's time] Half the time goes to every placement in turn (the
        smaller models first, each taking what the ones before left), the other half to the
        one whose best order is the fastest, solved again from that order, unless every model
        is proven or none can beat the best order found: CP-SAT improves with time, and a
        three-way split left each placement too little at m = 8 (docs/performance.md, "Limits
        in bytes")."""
        # per layout (a family with its backward form left out: a placement, or with `places`
        # a layout run in overlapped pairs), the backward forms asked
        splits: dict[_Family, set[bool]] = {}
        layouts = list(families)
        if pairs and self.eager and not self.offload:
            layouts += [f for f in self.paired_layouts() if not f.weight_delay]
        for f in layouts:
            splits.setdefault(attrs.evolve(f, split=False), set()).add(f.split)
        # the limit in whole-stage microbatches, or in bytes with a memory model
        todo = [(layout, self.limits) for layout in splits]
        own = self.best.family
        if self.limits is not None and self.offload:
            # every placement without the limit too: its bound holds for an order that
            # offloads, its orders are offloaded to fit ([Note: the search's offloads])
            todo += [(layout, None) for layout in splits]
        elif self.limits is not None and _offloads(self.best.orders) and not own.places:
            placement = _Family(own.num_chunks, own.vshape, False)
            splits.setdefault(placement, set()).add(own.split)
            todo.append((placement, None))
        todo = [  # none whose bound the best order meets ([Note: hopeless layouts])
            (layout, limits)
            for layout, limits in todo
            if not all(
                self.hopeless(
                    attrs.evolve(layout, split=split),
                    pairs=_paired(layout),
                    limited=limits is not None,
                )
                for split in splits[layout]
            )
        ]
        if not todo:  # local search has the time instead
            self.deadline = until
            self.improve()
            return
        todo.sort(key=lambda job: (job[0].num_chunks, job[1] is None))
        first = until if len(todo) == 1 else time.monotonic() + (until - time.monotonic()) / 2
        solved = {}
        for left, job in zip(range(len(todo), 0, -1), todo):
            seconds = (first - time.monotonic()) / left
            solved[job] = self._solve_exact(job, splits, seconds, seed)
        open_jobs = [
            job
            for job in todo
            if not solved[job].optimal and solved[job].bound < self.best.makespan * (1 - 1e-9)
        ]
        if len(todo) > 1 and open_jobs:
            job = min(open_jobs, key=lambda job: (self._fastest_in(job[0]), job[1] is None))
            self._solve_exact(job, splits, until - time.monotonic(), seed + 1)
        if self.best is not None and self.best.source.startswith("CP-SAT"):
            self.deadline = until
            self.improve()

    def _solve_exact(self, job, splits, seconds: float, seed: int):
        """Solve `job` = `(layout, limits)` for `seconds` from its layout's fastest order; keep
        the larger bound, time the solution."""
        layout, limits = job
        split = any(splits[layout])  # a split model holds whole backwards too
        family = attrs.evolve(layout, split=split)
        offload = self.offload and limits is not None  # [Note: offloads in the exact model]
        counted = limits if self.costs.memory is None and not offload else None
        # the model ends at the last compute: its bounds without what follows it (`closing`)
        closed = closing(self.costs, self.p, self.options["grad_norm"])
        lower = min(
            self._lower(attrs.evolve(layout, split=s), counted, overlapped=_paired(layout))
            for s in splits[layout]
        )
        start = self._start_of(layout, limits)
        solution = solve_exact(
            self.p,
            self.m,
            self.costs,
            family,
            memory_limit=limits,
            recompute=self.recompute,
            offload=offload,
            data_parallel=self.dp,
            zero=self.zero,
            time_limit=max(0.1, seconds),
            hint=start.timeline if start is not None else None,
            upper=self.best.makespan - closed,
            lower=lower - closed,
            num_workers=_EXACT_WORKERS,
            seed=seed,
            eager=self.eager,
            pairs=_paired(layout),
        )
        known, _ = self.exact_bounds.get(job, (-math.inf, split))
        self.exact_bounds[job] = (max(known, solution.bound), split)
        if solution.orders is not None:
            form = attrs.evolve(family, split=_splits(solution.orders))
            source = "CP-SAT" + (" (optimal)" if solution.optimal else "")
            self.evaluate(form, solution.orders, source)
        return solution

    def _fastest_in(self, layout) -> float:
        """The makespan of the fastest fitting candidate of `layout` (inf: none)."""
        return min(
            (c.makespan for c in self.fitting if attrs.evolve(c.family, split=False) == layout),
            default=math.inf,
        )

    def _start_of(self, layout, limits) -> _Candidate | None:
        """The fastest candidate of `layout` that its exact model can start from (overlapped
        pairs only in a model with them, offloads only under a limit where the search may
        offload; fitting the limit it is solved under)."""
        fits = [
            c
            for c in self.fitting
            if attrs.evolve(c.family, split=False) == layout
            and (limits is None or self.offload or not _offloads(c.orders))  # held fewer
            and (_paired(layout) or not _pairs(c.orders))
        ]
        return min(fits, key=lambda c: c.makespan, default=None)

    def nothing_fits(self) -> str:
        least = (
            ""
            if self.least_held is None
            else (
                f"; the leanest order found needs {self.least_held:.2f}x the limit on its fullest "
                "stage"
            )
        )
        return (
            f"search: no order for p={self.p}, m={self.m} fits the memory limit{least}; raise "
            "memory_limit, allow recomputation (recompute=True, --recompute) or offloading "
            "(offload=True, --offload), or add chunks and placements"
        )

    # -- sources ------------------------------------------------------------------------------

    def seed(
        self, classes, families: list[_Family], *, recomputed: bool, whole: bool = False
    ) -> None:
        """Time the orders of `classes` (`(name, Schedule subclass)` pairs) at the searched
        chunk counts and backward forms: in one of `families`' placements, or in a layout of
        their own (replicas, a weight delay) when every placement is searched. With full
        recomputation: only those that do not fit without it. With `whole`: those whose own
        order fits neither way, their backwards whole.

        [Note: built-ins with whole backwards] Where F/B orders alone are searched, a built-in
        whose order splits its backwards is started from with each `I` and its `W` run as one
        `B` where the `I` was, in its own layout: ZB's become 1F1B's kind, DualPipe's runs its
        two replicas in pairs, a layout no F/B search reached before. Where both forms are,
        DualPipe's and DualPipe-V's (the built-ins that run pairs or a layout of their own)
        are started from so too where their own orders fit neither as they are nor
        recomputing every forward: under a tight limit a whole backward frees its activation
        at once. At p = 4, m = 8, 1:2:1, comm 1F, a 1.5x last stage, 0.3x 1F1B's activations,
        DualPipe's order does not fit, and the search returned the looped placement's 47.5 at
        its bound, where DualPipe's replicas with whole backwards run 42.0. Where their own
        orders fit, their layout is searched already, and made whole they gave no order the
        grids returned (docs/performance.md, "F/B orders in DualPipe's layout")."""
        tables = {}
        for family in families:
            table = [[-1] * family.num_chunks for _ in range(self.p)]
            for k, (s, c) in enumerate(family.segments(self.p)):
                table[s][c] = k
            tables[family.num_chunks, family.vshape] = table
        every_placement = {f.vshape for f in families if f.num_chunks == 2} == {False, True}
        waiting: list = []  # seeds the quick clock timed, to simulate the fastest of
        clocked = self.eager and not self.offload
        for v in sorted({f.num_chunks for f in families}):
            forms = {f.split for f in families if f.num_chunks == v}  # backward forms searched
            both = forms == {False, True}
            for name, cls in classes:  # all of them, whatever the time: the search starts here
                # past the evaluations, a seed's layout is still counted by the bound
                spent = self.max_evals is not None and self.evaluations >= self.max_evals
                built = (name, v)
                if recomputed and built in self.fitting_builtins:
                    continue
                if whole and (built not in self.whole_later or built in self.fitting_builtins):
                    continue
                try:
                    schedule = build_schedule(cls, self.p, self.m, num_chunks=v)
                    table = schedule.segment_table()
                    ours = [key for key, t in tables.items() if t == table]
                    plain = cls.num_replicas == 1 and not cls.weight_delay and ours
                    if not plain and not (every_placement or v == 1):
                        continue
                    # on the clock its computes alone, else compiled; either way validated
                    # where it is timed (the simulator validates, `final` compiles it again)
                    if clocked or spent:
                        program = computes(
                            schedule, data_parallel=self.dp, zero=self.zero, recompute=recomputed
                        )
                    else:
                        program = self._unchecked(schedule, recomputed)
                except ScheduleError:
                    continue
                orders = _compute_orders(program)
                label = name
                if _splits(orders) and (whole or forms == {False}):
                    orders, program = _whole_backwards(orders), None
                    label = f"{name} (backwards whole)"
                elif both and _splits(orders) and (not plain or _pairs(orders)):
                    # made whole later where it fits neither way (ZB's made whole are 1F1B's
                    # kind, which the built-ins have)
                    self.whole_later.add(built)
                split = _splits(orders)
                form = _Family(v, ours[0][1], split) if plain else _Family.of(schedule, split)
                if not any(f.num_chunks == v and f.split == split for f in families):
                    continue
                if self.tied_cut not in (None, self.p * form.share):
                    continue  # its ties name segments of another cut
                if other_cut(self.costs.memory, self.p, form.share) is not None:
                    continue  # of a cut the measured bytes do not hold for
                if spent:  # not timed: bounded as though an order of its layout fit
                    self._may_return(form, orders)
                    continue
                source = label + (" with recompute" if recomputed else "")
                fits = self._seed_on_clock(form, orders, source, waiting) if clocked else None
                if fits is None:  # not on the clock: the simulator says
                    if clocked and program is not None:  # compiled now (lowering places
                        try:  # copies beside the computes)
                            program = self._unchecked(schedule, recomputed)
                        except ScheduleError:
                            continue
                        orders = _compute_orders(program)
                    fits = self.evaluate(form, orders, source, program) is not None
                if fits:
                    self.fitting_builtins.add(built)
                    if recomputed:
                        self.recomputing.append((form, orders, label))
        self._time_fastest(waiting, whatever_the_time=True)  # each layout's fastest

    def _seed_on_clock(self, family: _Family, orders, source: str, waiting) -> bool | None:
        """Whether a seed fits as the quick clock says (exactly, in whole-stage microbatches;
        in bytes only where it times it), queued in `waiting` to be compiled and simulated if it
        is the fastest of its layout; None where the simulator must say."""
        clock = self._clock(family)
        quick = clock.time_covered(orders)
        if quick is not None:
            waiting.append((quick, family, orders, source))
            self._may_return(family, orders)  # fits, whether or not it is simulated
            return True
        if self.costs.memory is None and (waiting or self.best) and clock.covers(orders):
            return False  # over its budget (a built-in's order never gets stuck)
        return None

    def _time_fastest(self, queued, *, whatever_the_time: bool = False) -> None:
        """Compile and simulate, of `queued` `(quick time, family, orders, source)` rows, each
        family's fastest on the quick clock that the simulator keeps: the clock gives the
        simulator's makespan, so no other is faster. Until time is up, or with
        `whatever_the_time` until the evaluations are."""
        done: set[_Family] = set()
        for _, family, orders, source in sorted(queued, key=lambda row: row[0]):
            if family in done:
                continue
            if whatever_the_time:
                if self.max_evals is not None and self.evaluations >= self.max_evals:
                    return
            elif self.out_of_time():
                return
            if self.evaluate(family, orders, source) is not None:
                done.add(family)

    def paired_layouts(self) -> dict[_Family, tuple]:
        """Each layout a fitting order runs in overlapped pairs (DualPipe's, DualPipe-V's), and
        one such order of it: list scheduling pairs computes there too."""
        out: dict[_Family, tuple] = {}
        for candidate in self.fitting:
            if _pairs(candidate.orders):
                out.setdefault(candidate.family, candidate.orders)
        return out

    def list_schedule(self, family: _Family, share: float, pairs: bool = False) -> None:
        """Time the best few orders list scheduling makes under many rules (with `pairs`, with
        and without overlapped pairs), in about `share` of the time left."""
        rules = _rules(family, self.rng, pairs)
        budgets = self._budgets(family)
        settings = [(budgets, self.recompute)]
        if self.offload:  # orders over the limit too, offloaded to fit when timed
            wider = [2 * b for b in budgets]  # some of it recomputed, the rest offloaded
            settings += [(None, False), (wider, self.recompute)]
        schedulers = [
            _ListScheduler(self.p, self.m, family, self.costs, more, rec, eager=self.eager)
            for more, rec in settings
        ]
        made: list[list] = [[] for _ in schedulers]
        left = share * max(0.0, self.deadline - time.monotonic())
        until = time.monotonic() + (0.7 if budgets is not None else 1.0) * left
        tried = []  # (estimate, n) of each rule run, by the first scheduler
        for n, rule in enumerate(rules):
            if self.out_of_time() or (n >= 4 and time.monotonic() > until):
                break
            estimate = math.inf
            for scheduler, out in zip(schedulers, made):
                result = scheduler.run(rule)
                if result is not None:
                    out.append(result)
                    if out is made[0]:
                        estimate = result[0]
            tried.append((estimate, n))
        if budgets is not None:
            # under a limit, the rules again, the best first while time is left, choosing
            # otherwise what to recompute ([Note: the search], 2); the best few of these are
            # timed too, not in place of the others'
            until = time.monotonic() + 0.3 * left
            again: dict[int, list[list]] = {}  # per kind of variant, per scheduler
            for k, (_, n) in enumerate(sorted(tried)):
                if self.out_of_time() or (k >= 2 and time.monotonic() > until):
                    break
                for j, variant in enumerate(_variants(rules[n], family, self.recompute)):
                    if variant.busiest_pairs and time.monotonic() > until:
                        break  # the last variants, only in the time given to them
                    outs = again.setdefault(j, [[] for _ in schedulers])
                    for scheduler, out in zip(schedulers, outs):
                        result = scheduler.run(variant)
                        if result is not None:
                            out.append(result)
            made += [out for outs in again.values() for out in outs]
        for out in made:
            out.sort(key=lambda r: r[0])
        chosen = [out[n][1] for n in range(3) for out in made if n < len(out)]  # the best few
        if self.eager and not self.offload:  # the fastest on the quick clock
            queued = self._clocked(family, chosen)
            self._time_fastest([(quick, family, orders, _LISTED)
                                for quick, orders in queued])  # fmt: skip
            return
        for orders in chosen:
            if self.out_of_time():
                return
            self.evaluate(family, orders, _LISTED)

    def _clocked(self, family: _Family, chosen: list) -> list:
        """`(quick time, orders)` of the `chosen` orders the quick clock times: none it calls
        over its budget, unless in bytes, where it may call one over that fits (those as the
        slowest)."""
        clock = self._clock(family)
        out = []
        for orders in dict.fromkeys(chosen):
            quick = clock.time_covered(orders)
            if quick is not None:
                out.append((quick, orders))
            elif self.costs.memory is not None:
                out.append(((math.inf,), orders))
        return out

    def _budgets(self, family: _Family) -> list[float] | None:
        """Per stage, the activation units list scheduling and the quick clock let a stage hold
        (None: unlimited)."""
        if self.limits is None:
            return None
        if self.costs.memory is None:
            return [lim * family.share for lim in self.limits]  # chunk activations
        place = family.segments(self.p)
        scaled = _per_chunk(self.costs, family.share, place).memory
        out = []
        for s in range(self.p):
            fixed = 0.0
            for k, (stage, _) in enumerate(place):
                if stage == s:
                    fixed += sum(
                        scaled.at(kind, k) for kind in ("parameters", "gradients", "optimizer")
                    )
            out.append(self.limits[s] - fixed)
        return out

    def improve(self) -> None:
        """Local search ([Note: the search], 3) from the best candidate, then from the best of
        each other placement and layout in turn, of each its best from list scheduling and its
        best given one apart ([Note: a walk from each origin]), the fastest first, each walk
        taking at most half the time left while others wait, and again from each one's best
        while a round finds a faster order; none from a layout whose bound the best order found
        already meets ([Note: hopeless layouts])."""
        deadline, max_moves = self.deadline, self.max_moves
        begun: set[tuple[_Family, bool]] = set()
        best = self.best
        while not self.out_of_time():
            starts = [
                c
                for c in self.fitting
                if _origin(c) not in begun and not self.hopeless(c.family, c.orders)
            ]
            if not starts:
                if not begun or self.best is best:
                    return
                begun, best = set(), self.best  # another round: this one found a faster order
                continue
            start = min(starts, key=lambda c: c.makespan)
            begun.add(_origin(start))
            if len({_origin(c) for c in starts}) > 1:  # leave the others half the time
                self.deadline = time.monotonic() + (deadline - time.monotonic()) / 2
                self.max_moves = self.moves + (max_moves - self.moves) / 2  # and the moves
            try:
                self._improve_from(start)
            finally:
                self.deadline, self.max_moves = deadline, max_moves

    def _improve_from(self, current: _Candidate) -> None:
        """Local search from `current`: eagerly on the quick clock where it times the order
        ([Note: the quick clock] in `schedcc.search_local`); else with the simulator alone,
        and then, in the rendezvous model, on the quick clock (its eager time a guide, the
        simulator's the judge) in the time that is left."""
        clock = self._clock(current.family)
        if self.eager and self._on_clock(clock, current):
            self._iterate(current, clock)
            return
        current = self._climb(current)
        if self._on_clock(clock, current) and not self.out_of_time():
            self._iterate(current, clock)

    @staticmethod
    def _on_clock(clock: QuickClock, candidate: _Candidate) -> bool:
        """Whether the quick clock times `candidate`'s order (no copies or sends)."""
        return candidate.base is None and clock.time_covered(candidate.orders) is not None

    def _climb(self, current: _Candidate) -> _Candidate:
        """First improvement over every move, in a fixed order, each timed by the simulator,
        until none helps (a local optimum) or time is up; the last candidate kept."""
        improved = True
        while improved and not self.out_of_time():
            improved = False
            for orders in neighbours(current.base or current.orders, current.timeline.idle):
                if self.out_of_time():
                    return current
                found = self.evaluate(current.family, orders, _searched(current.source))
                if found is not None and found.makespan < current.makespan - 1e-9:
                    current, improved = found, True
                    break
        return current

    def _iterate(self, current: _Candidate, clock: QuickClock) -> None:
        """Local search on the quick clock from `current`: the climb's moves first, then an
        iterated walk of random moves, each kept where the clock times it no slower (a lower
        makespan, or the same with the stages ending no later in sum); after `_PATIENCE` moves
        without a gain, a few random moves away from the best order of the walk, until
        `_ROUNDS` such restarts in a row find no better one (or time is up). Each order the
        clock times faster than any timed before is compiled and simulated."""
        family, source = current.family, _searched(current.source)
        here, here_time = current.orders, clock.time(current.orders)
        # a layout run in overlapped pairs (DualPipe's) may pair and part its computes too
        pairs = _pairs(current.orders)
        split = pairs and family.split  # and join and split its backwards to do so
        timed = here_time[0]  # the fastest the clock gave an order the simulator timed

        def offer(orders, quick) -> None:
            nonlocal timed
            if quick[0] < timed - 1e-9:
                timed = quick[0]
                self.evaluate(family, orders, source)

        climbing = True
        while climbing and self.moves < self.max_moves:
            climbing = False
            for new in neighbours(here, current.timeline.idle):
                if self._count_move():
                    return
                new_time = clock.time(new)
                if new_time is not None and new_time[0] < here_time[0] - 1e-9:
                    here, here_time, climbing = new, new_time, True
                    offer(here, here_time)
                    break
        best, best_time = here, here_time
        stale = rounds = 0
        while self.moves < self.max_moves and rounds <= _ROUNDS:
            if self._count_move():
                return
            new = move(here, self.rng, pairs=pairs, split=split)
            new_time = None if new is None else clock.time(new)
            if new_time is not None and not _earlier(here_time, new_time):
                stale = 0 if _earlier(new_time, here_time) else stale + 1
                here, here_time = new, new_time
                offer(here, here_time)
                if _earlier(here_time, best_time):
                    best, best_time, rounds = here, here_time, 0
            else:
                stale += 1
            if stale > _PATIENCE:  # start again a few moves from the best
                stale, rounds = 0, rounds + 1
                for _ in range(8):
                    size = self.rng.randint(2, 6)
                    here = kick(
                        best, self.rng, size, recompute=self.recompute, pairs=pairs, split=split
                    )
                    here_time = clock.time(here)
                    if here_time is not None:
                        break
                else:
                    here, here_time = best, best_time

    def _count_move(self) -> bool:
        """Count one order timed on the quick clock; whether local search must stop (time
        checked at every move: at p = 16, m = 64 one takes some 15 ms)."""
        self.moves += 1
        return self.out_of_time()

    def _clock(self, family: _Family) -> QuickClock:
        """The quick clock of `family`'s orders (eager), one per family: what it reads of an
        order's entries and rows it keeps."""
        clock = self.clocks.get(family)
        if clock is None:
            place, costs = family.segments(self.p), self._costs_of(family)
            steps = [self.costs.at(s).step for s in range(self.p)]
            clock = QuickClock(place, costs, self._budgets(family), family.num_replicas, steps)
            self.clocks[family] = clock
        return clock


def _origin(candidate: _Candidate) -> tuple[_Family, bool]:
    """Where local search starts once a round: per layout, from the best order list scheduling
    made, and from the best given one (a built-in, CP-SAT's).

    [Note: a walk from each origin] A built-in's order under a limit, with selective
    recompute, is often the fastest of its layout before local search and a place no move of
    the walk leaves: at p = 4, m = 8, 1:2:1, comm 0.1F, a 1.5x last stage, 0.6x 1F1B's
    activations, DualPipe's (38.25) is, and walking from it finds nothing faster. List
    scheduling's best order of that layout, as fast, walks to 36.75 in 300 moves. So each
    layout's best of each origin gets a walk, the fastest first, each taking at most half the
    time left (half the moves left, where the evaluations are counted) while others wait."""
    return candidate.family, candidate.source.startswith(_LISTED)


def _searched(source: str) -> str:
    return source if "local search" in source else source + " + local search"


def _earlier(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether quick time `a` (makespan, stages' ends added up) beats `b`."""
    return a[0] < b[0] - 1e-9 or (a[0] <= b[0] + 1e-9 and a[1] < b[1] - 1e-9)


def _found_class(p, m, family: _Family, orders) -> type[FoundOrder]:
    body = {
        "shape": (p, m, family.num_chunks),
        "vshape": family.vshape,
        "orders": tuple(" ".join(row) for row in orders),
        "__module__": __name__,
    }
    if family.places:
        body.update(
            places=family.places,
            replicas=family.replicas,
            num_replicas=family.num_replicas,
            weight_delay=family.weight_delay,
        )
    return type("Found", (FoundOrder,), body)


def _compute_orders(program: Program, *, sends: bool = False) -> tuple[tuple[str, ...], ...]:
    """Each stage's computes and copies as text (overlapped pairs as `F3.1 +B1`, offloads as
    `O3`, reloads as `L3`), one batch; with `sends`, its sends and receives too (`SA3`, `RG1`:
    an order that places its own, as CP-SAT's do)."""
    m = program.schedule.num_microbatches
    kept = _KEPT + _P2P if sends else _KEPT
    return tuple(
        tuple(str(op) for op in ops if isinstance(op, kept) and op.microbatch < m)
        for ops in program.stages
    )


_KEPT = (Compute, Copy)  # what a replayed order keeps: comm and updates are the compiler's
_P2P = (SendActivation, RecvActivation, SendGrad, RecvGrad)


def _sends(orders) -> bool:
    """Whether `orders` place their own sends and receives ([Note: meeting time])."""
    return any(text[:2] in ("SA", "RA", "SG", "RG") for row in orders for text in row)


def _offloads(orders) -> bool:
    return any(text[0] in "OL" for row in orders for text in row)


def _pairs(orders) -> bool:
    """Whether `orders` run overlapped pairs (`F3 +B1`, DualPipe's)."""
    return any(text.startswith("+") for row in orders for text in row)


def _splits(orders) -> bool:
    return any(text.startswith("W") for row in orders for text in row)


def _whole_backwards(orders) -> tuple[tuple[str, ...], ...]:
    """`orders` with each input gradient and its weight gradient run as one backward, where
    the input gradient was.

    >>> _whole_backwards([["F0", "I0", "R1", "W0", "I1", "W1"]])
    (('F0', 'B0', 'R1', 'B1'),)
    """
    return tuple(
        tuple("B" + text[1:] if text.startswith("I") else text for text in row if text[0] != "W")
        for row in orders
    )


def _paired(layout: _Family) -> bool:
    """Whether an exact job's `layout` is one run in overlapped pairs (a built-in's, with its
    `places`), not a placement's."""
    return bool(layout.places)


# -- list scheduling ---------------------------------------------------------------------------


@attrs.frozen
class _Rule:
    """How a stage ranks its ready computes (lower first) and how many it keeps in flight."""

    backward_first: bool
    eager_weight: bool
    deep_forward: bool
    cap: float  # microbatches in flight per stage, a multiple of its depth to the end
    jitter: float
    seed: int
    # under a budget: a forward holds its activation only with room left for the
    # recomputations its stage owes, else it is recomputed too (never stuck, though it may
    # recompute more than needed; without, an order may get stuck, and is dropped)
    owed: bool = True
    # under a budget, with several chunks a stage: every forward of each stage's lowest chunk
    # (the longest held) is recomputed
    recompute_lowest: bool = False
    # a forward and a backward both ready run as an overlapped pair (`F3 +B1`)
    pairs: bool = False
    # under a budget, with `pairs`: a forward runs alone only where one more activation of
    # its stage would still fit, so a backward that comes next has a forward to pair with
    # (one that fits only beside a backward waits for one, unless the stage has nothing else)
    room_for_pair: bool = False
    # under a budget, with `pairs`: only the busiest stages pair (`_BUSIEST`); the others run
    # each compute alone, its output leaving at its own end rather than at its pair's, so the
    # round trips through them, and the activations held meanwhile, stay short
    busiest_pairs: bool = False


def _rules(family: _Family, rng: random.Random, pairs: bool = False) -> list[_Rule]:
    """The rules list scheduling tries first, in order; with `pairs` (a layout run in
    overlapped pairs), each with and without pairing in turn."""
    rules = []
    caps = (1.0, 1.5, 2.0, 0.75, 3.0, math.inf, 0.5)
    for cap in caps:
        for backward_first in (True, False):
            for deep in (True, False) if family.num_chunks > 1 else (True,):
                for eager in (False, True) if family.split else (False,):
                    for paired in (True, False) if pairs else (False,):
                        rules.append(_Rule(backward_first, eager, deep, cap, 0.0, 0, pairs=paired))
    rules.extend(
        attrs.evolve(rng.choice(rules[:8]), jitter=0.5, seed=rng.randrange(1 << 30))
        for _ in range(8)
    )
    return rules


def _variants(rule: _Rule, family: _Family, recompute: bool) -> list[_Rule]:
    """Under a memory limit, `rule`'s other ways to choose what to recompute: holding every
    activation that fits now (`owed` off), and with several chunks a stage, recomputing every
    forward of each stage's lowest chunk, the one held longest (`recompute_lowest`); for a rule
    that pairs, it and the first of those keeping room for a pair (`room_for_pair`), or pairing
    on the busiest stages only (`busiest_pairs`)."""
    out = [attrs.evolve(rule, owed=False)]
    if recompute and family.num_chunks > 1:
        out.append(attrs.evolve(rule, recompute_lowest=True))
    if rule.pairs:
        out += [attrs.evolve(r, room_for_pair=True) for r in (rule, out[0])]
        out += [attrs.evolve(r, busiest_pairs=True) for r in (rule, out[0])]
    return out


class _ListScheduler:
    """Builds one order per rule on its own clock: compute costs, a comm cost per hop between
    stages (taken from the sender's time, or with `eager` only in flight), sends that never
    wait; recomputation where the memory budget asks for it; each model replica's microbatches
    through its own segments (DualPipe's layout), and, where the rule says, a forward and a
    backward ready together run as an overlapped pair."""

    def __init__(
        self, p, m, family: _Family, costs: CostModel, budgets, recompute: bool, *, eager=False
    ):
        self.p, self.m, self.family = p, m, family
        self.eager = eager
        self.place = place = family.segments(p)
        # per-stage sizes follow each segment to its stage, as the simulated candidates' do
        scaled = _per_chunk(costs, family.share, place)
        self.num_segments = num = len(place)
        self.cost = []
        for s, c in place:
            model = scaled.at(s, c)
            rec = model.forward if model.recompute is None else model.recompute
            self.cost.append(
                {
                    "F": model.forward,
                    "B": model.backward,
                    "I": model.backward_input,
                    "W": model.backward_weight,
                    "R": rec,
                    "+B": overlapped_pair(model) - model.forward,  # a pair's beyond its forward
                    "comm": model.comm,
                }
            )
        self.act, self.inp = held_sizes(scaled.memory, num)
        self.budgets = budgets
        self.recompute = recompute
        # each replica's segments are a block: its microbatches run from `first` to `last`
        length = num // family.num_replicas
        self.first = [k - k % length for k in range(num)]
        self.last = [f + length - 1 for f in self.first]
        # a replica's last segment (the loss): its backward follows its forward on the stage
        # and frees the activation, waiting on no other stage
        self.loss = [k == last for k, last in enumerate(self.last)]
        of = family.replicas or (0,) * m
        self.batches = [[i for i in range(m) if of[i] == k // length] for k in range(num)]
        self.by_stage = [[k for k, (s, _) in enumerate(place) if s == t] for t in range(p)]
        # a stage's microbatches in flight are counted where they enter it, for each replica
        # apart (one replica's may not hold up another's): its lowest segment on the stage;
        # the cap scales with how deep they go from there
        self.entering = [
            k == min(j for j in self.by_stage[s] if self.first[j] == self.first[k])
            for k, (s, _) in enumerate(place)
        ]
        self.depth = [max(1.0, (self.last[k] + 1 - k) / family.share) for k in range(num)]
        # the stages that pair under `_Rule.busiest_pairs`: per stage, its computes run alone
        work = [
            sum(len(self.batches[k]) * (self.cost[k]["F"] + self.cost[k]["B"]) for k in ks)
            for ks in self.by_stage
        ]
        self.busiest = [w >= _BUSIEST * max(work) for w in work]
        self.sends = [  # a compute whose result leaves the stage pays a comm group after it
            {
                "F": model["comm"] if k < self.last[k] and place[k + 1][0] != s else 0,
                "B": model["comm"] if k > self.first[k] and place[k - 1][0] != s else 0,
            }
            for k, ((s, _), model) in enumerate(zip(place, self.cost))
        ]
        # entering, a forward keeps room for its replica's later chunks on the stage, and for
        # one activation of each other replica there (else those may find none and wait on
        # this one's, which wait on them); but not a loss segment's forward, which frees its
        # own room before any other needs it
        self.rest = []
        for k, (s, _) in enumerate(place):
            rest = 0.0
            if self.entering[k] and not self.loss[k]:
                ours = [j for j in self.by_stage[s] if self.first[j] == self.first[k]]
                rest = sum(self.act[j] for j in ours if j != k)
                others = {self.first[j] for j in self.by_stage[s]} - {self.first[k]}
                for first in others:
                    rest += max(self.act[j] for j in self.by_stage[s] if self.first[j] == first)
            self.rest.append(rest)

    def run(self, rule: _Rule):
        """`(estimated makespan, orders)`, or None when the rule gets stuck under the budget."""
        p, m, L = self.p, self.m, self.num_segments
        split = self.family.split
        batches = self.batches
        rng = random.Random(rule.seed)
        # when each forward's and backward's result is there for its consumer (eagerly, a
        # message still in flight when its stage is free again), and when its stage finished it
        fend = [[None] * L for _ in range(m)]
        bend = [[None] * L for _ in range(m)]
        fdone = [[None] * L for _ in range(m)]
        bdone = [[None] * L for _ in range(m)]
        rend = [[None] * L for _ in range(m)]
        recomputed = [[False] * L for _ in range(m)]
        owing = [0] * L  # per segment, its forwards recomputed whose `R` has not run yet
        nf, nb = [0] * L, [0] * L
        weights: list[list[int]] = [[] for _ in range(L)]  # input gradients without their W yet
        free = [0.0] * p
        held = [0.0] * p
        inflight = [0] * L  # per segment, capped where it enters its stage
        orders: list[list[str]] = [[] for _ in range(p)]
        cap = [rule.cap * depth for depth in self.depth]
        budgets = self.budgets
        only_busiest = rule.busiest_pairs and budgets is not None
        # per stage, whether it runs overlapped pairs
        pairing = [rule.pairs and (busiest or not only_busiest) for busiest in self.busiest]
        room = rule.room_for_pair and rule.pairs and budgets is not None
        reserve = [  # per stage, the room a forward run alone leaves (`_Rule.room_for_pair`)
            max(self.act[k] for k in ks) if room and paired else 0.0
            for ks, paired in zip(self.by_stage, pairing)
        ]
        planning = rule.recompute_lowest and self.recompute and budgets is not None
        lowest = [min(ks) for ks in self.by_stage]
        planned = [  # forwards always recomputed: each stage's lowest of several chunks
            planning and len(self.by_stage[s]) > 1 and k == lowest[s]
            for k, (s, _) in enumerate(self.place)
        ]
        remaining = sum(len(b) for b in batches) * (3 if split else 2)
        bcode = "I" if split else "B"

        def options(s: int):
            """`(rank, ready time, code, microbatch, segment, recomputed, only in a pair)` for
            each compute stage s could run next (deps known); memory-blocked forwards are left
            out."""
            out = []
            # a recomputed activation still to be rebuilt needs its room back before its
            # backward: with `rule.owed`, a forward that would take that room instead is
            # recomputed too, or waits (else the stage may hold what it cannot free)
            pending = 0.0
            if rule.owed and budgets is not None:
                pending = max(
                    (self.act[k] - self.inp[k] for k in self.by_stage[s] if owing[k]), default=0.0
                )
            for k in self.by_stage[s]:
                c = self.place[k][1]
                n = nf[k]
                if n < len(batches[k]) and (not self.entering[k] or inflight[k] < cap[k]):
                    i = batches[k][n]
                    ready = 0.0 if k == self.first[k] else fend[i][k - 1]
                    if ready is not None:
                        # a loss segment's forward frees its room before any rebuilt
                        # activation needs it, and recomputed it would only be repeated at
                        # once: it owes nothing and waits where it does not fit
                        loss = self.loss[k]
                        need = self.act[k] + self.rest[k] + (0.0 if loss else pending)
                        fits = budgets is None or held[s] + need <= budgets[s] + 1e-9
                        if planned[k]:
                            fits = False
                        rec = False
                        if not fits and self.recompute and not loss:
                            rec = held[s] + self.inp[k] + self.rest[k] <= budgets[s] + 1e-9
                        if fits or rec:
                            only_paired = (
                                reserve[s] > 0
                                and held[s] + (self.inp[k] if rec else need) + reserve[s]
                                > budgets[s] + 1e-9
                            )
                            depth_rank = -c if rule.deep_forward else c
                            if self.family.num_replicas > 1:
                                # the replicas in turn: the forward of fewer gone first, then
                                # by chunk (by chunk alone, one replica's would all go first)
                                depth_rank += 2 * self.family.num_chunks * n
                            rank = (1 if rule.backward_first else 0, depth_rank)
                            out.append((rank, ready, "F", i, k, rec, only_paired))
                n = nb[k]
                if n < nf[k]:
                    i = batches[k][n]
                    ready = fend[i][k] if k == self.last[k] else bend[i][k + 1]
                    if ready is not None:
                        rank = (0 if rule.backward_first else 1, -k)
                        if recomputed[i][k] and rend[i][k] is None:
                            fits = budgets is None or held[s] + self.act[k] - self.inp[k] <= (
                                budgets[s] + 1e-9
                            )
                            if fits:
                                out.append((rank, fdone[i][k], "R", i, k, False, False))
                        else:
                            if recomputed[i][k]:
                                ready = max(ready, rend[i][k])
                            out.append((rank, ready, bcode, i, k, False, False))
                if weights[k]:
                    i = weights[k][0]
                    rank = (0 if rule.eager_weight else 2, 0)
                    out.append((rank, bdone[i][k], "W", i, k, False, False))
            return out

        def choose(s: int):
            """`(start, op, partner)`: the compute stage s runs next, when, and with `rule.pairs`
            the ready compute of the other kind it runs beside it as an overlapped pair."""
            found = options(s)
            if not found:
                return None
            # a forward that only fits in a pair waits for a backward, unless nothing else can run
            alone = ([o for o in found if not o[6]] or found) if room else found
            start = max(free[s], min(o[1] for o in alone))
            ready = [o for o in found if o[1] <= start + 1e-12]
            first = ([o for o in ready if not o[6]] or ready) if room else ready
            if rule.jitter:
                noise = {id(o): rule.jitter * rng.random() for o in first}
                op = min(first, key=lambda o: (o[0][0] + noise[id(o)], o[0], o[3]))
            else:
                op = min(first, key=lambda o: (o[0], o[3]))
            partner = None
            if pairing[s] and op[2] in ("F", bcode):
                other = [bcode] if op[2] == "F" else ["F"]
                partners = [o for o in ready if o[2] in other]
                if partners:
                    partner = min(partners, key=lambda o: (o[0], o[3]))
            return start, op, partner

        heap: list = []
        version = [0] * p

        def push(s: int) -> None:
            version[s] += 1
            picked = choose(s)
            if picked is not None:
                start, op, partner = picked
                heapq.heappush(heap, (start, s, version[s], op, partner))

        def name(code: str, i: int, k: int) -> str:
            chunk = self.place[k][1]
            return f"{code}{i}.{chunk}" if chunk else f"{code}{i}"

        for s in range(p):
            push(s)
        makespan = 0.0
        while remaining:
            if not heap:
                return None  # stuck: every stage waits for memory
            start, s, ver, op, partner = heapq.heappop(heap)
            if ver != version[s]:
                continue
            ops = [op] if partner is None else sorted([op, partner], key=lambda o: o[2] != "F")
            if partner is None:
                done = start + self.cost[op[4]][op[2]]
            else:  # the forward's cost, then the backward's rest of the pair
                done = start + self.cost[ops[0][4]]["F"] + self.cost[ops[1][4]]["+B"]
            touched = {s}
            free[s] = done
            for _, _, code, i, k, rec, _ in ops:
                kind = "B" if code == "I" else code
                end = done + self.sends[k].get(kind, 0)
                if not self.eager:
                    free[s] = max(free[s], end)
                makespan = max(makespan, end)
                paired = partner is not None and code != "F"
                orders[s].append(name("+B" if paired else code, i, k))
                if code == "F":
                    nf[k] += 1
                    fend[i][k], fdone[i][k] = end, done
                    inflight[k] += 1
                    if rec:
                        recomputed[i][k] = True
                        owing[k] += 1
                        held[s] += self.inp[k]
                    else:
                        held[s] += self.act[k]
                    if k < self.last[k]:
                        touched.add(self.place[k + 1][0])
                elif code == "R":
                    rend[i][k] = end
                    owing[k] -= 1
                    held[s] += self.act[k] - self.inp[k]
                    remaining += 1  # an extra compute
                elif code == "W":
                    weights[k].pop(0)
                    held[s] -= self.act[k]
                else:
                    nb[k] += 1
                    bend[i][k], bdone[i][k] = end, done
                    inflight[k] -= 1
                    if split and not paired:
                        weights[k].append(i)
                    else:  # a whole backward (a pair's too) frees the activation
                        held[s] -= self.act[k]
                        if split:  # and does its weight gradient's work
                            remaining -= 1
                    if k > self.first[k]:
                        touched.add(self.place[k - 1][0])
                remaining -= 1
            for t in touched:
                push(t)
            if not heap:
                for t in range(p):
                    push(t)
        return makespan, tuple(tuple(row) for row in orders)
