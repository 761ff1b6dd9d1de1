"""Local search over the orders `schedcc.search` finds: the moves, and a quick clock to screen
them ([Note: the quick clock]).

[Note: the quick clock] Compiling and simulating one order takes milliseconds (the compiler
lowers its messages and the validator proves it), so a local search that times every neighbour
that way sees a few hundred and stops at the first local optimum. `QuickClock` times an order
of computes (F, B, I, W, R) directly in the eager timeline ([Note: eager simulation] in
`schedcc.simulate_eager`; each chunk's first forward and backward warmed up as the simulators
warm them, [Note: a step's first computes] in `schedcc.costs`): each stage runs its computes in
order, each starting once its stage is free and its input is there (the producer's end, plus
the receiving stage's comm where the producer is on another stage, the compute then taking its
`receive` more); a forward holds its activation until its backward (with a split backward, its
weight gradient), or, when its stage recomputes it, only its input until the `R`; an
overlapped pair (`F3.1 +B1`, DualPipe's) starts once the inputs of both are there, and its
forward's output leaves at the pair's end; each microbatch runs the segments of its replica.
For an order the compiler accepts it gives the simulator's makespan, in well under a
millisecond; in whole-stage microbatches it says over budget exactly where the simulated order
does not fit, and in bytes it may call an order over budget that fits (its budget sets aside
each segment's parameters, gradients and optimizer state throughout), never one that does not
(property tests hold it to both). It is a screen all the same: an order it times faster is
compiled and simulated like every other candidate, and only that timing counts. It adds each
stage's optimizer step after its last compute, and leaves out the other updates (free in the
default costs; with measured ones they follow each stage's last compute, and the norm's and a
tied head's collectives wait for the last stage there, so they add about the same to every
order of a placement) and the rendezvous model's comm groups: for a
rendezvous search its time is only a guide. Orders with sends or copies are timed by the
simulator alone.
"""

from __future__ import annotations

import collections
import functools
import math
import random
from collections.abc import Iterator, Sequence

from schedcc.costs import CostModel, segment_remotes, segment_takes
from schedcc.ir import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    OverlappedBackward,
    Recompute,
    parse,
)

__all__ = [
    "QuickClock", "fewer_recomputes", "held_sizes", "kick", "move", "moved_everywhere",
    "neighbours", "recomputes", "same_thread",
]

_F, _B, _I, _W, _R, _P = range(6)  # _P: an overlapped pair's backward
#: The computes whose first of a segment in a run warms up, and the cost field it reads
#: ([Note: a step's first computes] in `schedcc.costs`).
_WARM_OF = {
    _F: "warmup_forward",
    _B: "warmup_backward",
    _I: "warmup_backward",
    _P: "warmup_backward",
}
_CODES = {
    Forward: _F, Backward: _B, BackwardInput: _I, BackwardWeight: _W, Recompute: _R,
    OverlappedBackward: _P,
}  # fmt: skip

Orders = tuple[tuple[str, ...], ...]
_ROWS_KEPT = 4096  # rows a clock keeps as read before it starts again


