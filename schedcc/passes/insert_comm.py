"""insert_comm: add the sends and receives that the compute order needs, deadlock-free.

[Note: comm insertion by walk] (docs/design.md, "Comm insertion by a walk in time slices")
Simulate the computes alone with the default costs (F=1, B=2, I=1, W=1), each starting once its
stage is free and its inputs exist. Then walk the instructions in time slices: at each time,
first append the transfers that meet then (the send at the producer's current end, the receive
at the consumer's), then the computes that start then. Every send/receive pair is appended at
one moment of the walk, so every edge of the rendezvous model runs forward in walk order and the
result cannot deadlock, wherever the moment lies between the producer's end and the consumer's
start. A compute order that is not dependency-respecting has no such walk: it is reported as a
`DependencyError` (within a stage), `DeadlockError` (across stages) or `IncompleteScheduleError`
(an input nobody computes).

[Note: meeting time] Where in that window a transfer goes decides speed only. Under rendezvous a
send and its receive complete together, so the cheap moment is one where *both* stages are idle
(between two computes): neither waits for the other. `_meeting` takes the latest such moment up
to the consumer's start, which keeps a send-activation and a receive-grad of one step in one comm
group (as in Megatron-LM) and, where the producer is busy when the consumer starts, moves the
pair back to when both were free. GPipe, 1F1B, 2BW and the zero-bubble schedules then replay the
compute-only simulation exactly (their textbook makespans), and interleaved 1F1B does for some
shapes (p = 4, m = 8, v = 2). In others it has moments where a producer and its consumer are
never idle together between the producer's end and the consumer's start; a blocking exchange
must then stall one of them, and the stalls made early in the compute-only plan cascade.

[Note: two lowerings] So when the first lowering does not replay the compute-only makespan (it
still may where a pair met at a busy moment; then it is kept), a second one runs the rendezvous
model itself while it lowers (`_lower_online`: at each time unit, pairs meet where both stages
are idle, then computes start), so later meetings follow the real, stalled timeline; the faster
of the two (simulated with the default costs) is kept. Interleaved 1F1B at p = 32, m = 512,
v = 2: 3241 against the ideal 3165 (the first lowering alone: 4093). Both are walk-ordered, so
either is deadlock-free.

[Note: lowering an overlapped pair] A `Forward` and the `OverlappedBackward` right after it
(`F3.1 +B1`, see [Note: overlapped pairs]) are planned as one compute: the forward waits for
what both need, the backward for nothing more, and the forward's output is made at the pair's
end, with the pair costing F + B and starting at one moment. Every receive of the pair then
lands before the forward and every send after the backward, and nothing between the two.
"""

from __future__ import annotations

from bisect import bisect_left

from schedcc.errors import DeadlockError, DependencyError, IncompleteScheduleError
from schedcc.ir import COMM, Backward, Compute, Copy, Forward, Instruction, OverlappedBackward
from schedcc.passes.insert_offload import attach_copies, detach_copies
from schedcc.program import Program
from schedcc.semantics import UNIT_COSTS, Tensors, wait_for_cycle

__all__ = ["insert_comm"]

_COMM = frozenset(COMM)

# The default costs in whole units, so start times are exact ints (and index buckets).
_COST = {cls: int(cost) for cls, cost in UNIT_COSTS.items()}

# Tensors are named by their keys (see [Note: tensor keys] in `schedcc.semantics.tensors`): flat
# lists indexed by key replace dicts of tuples, since the walk is the compiler's hot loop.


def insert_comm(program: Program) -> Program:
    """The program with every cross-stage transfer its computes need, grouped for batching.

    A program that already holds any comm instruction is returned unchanged: its author owns
    the communication, and the validator checks it.
    """
    if any(not _COMM.isdisjoint(map(type, ops)) for ops in program.stages):
        return program
    if any(isinstance(op, Copy) for ops in program.stages for op in ops):
        # a schedule's own offloads and reloads keep their place among its computes
        detached = [detach_copies(ops) for ops in program.stages]
        lowered = insert_comm(program.evolve(stages=tuple(ops for ops, _ in detached)))
        stages = zip(lowered.stages, (anchors for _, anchors in detached))
        return lowered.evolve(stages=tuple(attach_copies(ops, at) for ops, at in stages))
    tensors = program.tensors
    plan = _Plan(program, tensors)
    start = _simulate(program, plan)
    stages, exact, first = _lower(program, plan, start)
    if not exact and first > _ideal(start, plan):  # see [Note: two lowerings]
        online, makespan = _lower_online(program, plan)
        if makespan < first:
            stages = online
    return program.evolve(stages=stages)


def _ideal(start: list[list[int]], plan: _Plan) -> int:
    """The compute-only simulation's makespan: no lowering runs faster."""
    return max((row[-1] + costs[-1] for row, costs in zip(start, plan.costs) if row), default=0)


