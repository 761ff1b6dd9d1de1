"""V-Half and V-Min (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory",
arXiv 2405.15362): V-shape schedules that trade a little bubble for a half or a third of 1F1B's
activation memory.

Two chunks per stage in a V, as in zb-v (segment k < p on stage k as chunk 0, segment k >= p on
stage 2p - 1 - k as chunk 1), backward split in I and W. Each microbatch repeats one *stable
pattern* every 6 time units (F = I = W = 1 per chunk): stage s starts its chunk-0 forward, its
chunk-1 forward, its chunk-1 input-backward and its chunk-0 input-backward at fixed offsets,
chosen so that the four never meet on a stage and each waits only for its neighbour's:

- V-Half: offsets `2s`, `3p - s - 2`, `3p + g + 2s - 1`, `6p + g - s - 2` with `g = 3` for even
  p (else 0); a microbatch is held about 3p units, so a stage holds about p chunk activations,
  half of 1F1B's 2p (two chunks of p microbatches).
- V-Min: offsets `s`, `2p - s - 1`, `2p + g + s`, `4p + g - s - 1` with `g = 2` when 3 divides p
  (else 0); about 2p/3 chunk activations, a third of 1F1B's.

The orders are built as the paper's reference code builds them, on a plan of one unit per pass:

1. Every F and I at its stable-pattern time, each W in the first idle unit after its I, the
   rest after the end.
2. The start-up (what runs before stage 0's first chunk-0 I) and the cool-down (what runs after
   the first chunk-0 F of the last microbatch that follows that I) are pulled forward: in time
   order, each of their passes moves to the first unit after what it waits for that no pass
   handled before it holds, unless its stage would then hold more chunk activations than the
   busiest stage held before. Then each pass runs as early as the data allows (the paper's
   squeezing).
3. The W are dropped (each now frees its activation in the first idle unit after its I), the
   cool-down is pulled forward again, and the plan with its W placed anew is squeezed.
4. Each W is placed again in the first idle unit after its I (chunk 1's first where several
   wait); a stage's order is its passes in time order.

Properties (F = I = W = 1 per chunk, any m >= 1): a stage holds at most 2*floor(p/2) + 2 chunk
activations under V-Half and 2*floor((p + 1)/3) + 2 under V-Min, against 2p for zb-v and for
1F1B (p microbatches of two chunks); p = 8: 10 and 8 against 16. The price is bubble: p = 4,
m = 8 takes 53 (V-Half) and 59 (V-Min) against zb-v's 51; p = 8, m = 16 takes 113 and 123
against 103.

p = 4, m = 8 (`COLUMNS=100 schedcc show --schedule v-half -p 4 -m 8 -v 2`, one unit per column,
then the compute order per stage; `.1` marks chunk 1), V-Half:

    stage 0 |FFFFF..FIWFIWF..IIWFWFIIWFWFIIWFWFIIWFIWIWWFIIWIWW.IW|
    stage 1 |.FFFF.F.FIWFIW.IWFFIWIWFFIWIWFFIWIFWFIWIIWFWIIIWWWIW.|
    stage 2 |..FFFF.F.FIWFIIWWFF.IIWFWFIIWFWFIIWFWFIIWFIIWIIWWIWWW|
    stage 3 |...FFFFFF..IWIWFFIWIWFFIWIWFFIWIFWFIIWFWFIIIIWWIIWWWW|

    stage 0: F0 F1 F2 F3 F4 F0.1 I0.1 W0.1 F1.1 I1.1 W1.1 F2.1 I0 I2.1 W2.1 F3.1 W0 F5 I1 I3.1 W3.1
             F4.1 W1 F6 I2 I4.1 W4.1 F5.1 W2 F7 I3 I5.1 W5.1 F6.1 I6.1 W6.1 I4 W3 W4 F7.1 I7.1 I5
             W7.1 I6 W5 W6 I7 W7
    stage 1: F0 F1 F2 F3 F0.1 F1.1 I0.1 W0.1 F2.1 I1.1 W1.1 I0 W0 F4 F3.1 I2.1 W2.1 I1 W1 F5 F4.1
             I3.1 W3.1 I2 W2 F6 F5.1 I4.1 W4.1 I3 F7 W3 F6.1 I5.1 W5.1 I4 I6.1 W6.1 F7.1 W4 I5 I7.1
             I6 W7.1 W5 W6 I7 W7
    stage 2: F0 F1 F2 F0.1 F1.1 F2.1 I0.1 W0.1 F3 I1.1 I0 W1.1 W0 F3.1 F4 I1 I2.1 W2.1 F4.1 W1 F5 I2
             I3.1 W3.1 F5.1 W2 F6 I3 I4.1 W4.1 F6.1 W3 F7 I4 I5.1 W5.1 F7.1 I6.1 I5 W6.1 I6 I7.1
             W7.1 W4 I7 W5 W6 W7
    stage 3: F0 F0.1 F1 F1.1 F2 F2.1 I0.1 W0.1 I0 W0 F3 F3.1 I1.1 W1.1 I1 W1 F4 F4.1 I2.1 W2.1 I2 W2
             F5 F5.1 I3.1 W3.1 I3 F6 W3 F6.1 I4.1 I4 W4.1 F7 W4 F7.1 I5.1 I5 I6.1 I6 W5.1 W6.1 I7.1
             I7 W7.1 W5 W6 W7

and V-Min:

    stage 0 |FFF....FIWFIW..IWF.FIIWWFFIIWWFFIIWWFFIIWWFFIIWW.FIIWW...IW|
    stage 1 |.FF...F.FIWF..IIWWFFIIWWFFIIWWFFIIWWFFIIWWFFIIWWF.IIWW..IW.|
    stage 2 |..FF.F.F..IWFIW.IFWIFWIFWIFWIFWIFWIFWIFWIFWIFWIFWIW.IW.IW..|
    stage 3 |...FFFF....IIWWFFIIWWFFIIWWFFIIWWFFIIWWFFIIWWFFIIWW..IIWW..|

    stage 0: F0 F1 F2 F0.1 I0.1 W0.1 F1.1 I1.1 W1.1 I0 W0 F3 F2.1 I2.1 I1 W2.1 W1 F4 F3.1 I3.1 I2
             W3.1 W2 F5 F4.1 I4.1 I3 W4.1 W3 F6 F5.1 I5.1 I4 W5.1 W4 F7 F6.1 I6.1 I5 W6.1 W5 F7.1
             I7.1 I6 W7.1 W6 I7 W7
    stage 1: F0 F1 F0.1 F1.1 I0.1 W0.1 F2 I0 I1.1 W1.1 W0 F2.1 F3 I1 I2.1 W2.1 W1 F3.1 F4 I2 I3.1
             W3.1 W2 F4.1 F5 I3 I4.1 W4.1 W3 F5.1 F6 I4 I5.1 W5.1 W4 F6.1 F7 I5 I6.1 W6.1 W5 F7.1 I6
             I7.1 W7.1 W6 I7 W7
    stage 2: F0 F1 F0.1 F1.1 I0.1 W0.1 F2 I0 W0 I1.1 F2.1 W1.1 I1 F3 W1 I2.1 F3.1 W2.1 I2 F4 W2 I3.1
             F4.1 W3.1 I3 F5 W3 I4.1 F5.1 W4.1 I4 F6 W4 I5.1 F6.1 W5.1 I5 F7 W5 I6.1 F7.1 W6.1 I6 W6
             I7.1 W7.1 I7 W7
    stage 3: F0 F0.1 F1 F1.1 I0.1 I0 W0.1 W0 F2 F2.1 I1.1 I1 W1.1 W1 F3 F3.1 I2.1 I2 W2.1 W2 F4 F4.1
             I3.1 I3 W3.1 W3 F5 F5.1 I4.1 I4 W4.1 W4 F6 F6.1 I5.1 I5 W5.1 W5 F7 F7.1 I6.1 I6 W6.1 W6
             I7.1 I7 W7.1 W7
"""