class QuickClock:
    """Times orders of computes of one placement in the eager timeline ([Note: the quick
    clock]).

    Args:
        place: `(stage, chunk)` of each segment, the replicas' one after the other.
        costs: the costs in the orders' units (per chunk, `schedcc.tune`'s `_per_chunk`), with
            the bytes a stage holds where there is a memory model (`held_sizes`).
        budgets: per stage, the most a stage may hold (None: no limit).
        replicas: how many model replicas `place` holds, one after the other (DualPipe's two);
            each microbatch runs the segments of its own.
        closing: per stage, what it runs after its last compute without waiting for another
            stage (its optimizer step, `CostModel.step`), added to its end; None: nothing.
    """

    def __init__(
        self,
        place: Sequence[tuple[int, int]],
        costs: CostModel,
        budgets: Sequence[float] | None,
        replicas: int = 1,
        closing: Sequence[float] | None = None,
    ):
        self.place = list(place)
        length = len(self.place) // replicas
        self.first = [k - k % length for k in range(len(self.place))]  # of k's replica
        self.last = [first + length - 1 for first in self.first]
        self.costs, self.budgets = costs, budgets
        self.activations, self.inputs = held_sizes(costs.memory, len(self.place))
        self.segment = {sc: k for k, sc in enumerate(self.place)}
        # per segment, what its forward and backward take: [Note: a receive's take]
        self.takes = segment_takes(self.place, [costs.at(*sc) for sc in self.place], length)
        self.remotes = segment_remotes(self.place, length)
        self.p = max(s for s, _ in self.place) + 1
        self.closing = list(closing) if closing is not None else [0.0] * self.p
        self._ops: dict[tuple[int, str], tuple | None] = {}
        self._entries: dict[tuple[int, str], tuple] = {}  # what `_row` reads of each compute
        self._keys = 0  # one past the largest key (`_row`) of a compute read so far
        # each stage's rows as read, the recent ones (a move changes one row of an order)
        self._rows: dict[tuple[int, tuple[str, ...]], list[tuple] | None] = {}

    def op(self, stage: int, text: str) -> tuple | None:
        """`(code, microbatch, segment, cost)` of one compute of `stage`, or None where it is
        not a compute this clock times."""
        key = (stage, text)
        if key not in self._ops:
            found = None
            try:
                ins = parse(text)
            except ValueError:
                ins = None
            code = _CODES.get(type(ins))
            segment = self.segment.get((stage, getattr(ins, "chunk", -1)))
            if code is not None and segment is not None:
                found = (code, ins.microbatch, segment, self.costs.cost(stage, ins))
            self._ops[key] = found
        return self._ops[key]

    def covers(self, orders: Orders) -> bool:
        """Whether every entry of `orders` is a compute this clock times."""
        return len(orders) == self.p and all(
            self.op(s, text) is not None for s, row in enumerate(orders) for text in row
        )

    def time_covered(self, orders: Orders) -> tuple[float, float] | None:
        """`time(orders)` where the clock covers them, else None."""
        return self.time(orders) if self.covers(orders) else None

    def time(self, orders: Orders) -> tuple[float, float] | None:
        """`(makespan, the stages' ends added up)` of `orders` in the eager timeline, or None
        where they get stuck (a compute waits for one that runs after it) or a stage holds
        more than its budget."""
        p, budgets = self.p, self.budgets
        rows = [self._row(s, row) for s, row in enumerate(orders)]
        if None in rows:
            return None
        # per key (`_row`), when its forward ended, its backward (input gradient) and whether
        # its recomputation ran; -1: not yet
        forward, backward = [-1.0] * self._keys, [-1.0] * self._keys
        rebuilt = [False] * self._keys
        clock, at, held = [0.0] * p, [0] * p, [0.0] * p
        left = sum(map(len, rows))
        while left:
            moved = False
            for s in range(p):
                row, pos = rows[s], at[s]
                n = len(row)
                if pos == n:
                    continue
                now, mine = clock[s], held[s]
                budget = math.inf if budgets is None else budgets[s] + 1e-9
                while pos < n:
                    code, key, wait, add, cost, delta, redo, pair = row[pos]
                    if code == _F:  # once its input is there
                        ready = 0.0
                        if wait is not None:
                            ready = forward[wait]
                            if ready < 0.0:
                                break
                            ready += add
                        if pair is not None:  # an overlapped pair: once both inputs are
                            there = _backward_ready(*pair, forward, backward, rebuilt)
                            if there < 0.0:
                                break
                            if there > ready:
                                ready = there
                        now = (now if now > ready else ready) + cost
                        if pair is None:  # a pair's forward leaves at the pair's end
                            forward[key] = now
                    elif code == _W:  # after its stage's input gradient
                        if backward[key] < 0.0:
                            break
                        now += cost
                    elif code == _R:  # after its stage's forward
                        if forward[key] < 0.0:
                            break
                        now += cost
                        rebuilt[key] = True
                    else:  # a backward
                        ready = _backward_ready(key, wait, add, redo, forward, backward, rebuilt)
                        if ready < 0.0:
                            break
                        now = (now if now > ready else ready) + cost
                        backward[key] = now
                        if code == _P:
                            forward[pair] = now
                    mine += delta
                    if mine > budget:
                        return None
                    pos += 1
                if pos != at[s]:
                    moved = True
                    left -= pos - at[s]
                    at[s], clock[s], held[s] = pos, now, mine
            if not moved:
                return None
        ends = [end + after for end, after in zip(clock, self.closing)]
        return max(ends), sum(ends)

    def _row(self, s: int, row: tuple[str, ...]) -> list[tuple] | None:
        """Stage s's computes as the clock reads them: `(code, key, the key it waits for on
        another segment or None, what its arrival adds, cost, what it changes of the stage's
        held activations, whether it waits for its recomputation, its pair)`, where the pair
        of an overlapped pair's forward is its backward's `(key, wait, add, redo)` and that of
        the backward its forward's key; keys are `microbatch * segments + segment`. None where
        an overlapped backward does not follow a forward."""
        cached = self._rows.get((s, row))
        if cached is not None or (s, row) in self._rows:
            return cached
        if len(self._rows) >= _ROWS_KEPT:
            self._rows.clear()
        entries = [self._entry(s, text) for text in row]
        redone = {entry[1] for entry in entries if entry[0] == _R}
        warmed: set[tuple[str, int]] = set()  # each chunk's first computes of a step warm up
        taken = False  # the stage's first take of a step warms up: [Note: a receive's take]
        out = []
        for code, key, cost, warm, warmup, takes, receive, extra, wait, add, delta in entries:
            if warm is not None and warm not in warmed:
                warmed.add(warm)
                cost += warmup
            if receive and not taken:
                taken = True
                cost += takes
            cost += extra
            redo = key in redone
            if redo and code == _F:
                delta = self.inputs[key % len(self.place)]  # its input until the `R`
            pair = None
            if code == _P:
                if not out or out[-1][0] != _F:
                    out = None
                    break
                forward = out[-1]
                pair = forward[1]
                out[-1] = (*forward[:7], (key, wait, add, redo))
            out.append((code, key, wait, add, cost, delta, redo, pair))
        self._rows[s, row] = out
        return out

    def _entry(self, s: int, text: str) -> tuple:
        """What `_row` reads of one compute of stage s whatever the row around it: `(code,
        key, cost, its warm-up's (kind, segment), the warm-up, the first take's warm-up,
        whether it takes an input from another stage, what it takes of that input, the key it
        waits for, what its arrival adds, what it changes of the held activations)`."""
        found = self._entries.get((s, text))
        if found is None:
            code, i, k, cost = self.op(s, text)
            num, at = len(self.place), self.costs.at(*self.place[k])
            key, wait, add, extra, delta = i * num + k, None, 0.0, 0.0, 0.0
            first = _WARM_OF.get(code)
            warm, warmup = ((first, k), getattr(at, first)) if first is not None else (None, 0.0)
            up, down = self.remotes[k]
            receive = up if code == _F else down and code in (_B, _I, _P)
            if code == _F:
                extra = self.takes[k][0]
                if k > self.first[k]:
                    wait, add = key - 1, self._hop(k - 1, k)
                delta = self.activations[k]
            elif code == _R:
                delta = self.activations[k] - self.inputs[k]
            elif code != _W and k < self.last[k]:
                extra = self.takes[k][1]
                wait, add = key + 1, self._hop(k + 1, k)
            if code in (_B, _W, _P):
                delta = -self.activations[k]
            found = (
                code, key, cost, warm, warmup, at.warmup_receive, receive, extra, wait, add,
                delta,
            )
            self._entries[s, text] = found
            self._keys = max(self._keys, (i + 1) * num)
        return found

    def _hop(self, producer: int, consumer: int) -> float:
        """What a message from segment `producer` to segment `consumer` spends in flight: the
        receive's comm, where they are on two stages."""
        stage, chunk = self.place[consumer]
        return 0.0 if self.place[producer][0] == stage else self.costs.at(stage, chunk).comm