class _Plan:
    """Per stage and position: the tensor keys a compute waits for and the key it produces.

    `wants[s][pos]` is None for a non-compute, `remote[s][pos]` those of its wants that another
    stage makes, `outs[s][pos]` the keys it makes; `producer[key]` is the stage that first
    computes `key` (-1 if none), `producer_pos[key]` the position there. `paired[s]` holds the
    positions of the overlapped backwards planned with their forward ([Note: lowering an
    overlapped pair]).
    """

    def __init__(self, program: Program, tensors: Tensors):
        span = tensors.span
        num_keys = span * program.schedule.num_microbatches_total
        self.tensors, self.span, self.pairs = tensors, span, tensors.pair_table()
        self.producer = [-1] * num_keys
        self.producer_pos = [0] * num_keys
        self.wants: list[list[tuple[int, ...] | None]] = []
        self.remote: list[list[tuple[int, ...]]] = []  # the wants made on another stage
        self.outs: list[list[tuple[int, ...]]] = []
        self.costs: list[list[int]] = []
        self.paired: list[frozenset[int]] = []
        for s, ops in enumerate(program.stages):
            table = tensors.compute_table(s)
            wants: list[tuple[int, ...] | None] = []
            remote: list[tuple[int, ...]] = []
            outs: list[tuple[int, ...]] = []
            for op in ops:
                out = -1
                if isinstance(op, Compute):
                    needs, makes, far = table[type(op), op.chunk]
                    base = op.microbatch * span
                    # a compute needs at most two tensors, at most one from another stage
                    if len(needs) == 2:
                        wants.append((base + needs[0], base + needs[1]))
                    else:
                        wants.append((base + needs[0],) if needs else ())
                    remote.append((base + far[0],) if far else ())
                    if makes >= 0:
                        out = base + makes
                else:
                    wants.append(None)
                    remote.append(())
                outs.append((out,) if out >= 0 else ())
            costs = [_COST.get(type(op), 0) for op in ops]
            self.paired.append(_pair_up(ops, wants, remote, outs, costs))
            for pos, made in enumerate(outs):
                for out in made:
                    if self.producer[out] < 0:
                        self.producer[out] = s
                        self.producer_pos[out] = pos
            self.wants.append(wants)
            self.remote.append(remote)
            self.outs.append(outs)
            self.costs.append(costs)

    def describe(self, key: int) -> str:
        return self.tensors.describe(key)


def _pair_up(ops, wants, remote, outs, costs) -> frozenset[int]:
    """Plan each overlapped pair of `ops` as one compute, in place ([Note: lowering an
    overlapped pair]); returns the positions of the paired backwards. A backward that needs
    what its forward makes is left alone (the validator refuses it)."""
    paired = set()
    for pos in range(1, len(ops)):
        if type(ops[pos]) is not OverlappedBackward or type(ops[pos - 1]) is not Forward:
            continue
        made, needs = outs[pos - 1], wants[pos]
        if made and made[0] in needs:
            continue
        wants[pos - 1] = wants[pos - 1] + needs
        remote[pos - 1] = remote[pos - 1] + remote[pos]
        wants[pos], remote[pos] = (), ()
        outs[pos - 1], outs[pos] = (), made + outs[pos]
        costs[pos - 1], costs[pos] = 0, costs[pos - 1] + _COST[Backward]
        paired.add(pos)
    return frozenset(paired)


def _simulate(program: Program, plan: _Plan) -> list[list[int]]:
    """Start time of every instruction (computes wait for their stage and their inputs)."""
    stages = program.stages
    num_stages = len(stages)
    start = [[0] * len(ops) for ops in stages]
    done = [-1] * len(plan.producer)  # finish time of each tensor key, -1 until computed
    clock = [0] * num_stages
    cursor = [0] * num_stages
    waiting: dict[int, list[int]] = {}
    blocked: dict[int, int] = {}
    pending = list(range(num_stages))
    while pending:
        s = pending.pop()
        blocked.pop(s, None)
        wants_row, outs, costs, row = plan.wants[s], plan.outs[s], plan.costs[s], start[s]
        now, pos, n = clock[s], cursor[s], len(wants_row)
        while pos < n:
            wants = wants_row[pos]
            ready, missing = now, -1
            if wants is not None:
                for key in wants:
                    t = done[key]
                    if t < 0:
                        missing = key
                        break
                    if t > ready:
                        ready = t
            if missing >= 0:
                waiting.setdefault(missing, []).append(s)
                blocked[s] = missing
                break
            row[pos] = ready
            now = ready + costs[pos]
            for out in outs[pos]:
                done[out] = now
                if out in waiting:
                    pending.extend(waiting.pop(out))
            pos += 1
        clock[s], cursor[s] = now, pos
    if blocked:
        _explain_stuck(program, plan, cursor, blocked)
    return start


