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

_COST = {Forward: 1.0, Backward: 2.0, BackwardInput: 1.0, BackwardWeight: 1.0}


def insert_comm(program: Program) -> Program:
    """The program with every cross-stage transfer its computes need, grouped for batching.

    A program that already holds any comm instruction is returned unchanged: its author owns
    the communication, and the validator checks it.
    """
    if any(op.group == "comm" for ops in program.stages for op in ops):
        return program
    layout = Layout.of(program.schedule)
    start, needs = _simulate(program, layout)
    return program.evolve(stages=_lower(program, layout, start, needs))


def _keys(op: Instruction, k: int, last: int):
    """What `op` (on segment k) needs and what it produces, as dependency keys."""
    cls, i = type(op), op.microbatch  # type: ignore[attr-defined]
    if cls is Forward:
        return ((("F", i, k - 1),) if k > 0 else ()), ("F", i, k)
    if cls is Backward or cls is BackwardInput:
        needs = (("F", i, k), ("G", i, k + 1)) if k < last else (("F", i, k),)
        return needs, ("G", i, k)
    return (("G", i, k),), None  # BackwardWeight


def _simulate(program: Program, layout: Layout):
    """Start time of every instruction, and for each compute its inputs from other stages."""
    stages, last = program.stages, layout.last
    num_stages = len(stages)
    start = [[0.0] * len(ops) for ops in stages]
    needs = [[()] * len(ops) for ops in stages]
    done: dict[tuple, float] = {}
    producer: dict[tuple, tuple[int, int]] = {}
    for s, ops in enumerate(stages):
        seg = layout.segment[s]
        for pos, op in enumerate(ops):
            if op.group == "compute":
                _, out = _keys(op, seg[op.chunk], last)  # type: ignore[attr-defined]
                if out is not None:
                    producer.setdefault(out, (s, pos))

    clock = [0.0] * num_stages
    cursor = [0] * num_stages
    waiting: dict[tuple, list[int]] = {}
    blocked: dict[int, tuple] = {}
    pending = list(range(num_stages))
    while pending:
        s = pending.pop()
        blocked.pop(s, None)
        ops, seg, pos = stages[s], layout.segment[s], cursor[s]
        while pos < len(ops):
            op = ops[pos]
            if op.group != "compute":
                start[s][pos] = clock[s]
                pos += 1
                continue
            k = seg[op.chunk]  # type: ignore[attr-defined]
            wants, out = _keys(op, k, last)
            ready, missing = clock[s], None
            for key in wants:
                t = done.get(key)
                if t is None:
                    missing = key
                    break
                ready = max(ready, t)
            if missing is not None:
                waiting.setdefault(missing, []).append(s)
                blocked[s] = missing
                break
            start[s][pos] = ready
            clock[s] = ready + _COST[type(op)]
            needs[s][pos] = tuple(key for key in wants if producer[key][0] != s)
            if out is not None:
                done[out] = clock[s]
                pending.extend(waiting.pop(out, ()))
            pos += 1
        cursor[s] = pos
    if blocked:
        _explain_stuck(program, cursor, blocked, producer)
    return start, needs


def _lower(program: Program, layout: Layout, start, needs) -> tuple[tuple[Instruction, ...], ...]:
    stages = program.stages
    slices: dict[float, list[tuple[int, int]]] = {}
    for s, ops in enumerate(stages):
        row = start[s]
        for pos in range(len(ops)):
            slices.setdefault(row[pos], []).append((s, pos))
    out: list[list[Instruction]] = [[] for _ in stages]
    stage_of, chunk_of = layout.stage_of, layout.chunk_of
    for t in sorted(slices):
        moment = slices[t]
        for s, pos in moment:
            for kind, i, k in needs[s][pos]:
                src = stage_of[k]
                if kind == "F":  # activation out of segment k into k + 1
                    out[src].append(SendActivation(i, chunk_of[k]))
                    out[s].append(RecvActivation(i, chunk_of[k + 1]))
                else:  # gradient out of segment k into k - 1
                    out[src].append(SendGrad(i, chunk_of[k]))
                    out[s].append(RecvGrad(i, chunk_of[k - 1]))
        for s, pos in moment:
            out[s].append(stages[s][pos])
    return tuple(tuple(ops) for ops in out)


def _describe(key: tuple) -> str:
    kind, i, k = key
    if kind == "F":
        return f"forward of microbatch {i} on segment {k}"
    return f"input gradient of microbatch {i} on segment {k}"


def _explain_stuck(program, cursor, blocked, producer):
    stages = program.stages
    for s, key in blocked.items():
        pos = cursor[s]
        op = stages[s][pos]
        if key not in producer:
            raise IncompleteScheduleError(
                f"stage {s}, position {pos}: {op} needs the {_describe(key)}, which no stage "
                "computes; add that compute to the schedule",
                stage=s,
                position=pos,
            )
        ps, ppos = producer[key]
        if ps == s:
            raise DependencyError(
                f"stage {s}, position {pos}: {op} needs the {_describe(key)}, which this stage "
                f"only computes later, at position {ppos} ({stages[s][ppos]}); move {op} after it",
                stage=s,
                position=pos,
            )
    s = min(blocked)
    chain: list[int] = []
    while s not in chain:
        chain.append(s)
        s = producer[blocked[s]][0]
    cycle = chain[chain.index(s) :]
    links = []
    for s in cycle:
        key = blocked[s]
        links.append(
            f"stage {s} waits at {stages[s][cursor[s]]} (position {cursor[s]}) for stage "
            f"{producer[key][0]}'s {_describe(key)}"
        )
    first = cycle[0]
    raise DeadlockError(
        "deadlock: the compute order has a cross-stage cycle: "
        + "; ".join(links)
        + f"; back to stage {first}. Reorder these computes so each stage's inputs are produced "
        "before it waits for them",
        stage=first,
        position=cursor[first],
    )