def _backward_ready(key, wait, add, redo, forward, backward, rebuilt) -> float:
    """When a backward may start on its stage's clock (`QuickClock.time`): after its forward
    (and its recomputation, where `redo`) and its input from the segment above (its end plus
    `add`); -1 where one of them has not run yet."""
    if forward[key] < 0.0 or (redo and not rebuilt[key]):
        return -1.0
    if wait is None:
        return 0.0
    ready = backward[wait]
    return -1.0 if ready < 0.0 else ready + add


def held_sizes(memory, num: int) -> tuple[list[float], list[float]]:
    """Per segment of `num`, what a held activation takes of its stage's budget and what a
    recomputed forward keeps of it (its input): bytes with a memory model (`memory`, per
    segment), else one chunk activation and nothing."""
    if memory is None:
        return [1.0] * num, [0.0] * num
    return (
        [memory.at("activations", k) for k in range(num)],
        [memory.at("inputs", k) for k in range(num)],
    )


# -- moves -------------------------------------------------------------------------------------


def recomputes(text: str) -> bool:
    """Whether `text` is a recomputation (`R3`, not a receive `RA3` or `RG3`)."""
    return text[0] == "R" and text[1:2].isdigit()


def same_thread(a: str, b: str) -> bool:
    """Whether two computes must keep their order on a stage: the same microbatch and chunk,
    or the same kind on the same chunk (each kind runs its microbatches in order)."""
    (kind, microbatch, chunk), (other, microbatch_b, chunk_b) = _read(a), _read(b)
    if chunk != chunk_b:
        return False
    return microbatch == microbatch_b or kind is other