def _lower(program: Program, plan: _Plan, start: list[list[int]]):
    """Walk the instructions by start time, putting each transfer at its meeting time.

    Returns the stages, whether every pair met where both stages were idle (then the program
    replays the compute-only simulation exactly, see [Note: meeting time]) and the makespan of
    the rendezvous model on them with the default costs and free comm, timed as they are appended
    ([Note: timing a walk-ordered lowering]).
    """
    horizon = 1 + max(map(max, filter(None, start)), default=0)
    ends = [[t + c for t, c in zip(row, costs)] for row, costs in zip(start, plan.costs)]
    slices: list[list[tuple[int, int]]] = [[] for _ in range(horizon)]
    pairs: list[list[tuple[int, int, int]]] = [[] for _ in range(horizon)]  # (src, dst, key)
    producer, producer_pos = plan.producer, plan.producer_pos
    exact = True
    for s, row in enumerate(start):
        for pos, t in enumerate(row):
            slices[t].append((s, pos))
    for moment in slices:
        for s, pos in moment:
            for key in plan.remote[s][pos]:
                src = producer[key]
                if src < 0:  # nobody computes it: _simulate has reported it
                    continue
                when = _meeting(start, ends, src, producer_pos[key], s, start[s][pos])
                if when < 0:  # no common idle moment: meet at the consumer's start
                    when, exact = start[s][pos], False
                pairs[when].append((src, s, key))
    stages, makespan = _emit(program, plan, slices, pairs)
    return stages, exact, makespan


def _emit(program: Program, plan: _Plan, slices, pairs):
    """The stages from the walk's moments (at each, its transfers, then its computes), and
    their makespan in the rendezvous model with the default costs and free comm.

    [Note: timing a walk-ordered lowering] Appending in walk order visits the rendezvous model in a
    topological order, so it can be timed on the way: a stage's open comm group was posted at
    `posted[s]` (-1: none open) and is done at the latest posted time of its partner groups
    (`done[s]`), known once the stage's next compute closes it.
    """
    stages, pair = program.stages, _Maker(plan).pair
    out: list[list[Instruction]] = [[] for _ in stages]
    clock, posted, done = [0] * len(stages), [-1] * len(stages), [0] * len(stages)
    for moment, meeting in zip(slices, pairs):
        for src, dst, key in meeting:
            send, recv = pair(key)
            out[src].append(send)
            out[dst].append(recv)
            if posted[src] < 0:
                posted[src] = done[src] = clock[src]
            if posted[dst] < 0:
                posted[dst] = done[dst] = clock[dst]
            if posted[dst] > done[src]:
                done[src] = posted[dst]
            if posted[src] > done[dst]:
                done[dst] = posted[src]
        for s, pos in moment:
            if posted[s] >= 0:
                clock[s], posted[s] = done[s], -1
            clock[s] += plan.costs[s][pos]
            out[s].append(stages[s][pos])
    makespan = max((done[s] if posted[s] >= 0 else clock[s] for s in range(len(stages))), default=0)
    return tuple(tuple(ops) for ops in out), makespan


#: How many idle gaps `_meeting` looks through before settling for the consumer's start.
_MAX_GAPS = 64


def _meeting(start, ends, src: int, pos: int, dst: int, deadline: int) -> int:
    """The latest time, from the producer's end to the consumer's start, when both are idle.

    See [Note: meeting time]. Returns -1 when no common idle moment is found within
    `_MAX_GAPS` gaps.
    """
    src_start, src_end, dst_start, dst_end = start[src], ends[src], start[dst], ends[dst]
    ready = src_end[pos]
    # The gaps of each stage that hold `deadline` or come just before it.
    q = bisect_left(src_start, deadline) - 1
    j = bisect_left(dst_start, deadline) - 1
    for _ in range(_MAX_GAPS):
        if q < pos:
            break
        src_lo = src_end[q]
        dst_lo = dst_end[j] if j >= 0 else 0
        src_hi = src_start[q + 1] if q + 1 < len(src_start) else deadline
        dst_hi = dst_start[j + 1] if j + 1 < len(dst_start) else deadline
        hi = min(src_hi, dst_hi, deadline)
        if hi < ready:
            break
        if max(src_lo, dst_lo, ready) <= hi:
            return hi
        if src_lo >= dst_lo:
            q -= 1
        else:
            j -= 1
    return -1


