"""insert_offload: an `Offload` after each chosen forward and a `Reload` ahead of its backward.

`compile(schedule, offload=...)` is what PipeOffload (Wan et al. 2025) and Megatron-LM's
activation offloading do: a forward's saved activations go to host memory while the stage runs
other microbatches, and come back before the backward. Here that is a pass over the lowered
program (it runs right after insert_comm): on each stage, for each chosen forward `F i.c`,

- `O i.c` goes right after the forward (after its overlapped `+B` if it has one), or after the
  comm group that sends its activation when that comes later ([Note: offloading] in
  `schedcc.rules.offload`: the device keeps an output until it leaves);
- `L i.c` goes right before the compute ahead of the first backward piece of `i` on chunk `c`
  (`B`, `I` or `+B`; before a pair's forward), so the copy overlaps that compute: the lead.

A forward is offloaded only where that leaves a compute between its `O` and its `L` (one that
runs while its bytes are on the host), and never one its stage recomputes. Which ones, a policy
says (as `recompute=` does): `True` (every forward it can), a collection of stages or of
`(stage, chunk)` pairs, `policy(stage, chunk) -> bool`, a fraction `0 < f <= 1` (on each stage,
that share of them, spread evenly over its program, so that its peak drops by about that share:
PipeOffload's selective offload), or
`ByteLimit(max_bytes, memory)` (on each stage, until its device activation bytes fit: at each
point over the limit, the forward held there that comes back last; where none is left, a reload
that waits right before its backward instead of overlapping the compute ahead: [Note: a late
reload]).

A schedule may yield its own `Offload`s and `Reload`s (`1f1b-offload` does): insert_comm keeps
each where the schedule put it relative to its computes (`detach_copies`, `attach_copies`), and
the pass adds none for a forward the schedule offloads itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from math import ceil

import attrs

from schedcc.errors import ScheduleConfigError
from schedcc.ir import (
    COMM,
    Backward,
    BackwardInput,
    Compute,
    Copy,
    Forward,
    Instruction,
    Offload,
    OverlappedBackward,
    Reload,
    SendActivation,
)
from schedcc.memory_model import MemoryModel
from schedcc.passes.insert_recompute import Policy, ask, chosen_policy
from schedcc.program import Program
from schedcc.semantics import held_bytes, recomputed
from schedcc.semantics.stage_bytes import chunk_sizes
from schedcc.sizes import parse_size

__all__ = [
    "ByteLimit",
    "attach_copies",
    "detach_copies",
    "insert_offload",
    "offload_policy",
    "offload_points",
]

#: Where a copy goes, relative to the stage's computes: `(copy, n, after)` is after the n-th
#: compute of the stage (`after`) or before it (`n` == the number of computes: at the end).
Anchor = tuple[Copy, int, bool]

_FIRST_BACKWARD = (Backward, BackwardInput)  # `+B` is a Backward
_COMM = frozenset(COMM)


@attrs.frozen
class ByteLimit:
    """Offload on each stage until its device activation bytes (counted with `memory`, [Note:
    bytes per stage] in `schedcc.semantics.stage_bytes`) stay within `max_bytes` (one size for
    every stage, or one per stage), or nothing more can go: at the first point over the limit,
    the forward held there that comes back last.

    >>> import schedcc
    >>> memory = schedcc.MemoryModel(activations=[100.0] * 4, parameters=[0.0] * 4)
    >>> program = schedcc.compile(schedcc.get_schedule("1f1b")(4, 8),
    ...                           offload=ByteLimit(250, memory))
    >>> schedcc.simulate(program, schedcc.CostModel(memory=memory)).peak_activation_bytes
    (200.0, 200.0, 200.0, 100.0)
    """

    max_bytes: float | str | Sequence[float | str] = attrs.field()
    memory: MemoryModel = attrs.field()

    @max_bytes.validator
    def _size(self, attribute, value) -> None:
        sizes = value if isinstance(value, (list, tuple)) else [value]
        if not sizes or any(parse_size(size) <= 0 for size in sizes):
            raise ScheduleConfigError(
                f"ByteLimit(max_bytes) must be a positive size or one per stage, got {value!r}"
            )

    def at(self, stage: int) -> float:
        """The most device activation bytes `stage` may hold."""
        if isinstance(self.max_bytes, (list, tuple)):
            if stage >= len(self.max_bytes):
                raise ScheduleConfigError(
                    f"ByteLimit(max_bytes) gives {len(self.max_bytes)} sizes, one per stage, but "
                    f"the program has stage {stage}"
                )
            return parse_size(self.max_bytes[stage])
        return parse_size(self.max_bytes)

    @memory.validator
    def _model(self, attribute, value) -> None:
        if not isinstance(value, MemoryModel):
            raise ScheduleConfigError(
                f"ByteLimit(memory) must be a MemoryModel (bytes per segment), got {value!r}"
            )


@attrs.frozen
class _Fraction:
    share: float


def offload_policy(
    offload: object, num_stages: int, num_chunks: int
) -> Policy | _Fraction | ByteLimit | None:
    """`offload` (what `compile` takes) checked, or None for no offloading.

    Raises:
        ScheduleConfigError: not a bool, a fraction in (0, 1], a `ByteLimit`, a callable, or a
            collection of stages or `(stage, chunk)` pairs in range.

    >>> policy = offload_policy({(1, 0)}, 2, 1)
    >>> policy(0, 0), policy(1, 0)
    (False, True)
    """
    if offload is None or offload is False:
        return None
    if offload is True:
        return lambda stage, chunk: True
    if isinstance(offload, ByteLimit):
        return offload
    if isinstance(offload, float):
        if not 0 < offload <= 1:
            raise ScheduleConfigError(
                f"offload as a fraction must be in (0, 1], got {offload!r}; e.g. offload=0.5"
            )
        return _Fraction(offload)
    if callable(offload):
        return offload  # type: ignore[return-value]
    example = (
        "e.g. offload=True, offload=0.5 (a fraction), offload={0, 1} (stages), "
        "offload={(0, 1)} (stage, chunk) or offload=ByteLimit('4GiB', memory)"
    )
    if isinstance(offload, (str, bytes)) or not isinstance(offload, Iterable):
        raise ScheduleConfigError(f"offload: {offload!r} is not a policy; {example}")
    return chosen_policy(offload, num_stages, num_chunks, what="offload", example=example)


def insert_offload(program: Program, policy: Policy | _Fraction | ByteLimit) -> Program:
    """`program` (lowered) with an `O` and an `L` for every forward `policy` picks.

    >>> import schedcc
    >>> program = schedcc.compile(schedcc.get_schedule("1f1b")(3, 3), offload={0})
    >>> print(program.stages[0][:9])  # doctest: +NORMALIZE_WHITESPACE
    (Forward(microbatch=0, chunk=0), SendActivation(microbatch=0, chunk=0),
     Offload(microbatch=0, chunk=0), Forward(microbatch=1, chunk=0), ...
    """
    stages = []
    for s, ops in enumerate(program.stages):
        where = _Where(ops)
        points = _fitting(ops, offload_points(ops), where)
        if isinstance(policy, ByteLimit):
            late = _fitting(ops, offload_points(ops, late=True), where)
            copies = _within(program, s, ops, points, late, policy, where)
        else:
            copies = {key: points[key] for key in _choose(s, points, policy)}
        anchors = [anchor for pair in copies.values() for anchor in pair]
        stages.append(attach_copies(ops, anchors, where) if anchors else ops)
    return program.evolve(stages=tuple(stages))


def _fitting(ops, points, where: _Where) -> dict:
    """The `points` whose copies leave a compute between them."""
    return {key: copies for key, copies in points.items() if _fits(ops, copies, where)}


def offload_points(
    ops: Sequence[Instruction], *, late: bool = False
) -> dict[tuple[int, int], tuple[Anchor, Anchor]]:
    """Per `(microbatch, chunk)` one stage's program can offload (see the module docstring),
    the anchors of its `O` and its `L`, in the order of the forwards; with `late`, the `L` right
    before the backward itself (before its pair's forward), which then waits for the copy
    ([Note: a late reload]).

    >>> from schedcc.ir import parse
    >>> points = offload_points([parse(op) for op in "F0 F1 F2 B2 B1 B0".split()])
    >>> list(points)  # B2 follows F2 at once: nothing to overlap
    [(0, 0), (1, 0)]
    >>> points[1, 0]  # after F1, and before B2, the compute ahead of B1
    ((Offload(microbatch=1, chunk=0), 1, True), (Reload(microbatch=1, chunk=0), 3, False))
    >>> offload_points([parse(op) for op in "F0 F1 F2 B2 B1 B0".split()], late=True)[1, 0][1]
    (Reload(microbatch=1, chunk=0), 4, False)
    """
    computes = [op for op in ops if isinstance(op, Compute)]
    kept_input = recomputed(ops)
    already = {(op.microbatch, op.chunk) for op in ops if type(op) is Offload}
    forward_at: dict[tuple[int, int], int] = {}
    found: list[tuple[int, tuple[int, int], tuple[Anchor, Anchor]]] = []  # by forward
    for n, op in enumerate(computes):
        key = (op.microbatch, op.chunk)
        if type(op) is Forward:
            forward_at.setdefault(key, n)
        elif isinstance(op, _FIRST_BACKWARD) and key in forward_at:
            f = forward_at.pop(key)
            if key in kept_input or key in already:
                continue
            after = f + 1 if _pair_at(computes, f + 1) else f  # after the pair's `+B`
            lead = n - 1 if _pair_at(computes, n) else n  # the backward (its pair's forward)
            if not late:
                lead -= 1  # the compute ahead of it
                if _pair_at(computes, lead):
                    lead -= 1  # before a pair's forward
            if lead - after >= 2:  # a compute runs while the bytes are on the host
                copies = ((Offload(*key), after, True), (Reload(*key), lead, False))
                found.append((f, key, copies))
    found.sort()
    return {key: copies for _, key, copies in found}


def _pair_at(computes: Sequence[Instruction], n: int) -> bool:
    """Whether compute n is the `+B` of an overlapped pair (its forward is compute n - 1)."""
    return (
        0 < n < len(computes)
        and type(computes[n]) is OverlappedBackward
        and type(computes[n - 1]) is Forward
    )


def _choose(s, points, policy) -> list[tuple[int, int]]:
    """The `(microbatch, chunk)` stage s offloads, of those it can (`points`), by a policy
    other than `ByteLimit`."""
    keys = list(points)
    if isinstance(policy, _Fraction):  # spread evenly: the peak drops by about that share
        share = policy.share
        return [key for n, key in enumerate(keys) if ceil((n + 1) * share) > ceil(n * share)]
    wanted: dict[int, bool] = {}
    for _, c in keys:
        if c not in wanted:
            wanted[c] = ask(policy, s, c, what="offload")
    return [key for key in keys if wanted[key[1]]]


# [Note: a late reload] A reload one compute ahead of its backward overlaps that compute, but
# holds its bytes beside the compute's own: at one microbatch a stage, 1F1B's steady `F B` can
# never fit by offloading alone (the reload for `B j` lands while `F k` runs). `ByteLimit` then
# reloads later, right before the backward (after the `O` of the forward ahead of it, on the
# same copy lane): the backward waits for the copy, and the stage holds one microbatch. It does
# so only where a point is over the limit and nothing held there can go: first what the
# overlapping reload allows, then a reload delayed, then a forward whose only room is before a
# late reload.


def _within(program, s, ops, points, late, limit: ByteLimit, where: _Where) -> dict:
    """Until stage s's device activation bytes fit `limit`, at each point over it: offload the
    forward held there whose reload is the latest (the one whose bytes stay away longest); where
    none is left, delay the reload of one already back, or offload one whose only room is before
    a late reload (`late`, [Note: a late reload]). Returns each chosen forward's copies.

    One walk over the stage's program with the copies chosen so far: each `O` placed before
    `ops[a]` (after the ones before it there, in the order chosen), each `L` before `ops[b]`
    after them, and the bytes held after each instruction the original's less those of the
    chosen forwards between their two copies. A pick only lowers what is held (between its
    copies), so the points walked before it stay within the limit, and the walk goes on from
    where it picked."""
    sizes = chunk_sizes(program, limit.memory, s, "activations")
    inputs = chunk_sizes(program, limit.memory, s, "inputs")
    max_bytes = limit.at(s)
    # on the host while the first `a` ops of `ops` have run but not the first `b`
    spans = {key: (where(off), where(back)) for key, (off, back) in points.items()}
    lately = {key: (where(off), where(back)) for key, (off, back) in late.items()}
    held_early, held_late = _Held(spans), _Held(lately)
    base = held_bytes(ops, sizes, inputs)
    chosen: dict[tuple[int, int], tuple[Anchor, Anchor]] = {}
    offloads: dict[int, list] = {}  # position -> the chosen forwards offloaded before it
    reloads: dict[int, list] = {}  # position -> the chosen forwards reloaded before it
    back: set[tuple[int, int]] = set()  # chosen forwards reloaded early, before this point
    away = 0.0  # the bytes of chosen forwards on the host at this point of the walk

    def take(pick, copies, span, before: int) -> float:
        nonlocal away
        chosen[pick] = copies
        a, b = span
        offloads.setdefault(a, []).append(pick)
        reloads.setdefault(b, []).append(pick)
        if a < before:
            away += sizes[pick[1]]
            return sizes[pick[1]]
        return 0.0

    def settle(held: float, done: int, before: int) -> None:
        """Offload at this point (`done` of `ops` run) until it fits or nothing more can go; a
        pick whose `O` goes before `ops[before]` is off the device here already."""
        nonlocal away
        while held > max_bytes:
            pick = held_early.latest(done, chosen)
            if pick is not None:
                held -= take(pick, points[pick], spans[pick], before)
                continue
            delayable = [k for k in back if lately[k][1] >= before]
            if delayable:  # its late reload comes after this point: away again until then
                pick = max(delayable, key=lambda k: lately[k][1])
                back.discard(pick)
                chosen[pick] = late[pick]
                reloads.setdefault(lately[pick][1], []).append(pick)
                away += sizes[pick[1]]
                held -= sizes[pick[1]]
                continue
            pick = held_late.latest(done, chosen)
            if pick is None:
                return  # nothing held at this point can go: on to the next one
            held -= take(pick, late[pick], lately[pick], before)

    for x in range(len(ops) + 1):
        ahead = base[x - 1] if x else 0.0  # held after ops[x - 1], before the copies at x
        here = offloads.setdefault(x, [])  # a pick at one of these joins the end of the list
        n = 0
        while n < len(here):
            away += sizes[here[n][1]]
            n += 1
            settle(ahead - away, x, x)
        coming = reloads.get(x, [])  # a pick here reloads later; a delay lands later too
        n = 0
        while n < len(coming):
            k = coming[n]
            n += 1
            away -= sizes[k[1]]
            if chosen[k] == points.get(k):  # reloaded early: a late reload could wait more
                back.add(k)
            settle(ahead - away, x, x + 1)
        if x < len(ops):
            settle(base[x] - away, x + 1, x + 1)
    return chosen


class _Held:
    """Of `spans` (a key's `(a, b)`: on the host while the first `a` ops have run but not the
    first `b`), those a point holds, swept along the walk's nondecreasing points: each call
    looks at the keys live there only, not at every key."""

    def __init__(self, spans: dict) -> None:
        self._spans = spans
        self._order = {key: n for n, key in enumerate(spans)}  # ties: the first forward
        self._starts = sorted(spans, key=lambda key: spans[key][0])
        self._next = 0
        self._live: set = set()

    def latest(self, done: int, chosen) -> tuple[int, int] | None:
        """The key held after `done` ops, not in `chosen`, whose span ends last (None: none)."""
        starts, spans = self._starts, self._spans
        while self._next < len(starts) and spans[starts[self._next]][0] <= done:
            self._live.add(starts[self._next])
            self._next += 1
        self._live = {k for k in self._live if spans[k][1] > done and k not in chosen}
        if not self._live:
            return None
        return max(self._live, key=lambda k: (spans[k][1], -self._order[k]))


def detach_copies(ops: Sequence[Instruction]) -> tuple[tuple[Instruction, ...], list[Anchor]]:
    """One stage's program without its copies, and where each was among its computes.

    >>> from schedcc.ir import parse
    >>> detach_copies([parse(op) for op in "F0 O0 F1 L0 B0".split()])[1]
    [(Offload(microbatch=0, chunk=0), 0, True), (Reload(microbatch=0, chunk=0), 2, False)]
    """
    rest: list[Instruction] = []
    anchors: list[Anchor] = []
    computes = 0
    for op in ops:
        if isinstance(op, Copy):
            after = type(op) is Offload and computes > 0
            anchors.append((op, computes - 1 if after else computes, after))
        else:
            computes += isinstance(op, Compute)
            rest.append(op)
    return tuple(rest), anchors


def attach_copies(
    ops: Sequence[Instruction], anchors: Sequence[Anchor], where: _Where | None = None
) -> tuple:
    """One stage's program with each copy at its anchor: an `O` after its compute (and after the
    comm group sending its activation, where that is later), an `L` before its compute (`where`:
    `ops`' positions, when the caller has them).

    >>> from schedcc.ir import parse
    >>> ops = [parse(op) for op in "F0 F1 SA0 B0".split()]
    >>> " ".join(map(str, attach_copies(ops, [(Offload(0), 0, True)])))
    'F0 F1 SA0 O0 B0'
    """
    where = _Where(ops) if where is None else where
    before: dict[int, list[Instruction]] = {}
    for anchor in sorted(anchors, key=lambda a: type(a[0]) is Reload):  # free, then take
        before.setdefault(where(anchor), []).append(anchor[0])
    out: list[Instruction] = []
    for pos, op in enumerate(ops):
        out.extend(before.pop(pos, ()))
        out.append(op)
    out.extend(before.pop(len(ops), ()))
    return tuple(out)


class _Where:
    """The position of one stage's program that a copy at an anchor goes before."""

    def __init__(self, ops: Sequence[Instruction]) -> None:
        self.ops = ops
        self.at = [pos for pos, op in enumerate(ops) if isinstance(op, Compute)]
        self.sent = {
            (op.microbatch, op.chunk): pos
            for pos, op in enumerate(ops)
            if type(op) is SendActivation
        }

    def __call__(self, anchor: Anchor) -> int:
        copy, n, after = anchor
        if not after:
            return self.at[n] if n < len(self.at) else len(self.ops)
        pos = self.at[n] + 1
        send = self.sent.get((copy.microbatch, copy.chunk))
        if send is not None and send >= pos:  # after the comm group that sends it
            pos = send
            while pos < len(self.ops) and type(self.ops[pos]) in _COMM:
                pos += 1
        return pos


def _fits(ops: Sequence[Instruction], copies: tuple[Anchor, Anchor], where: _Where) -> bool:
    """Whether a compute runs between the `O` and the `L` placed at `copies` in `ops` (`where`:
    its positions)."""
    lo, hi = where(copies[0]), where(copies[1])
    return any(isinstance(op, Compute) for op in ops[lo:hi])