@functools.lru_cache(maxsize=1 << 16)
def _read(text: str) -> tuple[type, int, int]:
    ins = parse(text)
    return type(ins), ins.microbatch, ins.chunk


def neighbours(orders: Orders, idle: Sequence[float]) -> Iterator[Orders]:
    """The orders one move away from `orders`, the stages that idle most first: a
    recomputation dropped, or two adjacent computes of a stage swapped (where neither must
    come first on the stage); then each compute moved one or two places on every stage that
    runs it (`moved_everywhere`)."""
    for stage in sorted(range(len(orders)), key=lambda s: (-idle[s], s)):
        row = orders[stage]
        changed = [row[:j] + row[j + 1 :] for j, text in enumerate(row) if recomputes(text)]
        for j in range(len(row) - 1):
            if not same_thread(row[j], row[j + 1]):
                changed.append((*row[:j], row[j + 1], row[j], *row[j + 2 :]))
        for new in changed:
            yield (*orders[:stage], new, *orders[stage + 1 :])
    runs = collections.Counter(text for row in orders for text in set(row))
    for text in sorted(text for text, stages in runs.items() if stages > 1):
        for d in (1, -1, 2, -2):
            new = moved_everywhere(orders, text, d)
            if new is not None:
                yield new


def moved_everywhere(orders: Orders, text: str, d: int) -> Orders | None:
    """`orders` with the compute `text` moved d places on every stage that runs it (a
    looped or V placement runs each chunk's `F3` on every stage), where it can move there
    (`_moved`); None where it moves on none. A microbatch's forward run later on one stage
    alone waits on its neighbours' order; at p = 8, m = 8, 1:2:1, a 1.3x first stage,
    interleaved-zb's `F7` two places later everywhere takes 33.50 where it takes 33.65, and no
    move of one stage is faster."""
    out, changed = [], False
    for row in orders:
        new = _moved(row, row.index(text), d) if text in row else None
        changed = changed or new is not None
        out.append(row if new is None else new)
    return tuple(out) if changed else None