class _Maker:
    """`pair(key)`: the send and the receive that move tensor `key`, one shared instance per
    value (instructions are frozen).

    Every stage of a pipeline holds the same few comm values (e.g. `SA3` on each stage); making
    each once saves most of the lowering's allocation.
    """

    def __init__(self, plan: _Plan):
        self._span, self._table = plan.span, plan.pairs
        self._made: dict[tuple[type, int, int], Instruction] = {}

    def pair(self, key: int) -> tuple[Instruction, Instruction]:
        microbatch, rest = divmod(key, self._span)
        send_cls, send_chunk, recv_cls, recv_chunk = self._table[rest]
        made = self._made
        send = made.get((send_cls, microbatch, send_chunk))
        if send is None:
            send = made[send_cls, microbatch, send_chunk] = send_cls(microbatch, send_chunk)
        recv = made.get((recv_cls, microbatch, recv_chunk))
        if recv is None:
            recv = made[recv_cls, microbatch, recv_chunk] = recv_cls(microbatch, recv_chunk)
        return send, recv


def _explain_stuck(program: Program, plan: _Plan, cursor: list[int], blocked: dict[int, int]):
    """Raise the error that says why the walk cannot finish: a missing, late or circular input."""
    stages, producer = program.stages, plan.producer
    for s, key in blocked.items():
        pos = cursor[s]
        op = stages[s][pos]
        if producer[key] < 0:
            raise IncompleteScheduleError(
                f"stage {s}, position {pos}: {op} needs the {plan.describe(key)}, which no stage "
                "computes; add that compute to the schedule",
                stage=s,
                position=pos,
            )
        if producer[key] == s:
            ppos = plan.producer_pos[key]
            raise DependencyError(
                f"stage {s}, position {pos}: {op} needs the {plan.describe(key)}, which this "
                f"stage only computes later, at position {ppos} ({stages[s][ppos]}); move {op} "
                "after it",
                stage=s,
                position=pos,
            )
    cycle = wait_for_cycle({s: producer[key] for s, key in blocked.items()})
    links = [
        f"stage {s} waits at {stages[s][cursor[s]]} (position {cursor[s]}) for stage "
        f"{producer[blocked[s]]}'s {plan.describe(blocked[s])}"
        for s in cycle
    ]
    first = cycle[0]
    raise DeadlockError(
        "deadlock: the compute order has a cross-stage cycle: "
        + "; ".join(links)
        + f"; back to stage {first}. Reorder these computes so each stage's inputs are produced "
        "before it waits for them",
        stage=first,
        position=cursor[first],
    )


def _lower_online(program: Program, plan: _Plan) -> tuple[tuple[tuple[Instruction, ...], ...], int]:
    """Lower by running the rendezvous model itself, greedily, in whole time units.

    At each time: first every pair whose producer has its tensor and whose two stages are both
    between computes meets (appended to both stages); then every stage whose inputs are all here
    starts its next compute. Each pair is appended at one moment, so this is walk-ordered too.
    Returns the stages and their makespan (this run is the rendezvous model with free comm).
    """
    stages, wants, outs, costs = program.stages, plan.wants, plan.outs, plan.costs
    num_stages = len(stages)
    busy_until, cursor = [0] * num_stages, [0] * num_stages
    done = [-1] * len(plan.producer)
    delivered = bytearray(len(plan.producer))
    out: list[list[Instruction]] = [[] for _ in stages]
    producer, pair = plan.producer, _Maker(plan).pair
    t = 0
    while True:
        idle = [s for s in range(num_stages) if busy_until[s] <= t]
        for s in idle:  # the pairs that meet now
            ops, pos = stages[s], cursor[s]
            while pos < len(ops) and wants[s][pos] is None:  # updates ride along
                out[s].append(ops[pos])
                pos += 1
            cursor[s] = pos
            for key in wants[s][pos] if pos < len(ops) else ():
                src = producer[key]
                if src != s and not delivered[key] and 0 <= done[key] <= t >= busy_until[src]:
                    send, recv = pair(key)
                    out[src].append(send)
                    out[s].append(recv)
                    delivered[key] = 1
        for s in idle:  # the computes that start now
            pos = cursor[s]
            if pos == len(stages[s]) or not all(
                delivered[key] if producer[key] != s else 0 <= done[key] <= t
                for key in wants[s][pos]
            ):
                continue
            out[s].append(stages[s][pos])
            busy_until[s] = t + costs[s][pos]
            if pos + 1 in plan.paired[s]:  # its overlapped backward starts with it
                pos += 1
                out[s].append(stages[s][pos])
                busy_until[s] += costs[s][pos]
            for key in outs[s][pos]:
                done[key] = busy_until[s]
            cursor[s] = pos + 1
        later = [b for b in busy_until if b > t]
        if not later:
            assert all(cursor[s] == len(stages[s]) for s in range(num_stages)), "lowering stuck"
            return tuple(tuple(ops) for ops in out), t
        t = min(later)