from __future__ import annotations

from bisect import insort
from collections import defaultdict
from collections.abc import Callable, Iterator
from functools import cached_property
from typing import NamedTuple

from schedcc.ir import BackwardInput, BackwardWeight, Forward, Instruction
from schedcc.schedule import VShape

__all__ = ["VHalf", "VMin"]


class _Pass(NamedTuple):
    """One compute of one microbatch on a stage, as the construction places it."""

    kind: type[Instruction]  # Forward, BackwardInput or BackwardWeight
    chunk: int  # _ANY for a W not yet tied to a chunk
    microbatch: int  # for such a W: the how-many-th W of its stage


_ANY = -1
#: The stable pattern's passes, in the order of `offsets()`.
_PATTERN = ((Forward, 0), (Forward, 1), (BackwardInput, 1), (BackwardInput, 0))
_PERIOD = 6  # F, F, I, I, W, W of one microbatch, one unit each
_HELD = {Forward: 1, BackwardWeight: -1}  # chunk activations a pass adds
_Plan = list[dict[_Pass, int]]  # per stage, the unit each pass starts at


class _VShape(VShape):
    """Two chunks in a V, a stable pattern per stage (see the module docstring)."""

    def offsets(self, stage: int) -> tuple[int, int, int, int]:
        """When stage `stage` starts each pass of microbatch 0 (the stable pattern)."""
        raise NotImplementedError

    @cached_property
    def _orders(self) -> list[list[_Pass]]:
        offsets = [self.offsets(stage) for stage in range(self.num_stages)]
        plan = _plan(offsets, self.num_microbatches)
        return [sorted(times, key=times.__getitem__) for times in plan]

    def order(self, stage: int) -> Iterator[Instruction]:
        m = self.num_microbatches
        for batch in range(self.num_batches):
            first = batch * m
            for kind, chunk, microbatch in self._orders[stage]:
                yield kind(first + microbatch, chunk=chunk)