def fewer_recomputes(orders: Orders, clock: QuickClock, stop=lambda: False) -> Orders:
    """`orders` with recomputations dropped, each stage's all at once and then one at a time
    in order, where the clock still times it within the budgets and no slower, until a pass
    drops none or `stop()` (asked before each) says time is up: a built-in recomputing every
    forward keeps those its limit needs. At p = 4, m = 8, 1:2:1, a 1.3x first stage, 0.6x
    1F1B's activations, DualPipe-V recomputing all takes 39.97 and keeping 26 of its 64
    recomputations 32.825, in 0.04 s: what local search from it reached in 4 s."""
    now = clock.time(orders)
    if now is None:
        return orders

    def kept(s: int, row: tuple[str, ...]) -> bool:
        """Whether `orders` with stage s's row as `row` fits and is no slower (then kept)."""
        nonlocal orders, now
        new = (*orders[:s], row, *orders[s + 1 :])
        timed = clock.time(new)
        if timed is None or timed[0] > now[0] + 1e-9:
            return False
        orders, now = new, timed
        return True

    for s, row in enumerate(orders):  # first each stage's all at once
        if any(map(recomputes, row)):
            kept(s, tuple(text for text in row if not recomputes(text)))
    dropped = True
    while dropped and not stop():
        dropped = False
        for s in range(len(orders)):
            j = 0
            while j < len(orders[s]):
                row = orders[s]
                if recomputes(row[j]):
                    if stop():
                        return orders
                    if kept(s, row[:j] + row[j + 1 :]):
                        dropped = True
                        continue  # the entry after it is at j now
                j += 1
    return orders


def move(
    orders: Orders, rng: random.Random, reach: int = 6, *, pairs: bool = False, split: bool = False
) -> Orders | None:
    """`orders` one random move away: a compute of a random stage moved up to `reach` places
    earlier or later (past none it must keep its order with: at one place, a swap with its
    neighbour), one time in ten on every stage that runs it (`moved_everywhere`), or one
    time in ten a recomputation dropped, or, where the order may have overlapped `pairs`, one
    time in five a pair made or parted (`_paired`; its backward joined or split where
    backwards may be `split`); None where the move drawn is not allowed."""
    s = rng.randrange(len(orders))
    row = orders[s]
    if len(row) < 2:
        return None
    if rng.random() < 0.1:  # on every stage that runs it
        d = rng.choice((-1, 1)) * rng.randint(1, reach)
        return moved_everywhere(orders, row[rng.randrange(len(row))], d)
    if pairs and rng.random() < 0.2:
        new = _paired(row, rng, reach, split)
    elif rng.random() < 0.1:
        redone = [j for j, text in enumerate(row) if recomputes(text)]
        if not redone:
            return None
        new = _moved(row, rng.choice(redone), 0)
    else:
        new = _moved(row, rng.randrange(len(row)), rng.choice((-1, 1)) * rng.randint(1, reach))
    return None if new is None else (*orders[:s], new, *orders[s + 1 :])


def kick(
    orders: Orders,
    rng: random.Random,
    size: int,
    *,
    recompute: bool,
    pairs: bool = False,
    split: bool = False,
) -> Orders:
    """`orders` after `size` random moves: a compute moved up to twelve places, or, where the
    search may `recompute`, one time in three a recomputation added before a backward (it frees
    memory for the moves after it), or, where the order may have overlapped `pairs`, one time
    in five a pair made or parted (its backward joined or split where backwards may be
    `split`)."""
    out = orders
    for _ in range(size * 4):
        if size <= 0:
            break
        s = rng.randrange(len(out))
        row = out[s]
        if not row:
            continue
        new = None
        if pairs and rng.random() < 0.2:
            new = _paired(row, rng, 12, split)
        elif recompute and rng.random() < 1 / 3:
            new = _recomputed(row, rng.randrange(len(row)))
        else:
            j = rng.randrange(len(row))
            new = _moved(row, j, rng.choice([d for d in range(-12, 13) if d]))
        if new is not None:
            out = (*out[:s], new, *out[s + 1 :])
            size -= 1
    return out


def _moved(row: tuple[str, ...], j: int, d: int) -> tuple[str, ...] | None:
    """`row` with entry j moved d places (0: dropped, for a recomputation), or None where it
    would pass one it must keep its order with, or leave the row."""
    if d == 0:
        return row[:j] + row[j + 1 :]
    to = j + d
    if not 0 <= to < len(row):
        return None
    text = row[j]
    between = row[to:j] if d < 0 else row[j + 1 : to + 1]
    if any(same_thread(text, other) for other in between):
        return None
    rest = row[:j] + row[j + 1 :]
    return (*rest[:to], text, *rest[to:])


