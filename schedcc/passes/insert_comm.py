"""insert_comm: add the sends and receives that the compute order needs, deadlock-free.

[Note: comm insertion by walk] (DESIGN.md, "one model for proof, simulation and comm insertion")
Simulate the computes alone with the default costs (F=1, B=2, I=1, W=1), each starting once its
stage is free and its inputs exist. Then walk the computes in time slices: at each start time,
first append the transfer of every input that a compute starting then needs from another stage
(the send at the producer's current end, the receive at the consumer's), then those computes.
Every send/receive pair is appended at one moment of the walk, so every edge of the step model
runs forward in walk order and the result cannot deadlock; sends sit right after their
producers, and a send-activation and a receive-grad posted at one moment fall into one comm
group, as in Megatron-LM. A compute order that is not dependency-respecting has no such walk:
it is reported as a `DependencyError` (within a stage), `DeadlockError` (across stages) or
`IncompleteScheduleError` (an input nobody computes).
"""

from __future__ import annotations

from schedcc.analysis import Layout
from schedcc.errors import DeadlockError, DependencyError, IncompleteScheduleError
from schedcc.ir import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    Instruction,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
)
from schedcc.program import Program

__all__ = ["insert_comm"]

# The default cost model in whole units, so start times are exact ints (and index buckets).
_COST = {Forward: 1, Backward: 2, BackwardInput: 1, BackwardWeight: 1}

# [Note: tensor keys] A tensor that crosses segments is one int: `(i * num_segments + k) * 2`
# is microbatch i's activation out of segment k, and `+ 1` its input gradient out of segment k.
# Flat lists indexed by key replace dicts of tuples: the walk is the compiler's hot loop.


def insert_comm(program: Program) -> Program:
    """The program with every cross-stage transfer its computes need, grouped for batching.

    A program that already holds any comm instruction is returned unchanged: its author owns
    the communication, and the validator checks it.
    """
    if any(op.group == "comm" for ops in program.stages for op in ops):
        return program
    layout = Layout.of(program.schedule)
    plan = _Plan(program, layout)
    start = _simulate(program, plan)
    return program.evolve(stages=_lower(program, layout, plan, start))


class _Plan:
    """Per stage and position: the tensor keys a compute waits for and the key it produces.

    `wants[s][pos]` is None for a non-compute; `producer[key]` is the stage that first computes
    `key` (-1 if none), `producer_pos[key]` the position there.
    """

    def __init__(self, program: Program, layout: Layout):
        num_segments = len(layout.stage_of)
        last = num_segments - 1
        num_keys = 2 * num_segments * program.schedule.num_microbatches_total
        self.num_segments = num_segments
        self.producer = [-1] * num_keys
        self.producer_pos = [0] * num_keys
        self.wants: list[list[tuple[int, ...] | None]] = []
        self.outs: list[list[int]] = []
        self.costs: list[list[int]] = []
        for s, ops in enumerate(program.stages):
            seg = layout.segment[s]
            wants: list[tuple[int, ...] | None] = []
            outs: list[int] = []
            for op in ops:
                cls, out = type(op), -1
                if cls in _COST:
                    k = seg[op.chunk]  # type: ignore[attr-defined]
                    base = (op.microbatch * num_segments + k) * 2  # type: ignore[attr-defined]
                    if cls is Forward:
                        wants.append((base - 2,) if k > 0 else ())
                        out = base
                    elif cls is BackwardWeight:
                        wants.append((base + 1,))
                    else:  # Backward, BackwardInput: the forward, and the gradient from k + 1
                        wants.append((base, base + 3) if k < last else (base,))
                        out = base + 1
                else:
                    wants.append(None)
                outs.append(out)
                if out >= 0 and self.producer[out] < 0:
                    self.producer[out] = s
                    self.producer_pos[out] = len(outs) - 1
            self.wants.append(wants)
            self.outs.append(outs)
            self.costs.append([_COST.get(type(op), 0) for op in ops])

    def describe(self, key: int) -> str:
        microbatch, k = divmod(key >> 1, self.num_segments)
        if key & 1:
            return f"input gradient of microbatch {microbatch} on segment {k}"
        return f"forward of microbatch {microbatch} on segment {k}"


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
            out = outs[pos]
            if out >= 0:
                done[out] = now
                if out in waiting:
                    pending.extend(waiting.pop(out))
            pos += 1
        clock[s], cursor[s] = now, pos
    if blocked:
        _explain_stuck(program, plan, cursor, blocked)
    return start


def _lower(
    program: Program, layout: Layout, plan: _Plan, start: list[list[int]]
) -> tuple[tuple[Instruction, ...], ...]:
    """Walk the instructions by start time, putting each input's send and receive before them."""
    stages = program.stages
    slices: list[list[tuple[int, int]]] = [
        [] for _ in range(1 + max(map(max, filter(None, start)), default=0))
    ]
    for s, row in enumerate(start):
        for pos, t in enumerate(row):
            slices[t].append((s, pos))
    out: list[list[Instruction]] = [[] for _ in stages]
    chunk_of, producer, make = layout.chunk_of, plan.producer, _Maker()
    num_segments = plan.num_segments
    for moment in slices:
        for s, pos in moment:
            for key in plan.wants[s][pos] or ():
                src = producer[key]
                if src == s:
                    continue
                i, k = divmod(key >> 1, num_segments)
                if key & 1:  # gradient out of segment k into k - 1
                    out[src].append(make(SendGrad, i, chunk_of[k]))
                    out[s].append(make(RecvGrad, i, chunk_of[k - 1]))
                else:  # activation out of segment k into k + 1
                    out[src].append(make(SendActivation, i, chunk_of[k]))
                    out[s].append(make(RecvActivation, i, chunk_of[k + 1]))
        for s, pos in moment:
            out[s].append(stages[s][pos])
    return tuple(tuple(ops) for ops in out)


class _Maker(dict):
    """`make(cls, microbatch, chunk)`: one shared instance per value (instructions are frozen).

    Every stage of a pipeline holds the same few comm values (e.g. `SA3` on each stage); making
    each once saves most of the lowering's allocation.
    """

    def __call__(self, cls: type, microbatch: int, chunk: int) -> Instruction:
        key = (cls, microbatch, chunk)
        op = self.get(key)
        if op is None:
            op = self[key] = cls(microbatch, chunk)
        return op


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
    s = min(blocked)
    chain: list[int] = []
    while s not in chain:
        chain.append(s)
        s = producer[blocked[s]]
    cycle = chain[chain.index(s) :]
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
