"""The eager timeline: a program timed as the distributed engine runs it over gloo.

[Note: eager simulation] The rendezvous model is rendezvous: a comm group is done only once its
partners are posted, so a send waits for its receiver, and the compiler's groups pair a send with
a receive (as Megatron-LM's `send_forward_recv_backward` does). That is the safe model for NCCL
and what the validator proves. An executor whose sends never wait (the distributed engine over
gloo, see [Note: eager point-to-point] in `backends/distributed/eager.py`) does better: each
tensor leaves when its producer ends, and a compute starts once its stage is free and every tensor
it needs from another stage has arrived (the producer's end plus the receive's comm cost, in
flight, not taken from either stage; taking a message that has come is its consumer's own time,
part of that compute: [Note: a receive's take] in `schedcc.costs`). The eager timeline is that:
computes and updates in program order, each starting at the later of its stage's clock and its
inputs' arrival; a comm op spans its message's flight, from the producer's end to the arrival. A
program that validates cannot get stuck this way (every wait of the rendezvous model is kept or
dropped, none added), and no compute starts later than it would there (docs/design.md,
"Rendezvous and eager").
A `ReduceTied` is a collective: it starts once every member of it has reached it, as in the
rendezvous model ([Note: tied collectives] in `schedcc.semantics.collectives`). An overlapped pair
(`F3.1 +B1`, [Note: overlapped pairs] in `schedcc.rules.overlap`) starts once the inputs of both
have arrived, and the forward's output leaves at the pair's end, as the compiler's sends do. An
`Offload` or `Reload` runs on its stage's copy lane, as in the rendezvous model's walk ([Note:
offloading] in `schedcc.rules.offload`): the stage goes on at once, and a backward piece starts
no earlier than its reload ends.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence

from schedcc.ir import (
    Comm,
    Compute,
    Forward,
    Instruction,
    OverlappedBackward,
    RecvActivation,
    RecvGrad,
)
from schedcc.semantics import CopyLanes, Tensors, Units

__all__ = ["eager_spans"]

#: Per op: its duration (None for a comm op, timed by its message), the tensor keys it needs from
#: another stage (a collective's: `-2 - n`) and those it makes (a comm op: the key it carries,
#: -1 for none).
_Plan = list[list[tuple[float | None, tuple[int, ...], tuple[int, ...] | int]]]


def eager_spans(
    stages: Sequence[Sequence[Instruction]],
    tensors: Tensors,
    cost: Callable[[int, Instruction], float],
    *,
    meets: Sequence[Sequence[tuple | None]] | None = None,
    extra: Mapping[tuple[int, int], float] | None = None,
) -> list[list[tuple[float, float]]] | None:
    """`spans[s][pos] = (start, end)` of every instruction in the eager timeline (see the note
    above); None if the program gets stuck (it does not validate). Linear: a stage that waits for
    a tensor is resumed once, when the tensor's producer has run. `meets` is the rendezvous model's
    (`RendezvousModel.meets`): each `ReduceTied`'s other members. `extra[s, position]` is
    added to that op's cost (a step's first computes and the messages a compute takes,
    `schedcc.costs.warmups` and `takes`)."""
    plans, flight = _plans(stages, tensors, cost, extra or {})
    arrived = _collectives(plans, meets) if meets else []
    units = Units.of(stages)  # a copy and a backward piece are one-instruction units
    lanes = CopyLanes.of(stages, units)
    units_at = units.bounds
    lane_free = [0.0] * len(stages)
    produced: dict[int, float] = {}  # tensor key -> when its producer ended
    spans: list[list[tuple[float, float] | None]] = [[None] * len(ops) for ops in stages]
    clock, at = [0.0] * len(stages), [0] * len(stages)
    waiting: dict[int, list[int]] = {}  # tensor key -> the stages stopped until it is made
    ready = deque(range(len(stages)))
    while ready:
        s = ready.popleft()
        plan, row, now, pos = plans[s], spans[s], clock[s], at[s]
        copies, waits = _lane(lanes, units_at, s)
        while pos < len(plan):
            duration, needs, makes = plan[pos]
            if pos in copies:  # on the copy lane ([Note: offloading]): the stage goes on
                begin = max(now, lane_free[s])
                lane_free[s] = begin + (duration or 0.0)
                row[pos] = (begin, lane_free[s])
                pos += 1
                continue
            if duration is not None:
                start = now if pos not in waits else max(now, row[waits[pos]][1])
                for need in needs:
                    if need >= 0:
                        if need not in produced:
                            waiting.setdefault(need, []).append(s)
                            break
                        start = max(start, produced[need] + flight.get(need, 0.0))
                    else:  # a collective: wait for every member (its key is `need`)
                        members = arrived[-2 - need]
                        members[s] = members.get(s, now)
                        if len(members) <= members[None]:  # its count is under key None
                            waiting.setdefault(need, []).append(s)
                            break
                        start = max(start, *(t for key, t in members.items() if key is not None))
                        ready.extend(waiting.pop(need, ()))
                else:
                    now = start
                    row[pos] = (now, now + duration)
                    now += duration
                    for make in makes:
                        produced[make] = now
                        if make in waiting:
                            ready.extend(waiting.pop(make))
                    pos += 1
                    continue
                break
            pos += 1
        clock[s], at[s] = now, pos
    if any(at[s] < len(plan) for s, plan in enumerate(plans)):
        return None
    return [_comm_spans(plans[s], spans[s], produced, flight) for s in range(len(stages))]


def _lane(lanes: CopyLanes | None, bounds, s: int) -> tuple[frozenset[int], dict[int, int]]:
    """Stage s's copy positions and, per backward position, its reload's position."""
    if lanes is None:
        return frozenset(), {}
    first = [lo for lo, _ in bounds[s]]
    copies = frozenset(first[j] for j in lanes.copies[s])
    return copies, {first[j]: first[r] for j, r in lanes.waits[s].items()}


def _plans(stages, tensors: Tensors, cost, extra) -> tuple[_Plan, dict[int, float]]:
    """Each op's plan entry, and `flight[key]`: the cost of the receive that moves `key`."""
    span = tensors.span
    plans: _Plan = []
    flight: dict[int, float] = {}
    for s, ops in enumerate(stages):
        computes, comms = tensors.compute_table(s), tensors.comm_table(s)
        row: list = []
        for pos, op in enumerate(ops):
            if isinstance(op, Comm):
                route = comms.get((type(op), op.chunk))
                key = -1 if route is None else op.microbatch * span + route.carries
                if key >= 0 and type(op) in (RecvActivation, RecvGrad):
                    flight[key] = cost(s, op)
                row.append((None, (), key))
            elif isinstance(op, Compute):
                use = computes[type(op), op.chunk]
                base = op.microbatch * span
                needs = tuple(base + key for key in use.remote)
                makes = (base + use.makes,) if use.makes >= 0 else ()
                if type(op) is OverlappedBackward and pos and type(ops[pos - 1]) is Forward:
                    duration, forward_needs, forward_makes = row[-1]  # see the note above
                    row[-1] = (duration, forward_needs + needs, ())
                    needs, makes = (), forward_makes + makes
                row.append((cost(s, op) + extra.get((s, pos), 0.0), needs, makes))
            else:
                row.append((cost(s, op), (), ()))
        plans.append(row)
    return plans, flight


def _collectives(plans: _Plan, meets) -> list[dict]:
    """Number each matched `ReduceTied` collective: its members' plan entries need `-2 - n`;
    `arrived[n]` collects each member's arrival time, and `arrived[n][None]` is the count."""
    arrived: list[dict] = []
    index: dict[tuple[int, int], int] = {}
    for s, row in enumerate(meets):
        for pos, others in enumerate(row):
            if others is None:
                continue
            key = min((s, pos), *others)
            if key not in index:
                index[key] = len(arrived)
                arrived.append({None: len(others) + 1})
            duration, _, makes = plans[s][pos]
            plans[s][pos] = (duration, (-2 - index[key],), makes)
    return arrived


def _comm_spans(plan, row, produced, flight) -> list[tuple[float, float]]:
    """The stage's spans with each comm op's filled in: its message's flight (none: no time,
    where it stands)."""
    out = []
    previous = 0.0
    for (_, _, moved), span in zip(plan, row):
        if span is None:
            if moved < 0 or moved not in produced:
                span = (previous, previous)
            else:
                sent = produced[moved]
                span = (sent, sent + flight.get(moved, 0.0))
        else:
            previous = span[1]
        out.append(span)
    return out