def _paired(
    row: tuple[str, ...], rng: random.Random, reach: int, split: bool = False
) -> tuple[str, ...] | None:
    """`row` with one overlapped pair parted (`F3 +B1` read as `F3 B1`, in place; where
    backwards may be `split`, half the time as `F3 I1` with `W1` up to `reach` places later),
    or one made: a whole backward run alone (where backwards may be split, also an input
    gradient, its weight gradient joined to it) moved up to `reach` places to just after a
    forward run alone (of another microbatch or chunk) and overlapped with it (`F3 +B1`); each
    half at random. None where the row has neither, or the move would pass a compute it must
    keep its order with.

    A pair runs a whole backward, so an order of a split layout pairs a backward only once
    its weight gradient is joined to it, and a pair parted may leave its weight gradient for
    later: at p = 4, m = 8, 1:2:1, comm 0, a 1.3x first stage, 1F1B's activations, a search
    of 3,000 evaluations finds 29.25 (DualPipe-V's layout in pairs), 29.575 without."""
    if rng.random() < 0.5:
        parts = [j for j, text in enumerate(row) if text.startswith("+")]
        if not parts:
            return None
        j = rng.choice(parts)
        if not split or rng.random() < 0.5:
            return (*row[:j], row[j][1:], *row[j + 1 :])
        return _weight_later(row, j, rng.randint(1, reach))
    present = set(row) if split else ()
    alone = [
        j
        for j, text in enumerate(row)
        if text[0] == "B" or (split and text[0] == "I" and "W" + text[1:] in present)
    ]
    if not alone:
        return None
    j = rng.choice(alone)
    if row[j][0] == "I":  # its weight gradient joined to it
        tag = row[j][1:]
        row = tuple(text for text in row if text != "W" + tag)
        row = (*row[:j], "B" + tag, *row[j + 1 :])
    forwards = [
        i
        for i in range(max(0, j - reach), min(len(row), j + reach + 1))
        if row[i].startswith("F")
        and not (i + 1 < len(row) and row[i + 1].startswith("+"))
        and not same_thread(row[i], row[j])
    ]
    if not forwards:
        return None
    i = rng.choice(forwards)
    to = i + 1 if i < j else i  # just after the forward, once the backward has left its place
    moved = row if to == j else _moved(row, j, to - j)
    if moved is None:
        return None
    return (*moved[:to], "+" + moved[to], *moved[to + 1 :])


def _weight_later(row: tuple[str, ...], j: int, d: int) -> tuple[str, ...] | None:
    """`row` with the backward at j split: its input gradient in its place, its weight
    gradient d places after it, or as near as it may go (after its chunk's weight gradients
    of earlier microbatches, before those of later ones, not inside a pair); None where it
    fits nowhere."""
    tag = row[j].lstrip("+")[1:]
    row = (*row[:j], "I" + tag, *row[j + 1 :])
    weight = "W" + tag
    _, microbatch, chunk = _read(weight)
    low, high = j + 1, len(row)  # where it may go: before row[at], at in [low, high]
    for at, text in enumerate(row):
        if text[0] == "W":
            _, other, other_chunk = _read(text)
            if other_chunk == chunk and other < microbatch:
                low = max(low, at + 1)
            elif other_chunk == chunk and other > microbatch:
                high = min(high, at)
    at = min(high, max(low, j + 1 + d))
    while at < len(row) and row[at][0] == "+":  # not between a pair's two halves
        at += 1
    return None if at > high else (*row[:at], weight, *row[at:])


def _recomputed(row: tuple[str, ...], j: int) -> tuple[str, ...] | None:
    """`row` with entry j's forward recomputed (`R` just before its first backward piece),
    or None where j is no forward, it is recomputed already, or its backward is not on the
    row."""
    text = row[j]
    if text[0] != "F" or "+" in text:
        return None
    tag = text[1:]
    redo = "R" + tag
    if redo in row:
        return None
    for n in range(j + 1, len(row)):
        if row[n][1:] == tag and row[n][0] in "BI":
            return (*row[:n], redo, *row[n:])
    return None
