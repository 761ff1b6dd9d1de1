"""`lower_bound`: a makespan no order of a placement and backward form can beat (`schedcc.search`).

[Note: the lower bound] `SearchResult.bound` is the least, over every layout the search may
return an order of (each placement and backward form searched, and each layout a built-in
order fits in: DualPipe's replicas, with its overlapped pairs; [Note: what the bound covers]
in `schedcc.search`), of `lower_bound`: the most, over the stages s, of what stage s alone
proves. Every claim below holds in the rendezvous model the simulator times ([Note: the
rendezvous model] in `schedcc.semantics.units`): a comm group (a maximal run of comm
instructions on a stage) takes its stage's `comm` once, however many messages it holds, after
every partner group is posted; a compute takes its cost; a stage runs its units in order.

1. *Head and tail.* Stage s's first compute starts no earlier than `head(s)`: for one of its
   segments k, the forwards of the segments before k in k's replica, each followed by a hop where
   the next segment lives on another stage (the receiver's group: its `comm`, after the sender
   posted). With a whole backward, its last compute (a backward of one of its segments) is
   followed by the backwards below that segment and their hops, `tail(s)`; with a split one a
   weight gradient may end the run, so `tail(s) = 0`. On a microbatch's path (here, and the
   round trips and holds of items 4, 6 and 7) a backward takes, from its start to its output,
   what it takes alone or, in an overlapped pair, the pair's forward and the rest of the pair
   (the backward's output leaves at the pair's end): no less than alone where the stage's
   segments cost alike. Only as work (item 2) does a `+B` take just what its pair takes
   beyond its forward.
2. *Work.* Between the two, stage s runs every forward and backward of its segments (a whole
   backward at the least of B, I + W and, with overlapped pairs, what a `+B` takes beyond its
   forward), and its recomputations; each chunk's first forward and first backward take
   their warm-ups more ([Note: a step's first computes] in `schedcc.costs`), and each forward
   or backward whose input comes from another stage that stage's `receive` more, the stage's
   first of them its `warmup_receive` more ([Note: a receive's take] in `schedcc.costs`).
3. *Forced groups.* Follow one microbatch from its forward on segment k of stage s to k's
   backward: the forwards up, the backwards down. Each time that path leaves s and comes back,
   the compute it comes back to needs a receive that is posted after the compute it left from
   (posted before, it would wait for its own stage: a deadlock the validator refuses), so stage s
   runs a comm group between the two visits, one per return (`re_k`), and the lowest segment's
   path proves `g0(s)` groups inside the window of item 1, each taking stage s's `comm`.
4. *Memory* (with `memory_limit`, in whole-stage microbatches; no memory model). A microbatch's
   activation on segment k is held from its forward to its last backward piece, or from its
   `Recompute` (then it is recomputed and costs an `R` more); at every instruction a stage holds
   at most `N = floor(limit * share)` chunk activations. Three consequences, over the window of
   item 1 of length `U`:
   - Little's law: the held times add up to at most `N * U`; a microbatch not recomputed is held
     at least `H_k` (its forward, the round trip up the pipeline and back with its hops, its whole
     backward), a recomputed one at least its `R` and its backward;
   - the ramps: a held interval begins at a forward (or an `R`) and ends at a backward (or a
     weight gradient) of the stage, one at a time, so the i-th to begin and the i-th from the
     last to end each leave `N - i` of the limit unheld for at least the least of those
     pieces, `f` and `b`: the held times add up to at most `N * U - (f + b) * N * (N - 1) / 2`
     (the two ramps do not meet: the stage's work alone spaces the intervals' starts and ends
     that far apart, half as far where an overlapped pair may do both);
   - every group of item 3 on a path of a held activation is run while it is held, and a group
     holds at most N at once: the groups number at least `sum over k of (m - x_k) * re_k / N`
     for `x_k` microbatches recomputed on segment k.
   So `U` is at least the least, over real `0 <= x_k <= m` (all 0 without `recompute`), of the
   largest of the work with the recomputations and the groups' comm, the held time and the
   ramps over N, and item 7 (a small linear program, solved exactly at its vertices). An order
   that offloads activations (`Offload`/`Reload`) is not covered: its held count drops between
   the copies, so its layout is bounded without the limit.
   With a memory model (a limit in bytes) the same hold weighted by bytes: at every
   instruction the activations a stage holds take at most its budget `Bs`, the limit less what
   it holds throughout (its parameters as they rest between uses, its optimizer state); a held
   activation of segment k takes `a_k` bytes (a recomputed forward's kept input is left out, as
   its time before the `R`). So the held times weighted by `a_k` add up to at most `Bs * U`, and
   the groups, each run while at most `Bs` bytes are held, number at least the sum over k of
   `(m - x_k) * re_k * a_k / Bs`: the terms above with `N` read as `Bs / a_k` for segment k
   (in the ramps, the largest `a_k / Bs` as `1 / N`). A segment whose `a_k` exceeds `Bs` fits
   no order (the bound is `math.inf`).
5. With a split backward, also: all forwards and input-gradient pieces of stage s, its forced
   groups, then the input gradients below its last one and stage 0's last weight gradient.
   Under a limit, the forwards and input gradients are all of the stage's work but the weight
   gradients still to run when its last input gradient ends; each of those keeps its
   activation held until it runs (`BackwardWeight` frees it), so they are at most what the
   limit holds at once: `n_k` of segment k with `sum(n_k / N_k)` at most 1 (`N_k` read as in
   item 4). That last input gradient is of the stage's lowest segment (each microbatch's comes
   after its own on the segments above), so the chain below follows it as before.
6. *Fill and drain.* For each segment k of stage s, the first backward of k starts no earlier
   than k's head, a forward and the round trip of item 4; every backward of k, and of the
   segments below k on stage s (each microbatch's comes after its backward on k), runs after
   it, then `tail(s)`. And the last forward of k ends after every forward of k and of the
   segments below it on s has run from `head(s)` on; its round trip, its backward and the
   backwards below k (input-gradient pieces, with a split backward) follow.
7. *Start-up.* Stage s runs no backward piece before `T1`, the least over its segments k of
   k's head, a forward and its round trip (item 6), so until then it runs forwards (its
   warm-ups, item 2, may fall there too), recomputations or nothing. And no forward of segment
   k starts before k's head: of its forwards (with their takes) at most `T1 - head(k)` run by
   `T1`, the forwards whose inputs are there in time, `A`. The rest of `T1 - head(s)`, less
   the warm-ups and `A`, the stage idles, limit or none: the window is at least its work and
   that. At p = 8, m = 8, 1:2:1, comm 0.1F, a 1.3x first stage, the V placement's stage 0
   holds the first segment and the last, whose inputs come back only after a microbatch's
   whole way down and up (9.05): of the 9.7 before its first backward, its forwards fill 5.85
   (the 8 of the first segment, 5.2, and one of the last), so the bound is 35.05 where the
   work alone gave 31.2 (a searched order meets it).
   Under a limit no activation is freed before `T1` either, so the forwards and recomputations
   that keep theirs take at most what the limit holds at once of the longest of them, `L` (N
   of them; in bytes a fractional knapsack of `Bs`), and at most `A`. In the rest of the wait
   the stage idles, or runs forwards (within `A`) whose activations it drops and recomputes
   later at `R` each: the window is at least its work, `min(1, R / (F + t))` of what those
   dropped forwards fill (none without `recompute`), where `t` is the forward's take of its
   input (item 2), which the recomputation, its input at hand, does not repeat, and the rest
   of the wait. This is why a tight limit
   costs a stage whose first backward comes late: at p = 4, m = 8, 1:2:1, a 1.3x first stage
   at 0.3x 1F1B's activations, the V placement's stage 0 holds two chunk activations, waits
   4.3 for its first backward and idles or recomputes 3.0 of it (34.2 where the work is 31.2).
8. *Lone computes beside overlapped pairs.* Item 2 prices each microbatch's backward as run in
   a pair, saving what the pair's `+B` takes less than the backward alone (the saving is the
   backward's own: a `+B` costs its pair beyond its forward). No pair runs before `T1` of item
   7 (no backward can) or after the stage's last forward (none is left to pair with), where
   the stage waits at least `D`, the least round trip and backward of its segments. So those
   two stretches, less the stage's warm-ups, are idle, recomputation or lone computes
   (forwards before, within item 7's `A`, backwards after, each at most the longest of its
   kind), and every
   microbatch whose forward or backward runs
   alone saves nothing: the work is at least item 2's, the least saving times the larger of
   the two counts of lone computes, and what of either stretch the stage's microbatches do
   not fill. DualPipe at p = 4, m = 8, comm 1F, a 1.5x last stage: 33.75 where item 2 alone
   gives 30 (stage 3 waits 7.5 for its first backward).
   Under a limit, the forwards before the first backward that keep their activations fill
   at most what the limit holds at once of them (item 7's `L`, of forwards alone: a
   recomputation there takes a place and is work beyond item 2's). The rest of that stretch
   is idle or recomputation, or forwards dropped, each one more lone compute and recomputed
   at item 7's share of what it filled. A kept forward loses less than the idle it fills
   (a pair saves at most a forward), so the bound keeps as many as the limit holds and
   drops the number that loses least. DualPipe-V at p = 4, m = 8, 1:2:1, a 1.3x first
   stage, 0.6x 1F1B's activations: stage 0 waits 4.3 for its first backward and its four
   chunk activations fill 2.6 of it, so 29.0 where the stretch filled by forwards gave 28.15
   (the best order found takes 32.8).

9. *Pairs under the limit.* Item 4 prices each held activation as item 2 prices its work,
   every forward and backward run in a pair. But a pair runs as one span (the forward's cost,
   then the backward's rest, [Note: overlapped pairs] in `schedcc.rules.overlap`): the
   forward's activation is held from the pair's start and its round trip starts at the pair's
   end, and the backward's is held until the pair's end. So where the stage's segments cost
   alike (and every microbatch's factor is 1), the number of pairs `P` is a variable of item
   4's program too: the work is every compute run alone less `F + B - pair` a pair; a kept
   microbatch is held at least its forward, round trip and backward run alone, a recomputed
   one its `R` and its backward, and each pair adds `pair - B` on its backward's side and,
   where its forward's microbatch is kept (at least `P` less the recomputed ones),
   `pair - F` on its forward's. More pairs, less work and more held time: under a tight limit
   the least window has few. DualPipe at p = 4, m = 8, 1:2:1, a 1.3x first stage, 0.6x
   1F1B's activations (two a stage): 29.28 with a split backward where items 4 and 8 give
   28.15.

10. *Three stretches apart* (under a limit that holds N chunk activations of each segment of
   the stage: in whole-stage microbatches, or in bytes where its segments' activations take as
   many; no pairs, one replica). Items 5 and 7 each bound the window with the rest of it
   priced as work, but what they lose falls in stretches apart, so it adds up, with a third
   between them. Let `k` be the stage's lowest segment (each microbatch's path from it comes
   back through the stage's others) and `X` the end of its last forward there, of
   microbatch `i`:
   - before `T1`, item 7's wait less the forwards kept, filled only by forwards dropped;
   - from `X`, for k's round trip, where `X` is after `T1` (it is at least k's head and all
     its forwards): if `i` keeps its activation on `k` (at least one place a segment of the
     stage: `i` holds them all at its turn), no forward of `k` is left and at most N - 1
     other microbatches hold an activation at `X`, so the stage runs only `i`'s computes on
     its other segments, those others' (each at most all it still runs on the stage where
     N - 1 places let it hold two at once, else its backward on `k` or a weight gradient),
     its warm-ups, or recomputations; the rest is idle;
   - after its last input gradient on `k`: with a split backward, the input gradients below
     and stage 0's last weight gradient follow (item 5) while the stage runs only weight
     gradients of what it holds, at most N of them; with a whole one, the tail.
   Each microbatch dropped costs at least the least `R` and fills at most a forward of the first
   stretch and its recomputation and rest in the second; `i` is kept, or dropped (one of the
   drops, and the second stretch then counts nothing). The window is at least the work, the
   least over the number dropped of their recomputations and the idle of the first two
   stretches, and the third's idle. At p = 4, m = 4, 1:2:1, a 1.5x last stage, 0.3x 1F1B's
   activations (two a stage), the looped F/I/W placement's stage 3: 21.5 where items 5 and 7
   gave 21.0 (two forwards dropped in its wait, recomputed to fill its drain; a searched order
   meets it). At p = 8, m = 8, comm 1F, its stage 7 loses 10 before its first backward and 8
   after its last input gradient (the chain below takes 11, the weight gradients it holds 3):
   64.5 where they gave 56.5.

With `eager=True` the bound is of the eager timeline instead ([Note: eager simulation] in
`schedcc.simulate_eager`: sends that never wait, a message in flight for the receive's comm,
taking no stage's time): items 1, 2, 4's Little's law and ramps, 5, 6, 7, 8 and 10 hold as
they are (every hop they count is a message's flight, the consumer starting no earlier than
the producer's end plus it), and the comm groups of items 3 and 4 take nothing, so they drop
out.

Of the updates it counts only what closes the run (`closing`): the stage whose compute ends
last takes its `OptimizerStep` after it, after the `GradNorm` where the program takes one. It
leaves out the rest (`ReduceGrads`, `ReduceTied`), groups beyond those the paths force
(a steady 1F1B runs two per microbatch on a middle stage, but an order may batch the messages
of many microbatches into one group and wait for them instead, so no count per microbatch is
unavoidable), and idle time forced by the dependencies except along the head, tail and paths.

    >>> from schedcc.costs import CostModel
    >>> from schedcc.search import _Family
    >>> lower_bound(4, 8, CostModel(), _Family(1, False, False))
    33.0
    >>> lower_bound(4, 8, CostModel(), _Family(1, False, False), memory_limit=1.0)
    36.0
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from schedcc.costs import CostModel, overlapped_pair, segment_remotes, segment_takes
from schedcc.errors import ScheduleConfigError
from schedcc.semantics.stage_bytes import resident_parameters
from schedcc.sizes import parse_size
from schedcc.tune import _per_chunk, other_cut

__all__ = ["lower_bound"]


def lower_bound(
    num_stages: int,
    num_microbatches: int,
    costs: CostModel,
    family,
    *,
    overlapped: bool = False,
    memory_limit: float | str | Sequence[float | str] | None = None,
    recompute: bool = True,
    data_parallel: int = 1,
    zero: int = 0,
    eager: bool = False,
    grad_norm: bool = False,
) -> float:
    """The makespan no order of `family` beats ([Note: the lower bound]); costs at v = 1.

    Args:
        num_stages, num_microbatches: the shape.
        costs: per-stage costs at v = 1 ([Note: tune's units]).
        family: the placement and backward form (`schedcc.search`'s `_Family`).
        overlapped: its forwards and backwards may run as overlapped pairs (a pair costs
            `overlapped_pair`, less than F + B).
        memory_limit: the most whole-stage microbatch activations per stage, or with a memory
            model (`costs.memory`) the most bytes (a size such as "12GiB" too); a number, or one
            per stage; None: no limit.
        recompute: the orders may recompute forwards (`R`) to fit the limit.
        data_parallel, zero: what a stage's parameters and optimizer state take of a byte
            limit (as `schedcc.compile`'s).
        eager: bound the eager timeline (`simulate(..., eager=True)`) instead of the
            rendezvous one: no comm groups on the stages.
        grad_norm: the programs take the global gradient norm (`closing`).

    Returns:
        The bound; `math.inf` where a limit leaves no room for one chunk activation.

    Raises:
        ScheduleConfigError: bytes measured on another cut than the family's ([Note: a
            measured cut] in `schedcc.memory_model`).
    """
    mismatch = other_cut(costs.memory, num_stages, family.share)
    if mismatch is not None:
        raise ScheduleConfigError(f"lower_bound: {mismatch}")
    bound = _Bound(num_stages, num_microbatches, costs, family, overlapped, eager)
    limits = None
    if memory_limit is not None:
        values = (
            [memory_limit] * num_stages
            if isinstance(memory_limit, (int, float, str))
            else list(memory_limit)
        )
        limits = [float(parse_size(lim) if isinstance(lim, str) else lim) for lim in values]
    rooms = bound.all_rooms(limits, data_parallel, zero)
    if rooms is None:
        return math.inf
    best = max(bound.stage(s, rooms[s], recompute) for s in range(num_stages))
    return best + closing(costs, num_stages, grad_norm)


def closing(costs: CostModel, num_stages: int, grad_norm: bool = False) -> float:
    """What follows the last compute of a run, at least: the stage that runs it then takes
    its optimizer step, after the gradient norm's collective where the program takes one (it
    starts once that stage is there); the least of that over the stages.

    >>> closing(CostModel(step=1.0, norm=0.5, per_stage={1: CostModel(step=0.8)}), 2, True)
    0.8
    """
    return min(
        costs.at(s).step + (costs.at(s).norm if grad_norm else 0.0) for s in range(num_stages)
    )


class _Bound:
    """What one family's bound reads per segment: costs, paths and returns ([Note: the lower
    bound])."""

    def __init__(
        self, p: int, m: int, costs: CostModel, family, overlapped: bool, eager: bool = False
    ):
        self.p, self.split, self.overlapped = p, family.split, overlapped
        self.single = family.num_replicas == 1
        self.place = place = family.segments(p)
        scaled = _per_chunk(costs, family.share, place)
        num = len(place)
        length = num // family.num_replicas
        self.first = [k - k % length for k in range(num)]  # the replica's first segment
        self.end = [f + length - 1 for f in self.first]  # and its last
        factors = costs.per_microbatch or (1.0,)
        self.fewest = min(factors)  # the least factor of any microbatch
        of = list(family.replicas) or [0] * m
        self.count, self.total, self.least, self.heaviest = [], [], [], []  # per segment
        for k in range(num):
            mine = [factors[i % len(factors)] for i in range(m) if of[i] == k // length]
            self.count.append(len(mine))
            self.total.append(sum(mine))
            self.least.append(min(mine, default=1.0))
            self.heaviest.append(max(mine, default=1.0))
        self.models = [scaled.at(s, c) for s, c in place]
        # each chunk's first forward and first backward of the run warm up, and each stage's
        # first take of a message, whichever segment's (below)
        self.warm = [0.0] * p
        for (s, _), model in zip(place, self.models, strict=True):
            self.warm[s] += model.warmup_forward + model.warmup_backward
        # each message from another stage is taken on its receiver's time: [Note: a receive's
        # take] in `schedcc.costs` (a forward's input, a backward's gradient)
        taken = segment_takes(place, self.models, length)
        self.take_in = [up for up, _ in taken]  # per segment: its forward's
        self.take_back = [down for _, down in taken]  # and its backward's
        self.takes = [0.0] * p
        for k, (s, _) in enumerate(place):
            self.takes[s] += self.count[k] * sum(taken[k])
        remote = segment_remotes(place, length)
        for s in range(p):
            first = [
                model.warmup_receive
                for k, ((t, _), model) in enumerate(zip(place, self.models, strict=True))
                if t == s and self.count[k] and any(remote[k])
            ]
            self.warm[s] += min(first, default=0.0)
        self.memory = scaled.memory
        self.share = family.share
        chunks = max(c for _, c in place) + 1
        self.comm = [min(scaled.at(s, c).comm for c in range(chunks)) for s in range(p)]
        # what a comm group takes of its stage's time: nothing when sends never wait
        self.group = [0.0] * p if eager else self.comm
        self.on = [[k for k, (t, _) in enumerate(place) if t == s] for s in range(p)]

    # -- per segment ------------------------------------------------------------------------

    def whole(self, k: int) -> float:
        """The least a microbatch's whole backward on segment k takes."""
        model = self.models[k]
        backward = model.backward
        if self.split:
            backward = min(backward, model.backward_input + model.backward_weight)
        if self.overlapped:
            backward = min(backward, overlapped_pair(model) - model.forward)
        return backward

    def piece(self, k: int) -> float:
        """The least until segment k's input gradient exists, from its backward's start."""
        model = self.models[k]
        backward = model.backward
        if self.split:
            backward = min(backward, model.backward_input)
        return backward

    def span(self, k: int, alone: float) -> float:
        """The least a backward of segment k spans on its microbatch's path, from its start to
        its output (`alone` is what it takes run alone: whole, or to its input gradient): in an
        overlapped pair the pair's forward runs first and the backward's output leaves at the
        pair's end (a pair's forward, of another microbatch and any segment of the stage,
        its cost; the backward the rest of its pair, `overlapped_pair`), no less than `alone`
        where the stage's segments cost alike."""
        least = self.least[k]
        span = least * alone
        if self.overlapped:
            model = self.models[k]
            forward = self.fewest * min(self.models[j].forward for j in self.on[self.place[k][0]])
            span = min(span, forward + least * (overlapped_pair(model) - model.forward))
        return span

    def hop(self, k: int, j: int) -> float:
        """From segment k to segment j: the receiver's group, where they are on two stages."""
        s, t = self.place[k][0], self.place[j][0]
        return 0.0 if s == t else self.comm[t]

    def head(self, k: int) -> float:
        least = self.least[k]
        return sum(
            least * self.models[j].forward + self.hop(j, j + 1) for j in range(self.first[k], k)
        )

    def tail(self, k: int) -> float:
        below = range(self.first[k], k)
        return sum(self.span(j, self.piece(j)) + self.hop(j + 1, j) for j in below)

    def round_trip(self, k: int) -> float:
        """From segment k's forward's end to its backward's start: up and back down."""
        least, up = self.least[k], range(k + 1, self.end[k] + 1)
        compute = sum(least * self.models[j].forward + self.span(j, self.piece(j)) for j in up)
        hops = sum(self.hop(j - 1, j) + self.hop(j, j - 1) for j in up)
        return compute + hops

    def returns(self, k: int) -> int:
        """How often one microbatch's path from segment k's forward to its backward comes back
        to k's stage after leaving it (the groups it forces there)."""
        s = self.place[k][0]
        up = [self.place[j][0] == s for j in range(k, self.end[k] + 1)]
        path = up + up[::-1]  # on s or not, at each compute of the path
        return sum(b and not a for a, b in itertools.pairwise(path))

    # -- per stage --------------------------------------------------------------------------

    def rooms(self, s: int, limit: float, data_parallel: int, zero: int) -> list[float]:
        """Per segment of stage s, how many of its activations the limit holds at once: in
        whole-stage microbatches, `floor(limit * share)` chunk activations; in bytes, the
        budget over the segment's activation bytes (item 4 of the Note)."""
        ks = self.on[s]
        if self.memory is None:
            return [math.floor(limit * self.share * (1 + 1e-9) + 1e-9)] * len(ks)
        memory = self.memory
        state = sum(memory.at("optimizer", k) for k in ks)
        budget = limit - sum(
            resident_parameters(memory.at("parameters", k), zero=zero, data_parallel=data_parallel)
            for k in ks
        ) - (state / data_parallel if zero >= 1 else state)
        out = []
        for k in ks:
            size = memory.at("activations", k)
            out.append(math.inf if size <= 0 else budget / size * (1 + 1e-9))
        return out

    def all_rooms(self, limits, data_parallel: int, zero: int) -> list | None:
        """Per stage, `rooms` under `limits` (one per stage; None: no limit, and each stage's
        rooms None); None where a limit leaves no room for one chunk activation."""
        if limits is None:
            return [None] * self.p
        out = []
        for s in range(self.p):
            rooms = self.rooms(s, limits[s], data_parallel, zero)
            if any(room < 1 for room in rooms):
                return None
            out.append(rooms)
        return out

    def stage(self, s: int, rooms: Sequence[float] | None, recompute: bool) -> float:
        ks = self.on[s]
        if not ks:
            return 0.0
        head = min(self.head(k) for k in ks)
        tail = 0.0 if self.split else min(self.tail(k) for k in ks)
        forced = max(self.returns(k) for k in ks)
        comm = self.group[s]
        work = 0.0
        for k in ks:
            model = self.models[k]
            both = model.forward + self.whole(k)
            if self.overlapped:
                both = min(both, overlapped_pair(model))
            work += self.total[k] * both
        work += self.warm[s] + self.takes[s]
        window = work + comm * forced
        if rooms is not None:
            window = max(window, self._window(ks, rooms, recompute, work, forced, comm))
        else:
            window = max(window, work + self._start_up(ks, None, recompute))
        if self.overlapped:
            window = max(window, work + self._unpaired(ks, head, rooms, recompute))
        best = max(head + window + tail, self._fill_and_drain(ks, head, tail))
        if self.split and not self.overlapped and self.single:
            best = max(best, self._split_end(s, ks, head, forced, rooms))
        if rooms is not None and not self.overlapped and self.single and _alike(rooms):
            best = max(best, self._drained(s, ks, head, work, rooms, recompute))
        return best

    def _unpaired(self, ks, head: float, rooms, recompute: bool) -> float:
        """Item 8: what the stage's work priced as overlapped pairs leaves out before its first
        backward and after its last forward, where no pair can run; under a limit (`rooms`),
        the forwards before the first backward are those the limit keeps and those dropped."""
        alone = [self._alone(k) for k in ks]
        saved = min(
            self.least[k] * max(0.0, b - (overlapped_pair(self.models[k]) - self.models[k].forward))
            for k, b in zip(ks, alone)
        )
        first = self._first_backward(ks)
        end = min(self.round_trip(k) + self.least[k] * b for k, b in zip(ks, alone))
        forward = max(self.heaviest[k] * self.models[k].forward + self.take_in[k] for k in ks)
        backward = max(self._backward_taken(k) for k in ks)
        n = sum(self.count[k] for k in ks)
        warm = self.warm[self.place[ks[0]][0]]  # warm-ups may fill either stretch too
        # after the last forward: idle, recomputation or lone backwards, each at most `backward`
        wait = max(0.0, end - warm)
        drain = 0.0 if backward <= 0 else min(wait, n * backward)
        lost = wait - drain
        last = n if backward <= 0 else drain / backward
        # before the first backward: idle, recomputation or lone forwards whose inputs are
        # there (item 7), each at most `forward`
        wait = max(0.0, first - head - warm)
        ran = self._inputs_by(ks, first)
        if forward <= 0:
            return lost + wait + saved * n
        if rooms is None:  # each of them keeps its activation, none dropped
            kept, most, cheapest = min(wait, n * forward, ran), 0.0, 1.0
        else:
            # under a limit the forwards that keep their activations fill at most what it
            # holds at once (none is freed before a backward; fewer, where recomputations hold
            # some then); the rest of the wait is idle or recomputation, or forwards dropped
            # (with `recompute`) filling y of it, recomputed later at `cheapest` of that (item
            # 7): more kept forwards lose less, so as many as the limit holds are kept
            takes = [self.heaviest[k] * self.models[k].forward + self.take_in[k] for k in ks]
            kept = min(wait, ran, self._most_held(ks, rooms, takes))
            cheapest = self._cheapest_redo(ks)
            most = max(0.0, min(wait, ran) - kept) if recompute else 0.0

        def loss(y: float) -> float:
            return lost + wait - kept - (1 - cheapest) * y + saved * max((kept + y) / forward, last)

        # convex in y: least at an end or where the lone count's maximum turns
        return min(loss(min(max(0.0, y), most)) for y in (0.0, most, last * forward - kept))

    def _alone(self, k: int) -> float:
        """The least a microbatch's backward on segment k takes outside a pair."""
        model = self.models[k]
        if self.split:
            return min(model.backward, model.backward_input + model.backward_weight)
        return model.backward

    def _backward_taken(self, k: int) -> float:
        """The most a microbatch's backward on segment k takes outside a pair, with its take
        of the gradient."""
        return self.heaviest[k] * self._longest_backward(k) + self.take_back[k]

    def _longest_backward(self, k: int) -> float:
        """The most a microbatch's backward on segment k takes outside a pair."""
        model = self.models[k]
        if self.split:
            return max(model.backward, model.backward_input + model.backward_weight)
        return model.backward

    def _fill_and_drain(self, ks, head: float, tail: float) -> float:
        """Item 6 of the Note: for each segment k of the stage, its first backward waits for
        a round trip, and then every backward of k and of the segments below it on the stage
        is still to run; its last forward comes after every forward of those, and a round trip
        and the backwards below it follow."""
        best = 0.0
        for k in ks:
            below = [j for j in ks if self.first[j] == self.first[k] and j <= k]
            trip = self.round_trip(k)
            fill = self.head(k) + self.least[k] * self.models[k].forward + trip
            fill += sum(self.total[j] * self.whole(j) for j in below) + tail
            back = self.span(k, self._alone(k))
            last = back + self.tail(k)
            if self.split:
                last = max(back, self.span(k, self.piece(k)) + self.tail(k))
            drain = head + sum(self.total[j] * self.models[j].forward for j in below)
            best = max(best, fill, drain + trip + last)
        return best

    def _window(self, ks, rooms: Sequence[float], recompute: bool, work, forced, comm) -> float:
        """The least window a stage needs that holds at most `rooms[i]` activations of its
        segment `ks[i]` at once (item 4 of the Note)."""
        n = len(ks)
        r, held, held_r, re, count = [], [], [], [], []
        for k in ks:
            model = self.models[k]
            redo = self._redo(k)
            r.append(self.least[k] * redo)
            last = self.span(k, self._alone(k))
            held.append(self.least[k] * model.forward + self.round_trip(k) + last)
            held_r.append(self.least[k] * redo + last)
            re.append(self.returns(k))
            count.append(self.count[k])
        # what the comm groups add to the work: (constant, slope per x_k)
        groups = [
            (comm * forced, r),
            (
                comm * sum(c * e / room for c, e, room in zip(count, re, rooms)),
                [r[i] - comm * re[i] / rooms[i] for i in range(n)],
            ),
        ]
        ramps = self._ramps(ks, rooms)
        start_up = self._start_up(ks, rooms, recompute)
        upper = count if recompute else [0] * n
        paired = self._pairs_alike(ks)
        if paired is None:
            # each piece is (constant, slope per x_k); the window is the largest of them
            pieces = [(work + a, b) for a, b in groups]
            pieces += [
                (
                    sum(c * h / room for c, h, room in zip(count, held, rooms)) + ramps,
                    [(held_r[i] - held[i]) / rooms[i] for i in range(n)],
                ),
                (work + start_up, [0.0] * n),
            ]
            return _min_of_max(pieces, upper)
        # item 9: how many computes run as pairs, P, is a variable too (the last)
        forward, backward, pair = paired
        saving = forward + backward - pair
        lone = work + saving * sum(count)  # the work with every compute run alone
        widest = max(rooms)  # the least share of the limit one activation takes
        kept = [forward + self.round_trip(k) + backward for k in ks]
        redone = [self.least[k] * self._redo(k) + backward for k in ks]
        held = sum(c * h / room for c, h, room in zip(count, kept, rooms)) + ramps
        slopes = [(redone[i] - kept[i]) / rooms[i] for i in range(n)]
        pieces = [(lone + a, [*b, -saving]) for a, b in groups]
        pieces += [
            (held, [*slopes, (pair - backward) / widest]),  # each pair's backward side
            (  # and its forward's, where that microbatch is kept
                held,
                [
                    *(slope - (pair - forward) / widest for slope in slopes),
                    (2 * pair - forward - backward) / widest,
                ],
            ),
            (lone + start_up, [0.0] * n + [-saving]),
        ]
        upper = [*upper, sum(count)]
        return _min_of_max(pieces, upper)

    def _pairs_alike(self, ks) -> tuple[float, float, float] | None:
        """`(F, B, pair)` where stage segments `ks` may run as overlapped pairs that save time
        and every forward, lone backward and pair of them costs the same (their costs alike,
        every microbatch's factor 1: item 9 of the Note); else None."""
        if not self.overlapped:
            return None
        if any(self.least[k] != 1.0 or self.heaviest[k] != 1.0 for k in ks):
            return None
        alike = {
            (self.models[k].forward, self._alone(k), overlapped_pair(self.models[k]))
            for k in ks
        }
        if len(alike) != 1:
            return None
        forward, backward, pair = alike.pop()
        return (forward, backward, pair) if forward + backward > pair else None

    def _start_up(self, ks, rooms: Sequence[float] | None, recompute: bool) -> float:
        """Item 7: the time stage s loses before its first backward, idle or recomputing
        (`rooms`: per segment, the activations the limit holds at once; None: no limit)."""
        short, droppable = self._short(ks, rooms)
        if short <= 0:
            return 0.0
        if not recompute or rooms is None:  # none dropped: the rest of the wait is idle
            return short
        dropped = min(short, droppable)  # forwards run and recomputed later
        return short - (1 - self._cheapest_redo(ks)) * dropped

    def _short(self, ks, rooms: Sequence[float] | None) -> tuple[float, float]:
        """Item 7's wait before the first backward that the forwards keeping their
        activations leave unfilled, and how much of it forwards whose inputs are there could
        fill if their activations are dropped."""
        first = self._first_backward(ks)
        head = min(self.head(k) for k in ks)
        wait = first - head - self.warm[self.place[ks[0]][0]]  # warm-ups may fill it too
        if wait <= 0:
            return 0.0, 0.0
        ran = self._inputs_by(ks, first)
        kept = ran
        if rooms is not None:
            longest = [  # a forward with its take
                self.heaviest[k] * max(self.models[k].forward, self._redo(k)) + self.take_in[k]
                for k in ks
            ]
            kept = min(ran, self._most_held(ks, rooms, longest))
        return max(0.0, wait - kept), max(0.0, ran - kept)

    def _drained(self, s: int, ks, head: float, work: float, rooms, recompute: bool) -> float:
        """Item 10: the stage's work, what it loses before its first backward (item 7) and
        after the last forward of its lowest segment, and the end of item 5, under a limit
        that holds N activations of each of its segments (`rooms`, all N)."""
        low = min(ks)  # each microbatch's path from it comes back through the others on s
        higher = [k for k in ks if k != low]
        n = math.floor(rooms[0])
        own = sum(  # the last microbatch's computes on s between its forward on low and back
            self.heaviest[k] * self.models[k].forward + self.take_in[k] + self._backward_taken(k)
            for k in higher
        )
        # all a microbatch still runs on s after its forward on low
        full = own + self._backward_taken(low)
        if n >= 3:
            each = full
        else:  # a second microbatch's computes above low need two more places at once
            weights = [self.heaviest[k] * self.models[k].backward_weight for k in higher]
            each = max([self._backward_taken(low), *weights])
        others = min(n - 1, self.count[low] - 1)
        last = head + self.total[low] * self.models[low].forward  # its last forward ends after
        if n < len(ks):
            gap = math.inf  # the last microbatch cannot keep its activation on low
        elif last >= self._first_backward(ks) - 1e-9:
            gap = max(0.0, self.round_trip(low) - own - others * each - self.warm[s])
        else:
            gap = 0.0
        short, droppable = self._short(ks, rooms)
        if not recompute:
            lost = short + gap
        else:
            redo = min(self.least[k] * self._redo(k) for k in ks)  # a drop's least cost
            fills = max(  # the most a dropped forward fills of the wait before
                self.heaviest[k] * self.models[k].forward + self.take_in[k] for k in ks
            )
            drains = max(self.heaviest[k] * self._redo(k) for k in ks) + full

            def lost_with(d: float, gap: float) -> float:
                before = short - min(d * fills, droppable)
                return redo * d + max(0.0, before) + max(0.0, gap - d * drains)

            most = float(sum(self.count[k] for k in ks))  # a drop a forward, at most
            ends = [0.0, 1.0, most]
            ends += [short / fills, droppable / fills] if fills > 0 else []
            ends += [gap / drains] if drains > 0 and gap < math.inf else []
            tries = [min(max(0.0, d), most) for d in ends]
            # the last microbatch kept on low, or dropped there: one of the drops (its
            # forward may fill the wait before, its recomputation the drain)
            lost = min(
                min(lost_with(d, gap) for d in tries),
                min(lost_with(d, 0.0) for d in tries if d >= 1),
            )
        if lost == math.inf:
            return 0.0
        end = self.tail(low)
        if self.split:  # after its last input gradient, the stage runs weight gradients alone
            end = 0.0 if s == 0 else self._below_last_input(low) - self._held_weights(ks, rooms)
        return head + work + lost + max(0.0, end)

    def _cheapest_redo(self, ks) -> float:
        """The least share, over segments `ks`, of what a dropped forward filled of its
        stage's wait that its recomputation costs later (at most 1): the forward took its
        input's take there, the recomputation has it at hand (item 7)."""
        cheapest = 1.0
        for k in ks:
            filled = self.least[k] * self.models[k].forward + self.take_in[k]
            if filled > 0:
                cheapest = min(cheapest, self.least[k] * self._redo(k) / filled)
        return cheapest

    def _inputs_by(self, ks, until: float) -> float:
        """Item 7's `A`: the most forward work (with its takes) segments `ks` of one stage
        can run before `until`, each segment's none before its head."""
        return sum(
            min(
                self.total[k] * self.models[k].forward + self.count[k] * self.take_in[k],
                max(0.0, until - self.head(k)),
            )
            for k in ks
        )

    def _first_backward(self, ks) -> float:
        """The earliest a backward of segments `ks` can start: a head, a forward, a round
        trip."""
        return min(
            self.head(k) + self.least[k] * self.models[k].forward + self.round_trip(k)
            for k in ks
        )

    def _ramps(self, ks, rooms: Sequence[float]) -> float:
        """Item 4's ramps: the held share of the limit the window cannot use while its stage
        starts holding activations and while it frees its last ones."""
        most = max(1 / room for room in rooms)  # the largest share one activation takes
        if most <= 0:
            return 0.0
        # the stage's held intervals begin at forwards (or recomputations) and end at
        # backwards (or weight gradients), one at a time, at least this far apart
        start = min(
            self.least[k] * min(self.models[k].forward, self._redo(k)) for k in ks
        )
        end = min(self.least[k] * self._frees(k) for k in ks)
        # the i-th interval to begin (or the i-th from the last to end) leaves 1 - i * most
        # of the limit unused for one spacing. The two ramps do not meet: the stage's work
        # spaces its intervals' starts and ends at least that far apart over the window (half
        # as far where an overlapped pair may start one interval and end another)
        intervals = sum(self.count[k] for k in ks)
        ramp = min(math.ceil(1 / most) - 1, intervals // 2 if self.overlapped else intervals)
        return (start + end) * (ramp - most * ramp * (ramp + 1) / 2)

    def _redo(self, k: int) -> float:
        model = self.models[k]
        return model.forward if model.recompute is None else model.recompute

    def _frees(self, k: int) -> float:
        """The least an instruction that frees segment k's activation takes: its whole
        backward, or with a split one its weight gradient (an overlapped pair takes at least
        its backward)."""
        model = self.models[k]
        if self.split:
            return min(model.backward, model.backward_weight)
        return model.backward

    def _split_end(self, s: int, ks, head: float, forced: int, rooms=None) -> float:
        """Item 5: the forwards and input gradients of stage s, its groups, the input gradients
        below its last one and stage 0's last weight gradient; under a limit (`rooms`), the
        whole work of stage s less the weight gradients it can still hold then."""
        ahead = sum(self.total[k] * (self.models[k].forward + self.piece(k)) for k in ks)
        if s == 0:
            return head + ahead + self.group[s] * forced
        if rooms is not None:
            work = sum(self.total[k] * (self.models[k].forward + self.whole(k)) for k in ks)
            ahead = max(ahead, work - self._held_weights(ks, rooms))
        return head + ahead + self.group[s] * forced + self._below_last_input(min(ks))

    def _below_last_input(self, low: int) -> float:
        """Item 5: what follows a stage's last input gradient, of its lowest segment `low`
        (split backwards): the input gradients below it and stage 0's last weight gradient."""
        zero = self.models[0]
        last = self.least[0] * max(
            0.0, min(zero.backward_weight, zero.backward - zero.backward_input)
        )
        return self.tail(low) + last

    def _held_weights(self, ks, rooms: Sequence[float]) -> float:
        """The most the weight gradients of the activations a stage holds at once take."""
        weights = [self.heaviest[k] * self.models[k].backward_weight for k in ks]
        return self._most_held(ks, rooms, weights)

    def _most_held(self, ks, rooms: Sequence[float], each: Sequence[float]) -> float:
        """The most `sum(n_k * each[i])` over activations the limit can hold at once: `n_k`
        of segment `k = ks[i]` with `sum(n_k / room_k)` at most 1 and `n_k` at most its
        microbatches; the largest first (a fractional knapsack)."""
        left, most = 1.0, 0.0
        counts = [self.count[k] for k in ks]
        for w, room, count in sorted(zip(each, rooms, counts), key=lambda x: -x[0] * x[1]):
            n = min(count, left * room)
            most += n * w
            left -= n / room
            if left <= 0:
                break
        return most


def _alike(rooms: Sequence[float]) -> bool:
    """Whether a limit holds as many activations of each of a stage's segments, and some:
    in whole-stage microbatches always, in bytes where their activations take as many."""
    return math.isfinite(rooms[0]) and all(math.isclose(r, rooms[0]) for r in rooms)


def _min_of_max(pieces, upper: Sequence[float]) -> float:
    """The least over `0 <= x_i <= upper[i]` of the largest `a + sum(b_i * x_i)` of `pieces`
    (`(a, b)` pairs): convex and piecewise linear, so it is least at a point where n of the
    box's faces and the pieces' pairwise equalities meet; try them all (n is the segments of
    one stage: 1 or 2)."""
    n = len(upper)

    def value(x) -> float:
        return max(a + sum(b[i] * x[i] for i in range(n)) for a, b in pieces)

    # each equation: (coefficients, right-hand side)
    equations = []
    for i in range(n):
        unit = [1.0 if j == i else 0.0 for j in range(n)]
        equations += [(unit, 0.0), (unit, float(upper[i]))]
    for (a, b), (c, d) in itertools.combinations(pieces, 2):
        equations.append(([b[i] - d[i] for i in range(n)], c - a))
    best = value([0.0] * n)
    for chosen in itertools.combinations(equations, n):
        x = _solve([row for row, _ in chosen], [rhs for _, rhs in chosen])
        if x is None:
            continue
        x = [min(max(xi, 0.0), float(hi)) for xi, hi in zip(x, upper)]
        best = min(best, value(x))
    return best


def _solve(rows, rhs) -> list[float] | None:
    """The solution of a square linear system by Gaussian elimination, or None if singular."""
    n = len(rows)
    grid = [[*row, b] for row, b in zip(rows, rhs)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(grid[r][col]))
        if abs(grid[pivot][col]) < 1e-12:
            return None
        grid[col], grid[pivot] = grid[pivot], grid[col]
        for r in range(n):
            if r != col:
                factor = grid[r][col] / grid[col][col]
                grid[r] = [a - factor * b for a, b in zip(grid[r], grid[col])]
    return [grid[i][n] / grid[i][i] for i in range(n)]