class VHalf(_VShape):
    """V-Half: a V whose stages hold about half of 1F1B's activations."""

    name = "v-half"

    def offsets(self, stage: int) -> tuple[int, int, int, int]:
        p, s = self.num_stages, stage
        gap = 3 if p % 2 == 0 else 0
        return (2 * s, 3 * p - s - 2, 3 * p + gap + 2 * s - 1, 6 * p + gap - s - 2)


class VMin(_VShape):
    """V-Min: a V whose stages hold about a third of 1F1B's activations."""

    name = "v-min"

    def offsets(self, stage: int) -> tuple[int, int, int, int]:
        p, s = self.num_stages, stage
        gap = 2 if p % 3 == 0 else 0
        return (s, 2 * p - s - 1, 2 * p + gap + s, 4 * p + gap - s - 1)


def _plan(offsets: list[tuple[int, ...]], num_microbatches: int) -> _Plan:
    """The unit each pass starts at on each stage, built in the steps of the module docstring."""
    plan = [_with_weights(t) for t in _stable_pattern(offsets, num_microbatches)]  # step 1
    plan = _squeeze(_pull_forward(plan, start_up=True))  # step 2
    plan = _pull_forward([_without_weights(t) for t in plan], start_up=False)  # step 3
    plan = _squeeze([_with_weights(t) for t in plan])
    return [_with_weights(_without_weights(t), split=True) for t in plan]  # step 4


def _stable_pattern(offsets: list[tuple[int, ...]], num_microbatches: int) -> _Plan:
    """Microbatch i's F and I at its stage's offsets plus 6i."""
    return [
        {_Pass(kind, chunk, i): start + _PERIOD * i
         for (kind, chunk), start in zip(_PATTERN, starts) for i in range(num_microbatches)}
        for starts in offsets
    ]  # fmt: skip


def _with_weights(times: dict[_Pass, int], *, split: bool = False) -> dict[_Pass, int]:
    """`times` and a W per I, each in the first idle unit after its I (chunk 1's first where
    several wait), the rest after the end. Not `split`, the stage's n-th W is `(W, _ANY, n)`."""
    at = {start: p for p, start in times.items()}
    placed = dict(times)
    waiting: dict[int, list[int]] = {1: [], 0: []}
    unit, end = 0, max(at) + 1
    while unit < end or waiting[1] or waiting[0]:
        p = at.get(unit)
        if p is not None and p.kind is BackwardInput:
            waiting[p.chunk].append(p.microbatch)
        elif p is None and (waiting[1] or waiting[0]):
            chunk = 1 if waiting[1] else 0
            weight = _Pass(BackwardWeight, chunk, waiting[chunk].pop(0))
            if not split:
                weight = _Pass(BackwardWeight, _ANY, len(placed) - len(times))
            placed[weight] = unit
        unit += 1
    return placed


def _without_weights(times: dict[_Pass, int]) -> dict[_Pass, int]:
    return {p: start for p, start in times.items() if p.kind is not BackwardWeight}


def _pull_forward(plan: _Plan, *, start_up: bool) -> _Plan:
    """Each pass of the start-up (if `start_up`) and of the cool-down, in time order, moved to
    the first unit after what it waits for that no pass handled before holds, where its stage
    holds no more activations than the plan's busiest stage did; the rest stay."""
    stages = [_Stage(dict(times)) for times in plan]
    cap = max(stage.peak for stage in stages)
    movable = _movable(plan, start_up=start_up)
    for start, s, p in _in_time_order(plan):
        stage = stages[s]
        if movable(start, s):
            for unit in range(_ready(stages, s, p), start):
                if unit not in stage.taken and stage.fits(p, unit, cap):
                    stage.move(p, unit)
                    break
        stage.taken.add(stage.times[p])
    return [stage.times for stage in stages]


def _movable(plan: _Plan, *, start_up: bool) -> Callable[[int, int], bool]:
    """Whether the pass at `(start, stage)` is in the start-up (before stage 0's first chunk-0
    I) or the cool-down (after the first chunk-0 F of the last microbatch, on any stage, that
    comes after that I)."""
    first_input = (plan[0][_Pass(BackwardInput, 0, 0)], 0)
    last = max(p.microbatch for p in plan[0] if p.kind is Forward)
    last_forwards = sorted((times[_Pass(Forward, 0, last)], s) for s, times in enumerate(plan))
    cool_down = next((at for at in last_forwards if at > first_input), None)

    def movable(start: int, stage: int) -> bool:
        if start_up and (start, stage) < first_input:
            return True
        return cool_down is not None and (start, stage) > cool_down

    return movable


def _ready(stages: list[_Stage], stage: int, p: _Pass) -> int:
    """The first unit after every pass `p` waits for (a W: also its stage's n-th I)."""
    ends = [stages[other].times[q] + 1 for other, q in _waits_for(stage, p, len(stages))]
    if p.kind is BackwardWeight:
        ends.append(stages[stage].inputs[p.microbatch] + 1)
    return max(ends, default=0)


def _waits_for(stage: int, p: _Pass, num_stages: int) -> Iterator[tuple[int, _Pass]]:
    """`(stage, pass)` of what `p` waits for but a W's I: the previous microbatch's same pass,
    the pattern's pass before it on its stage, and the same pass on the stage it receives from
    (chunk 0's forward and chunk 1's backward come from stage - 1, the others from stage + 1)."""
    if p.microbatch > 0:
        yield stage, p._replace(microbatch=p.microbatch - 1)
    if p.kind is BackwardWeight:
        return
    index = _PATTERN.index((p.kind, p.chunk))
    if index > 0:
        kind, chunk = _PATTERN[index - 1]
        yield stage, _Pass(kind, chunk, p.microbatch)
    sender = stage - 1 if (p.kind is Forward) == (p.chunk == 0) else stage + 1
    if 0 <= sender < num_stages:
        yield sender, p


def _squeeze(plan: _Plan) -> _Plan:
    """Each stage's passes in the plan's order, each in the first unit after what it waits for
    and after the stage's pass before it (the paper's squeezing)."""
    squeezed: _Plan = [{} for _ in plan]
    free = [0] * len(plan)
    for _, stage, p in _in_time_order(plan):
        ends = [squeezed[other][q] + 1 for other, q in _waits_for(stage, p, len(plan))]
        squeezed[stage][p] = free[stage] = max([free[stage], *ends])
        free[stage] += 1
    return squeezed


def _in_time_order(plan: _Plan) -> list[tuple[int, int, _Pass]]:
    """Every `(start, stage, pass)` of the plan, by start then stage."""
    passes = [(start, stage, p) for stage, times in enumerate(plan) for p, start in times.items()]
    return sorted(passes, key=lambda item: item[:2])


class _Stage:
    """One stage of a plan as `_pull_forward` moves its passes earlier: when each starts, the
    units passes handled so far hold (`taken`), the starts of its I in order, and the chunk
    activations it holds after each unit (an F adds one, a W frees one; on a plan without W,
    each idle unit frees one while an I waits for its W)."""

    def __init__(self, times: dict[_Pass, int]) -> None:
        self.times = times
        self.taken: set[int] = set()
        self.inputs = sorted(t for p, t in times.items() if p.kind is BackwardInput)
        self.implicit = all(p.kind is not BackwardWeight for p in times)
        self.at: dict[int, list[_Pass]] = defaultdict(list)
        for p, start in times.items():
            self.at[start].append(p)
        self.after: list[tuple[int, int]] = []  # (held, I waiting for their W) after each unit
        state = (0, 0)
        for unit in range(max(self.at) + 1):
            state = self._step(state, self.at.get(unit, []))
            self.after.append(state)

    @property
    def peak(self) -> int:
        return max(held for held, _ in self.after)

    def fits(self, p: _Pass, unit: int, cap: int) -> bool:
        """Whether the stage holds at most `cap` with `p` moved to `unit`."""
        if not self.implicit and p.kind is not Forward:
            return True  # an earlier I holds as much, an earlier W less
        return all(held <= cap for _, (held, _) in self._moved(p, unit))

    def move(self, p: _Pass, unit: int) -> None:
        for at, state in list(self._moved(p, unit)):
            self.after[at] = state
        start = self.times[p]
        self.times[p] = unit
        self.at[start].remove(p)
        self.at[unit].append(p)
        if p.kind is BackwardInput:
            self.inputs.remove(start)
            insort(self.inputs, unit)

    def _moved(self, p: _Pass, unit: int) -> Iterator[tuple[int, tuple[int, int]]]:
        """`(unit, state)` from `unit` on with `p` moved there, until the states meet the
        current ones again (past its start, nothing else differs)."""
        start = self.times[p]
        state = self.after[unit - 1] if unit else (0, 0)
        for at in range(unit, len(self.after)):
            passes = [q for q in self.at.get(at, []) if q != p] + ([p] if at == unit else [])
            state = self._step(state, passes)
            yield at, state
            if at >= start and state == self.after[at]:
                return

    def _step(self, state: tuple[int, int], passes: list[_Pass]) -> tuple[int, int]:
        held, waiting = state
        if not passes:
            return (held - 1, waiting - 1) if waiting else state
        for p in passes:
            held += _HELD.get(p.kind, 0)
            waiting += self.implicit and p.kind is BackwardInput
        return held, waiting
