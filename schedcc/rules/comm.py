"""Rules on communication: every send meets its receive in FIFO order, and nothing deadlocks."""

from __future__ import annotations

from collections.abc import Iterator

from schedcc.errors import DeadlockError, UnmatchedCommError
from schedcc.ir import SENDS, GradNorm, ReduceTied
from schedcc.rules import Context, Problem

__all__ = ["check_comm", "check_deadlock"]


def check_comm(ctx: Context) -> Iterator[Problem]:
    """Every send meets exactly its receive, one-to-one and in FIFO order per channel."""
    _, problems = ctx.matching
    stages = ctx.stages
    for p in problems:
        where = ctx.where(p.stage, p.position)
        if p.kind == "nowhere":
            text = (
                f"{where} has nothing to move: its segment's neighbour in that direction is on "
                "the same stage or does not exist; remove it"
            )
        elif p.kind == "unmatched":
            other = "receive" if isinstance(stages[p.stage][p.position], SENDS) else "send"
            text = (
                f"{where} has no matching {other} on stage {p.peer}; add the {other} there or "
                "remove this op (a rendezvous send without its receive hangs on NCCL)"
            )
        elif p.kind == "order":
            text = (
                f"{where} meets {stages[p.peer][p.peer_position]} (stage {p.peer}, position "
                f"{p.peer_position}) in FIFO order on channel {p.stage}->{p.peer} but they move "
                "different tensors; order the sends and receives of a channel alike"
            )
        else:
            text = f"{where} moves a tensor that is already moved once; remove the duplicate"
        yield Problem(UnmatchedCommError, text, p.stage, p.position)


def check_deadlock(ctx: Context) -> Iterator[Problem]:
    """The stages, each running its program in order with rendezvous comm groups, all finish."""
    _, problems = ctx.matching
    if problems or ctx.model.tie_problems or ctx.model.norm_problems:  # other rules report
        return
    stages, units = ctx.stages, ctx.model.units
    result = ctx.program.reference_walk  # timed, for the simulator: [Note: the reference walk]
    if not result.stuck:
        return
    cycle = result.wait_for_cycle()
    links, waiting = [], []
    for s in cycle:
        unit, peer, peer_unit = result.stuck[s]
        waits, peer_pos = _waiting_op(ctx, s, unit, peer, peer_unit)
        waiting.append((s, waits))
        links.append(
            f"stage {s} waits at {stages[s][waits]} (position {waits}) for stage {peer}'s "
            f"{stages[peer][peer_pos]} (position {peer_pos})"
        )
    first = cycle[0]
    first_pos = units.bounds[first][result.stuck[first][0]][0]
    yield Problem(
        DeadlockError,
        "deadlock (a wait-for cycle): "
        + "; ".join(links)
        + f"; back to stage {first}. "
        + (
            "Move the ReduceTied or GradNorm, or the comm that the group's other stages need "
            "before theirs, so that every stage of the group reaches it without waiting for "
            "another's later work"
            if any(type(stages[s][pos]) in (ReduceTied, GradNorm) for s, pos in waiting)
            else "Reorder the comm so each send and its receive can be reached together (or "
            "yield no comm and let the compiler insert it)"
        ),
        first,
        first_pos,
    )


def _waiting_op(ctx: Context, s: int, unit: int, peer: int, peer_unit: int) -> tuple[int, int]:
    """The position of the op in unit `unit` of stage `s` that waits for unit `peer_unit` of
    stage `peer`, and the position of the op it waits for there (a comm partner, or a member
    of a `ReduceTied` collective)."""
    units, partner, meets = ctx.model.units, ctx.model.partner, ctx.model.meets
    lo, hi = units.bounds[s][unit]
    for pos in range(lo, hi):
        others = [partner[s][pos]] if partner[s][pos] is not None else []
        if meets and meets[s][pos]:
            others = list(meets[s][pos])
        for t, tpos in others:
            if t == peer and units.unit_at[t][tpos] == peer_unit:
                return pos, tpos
    raise AssertionError(f"stage {s} unit {unit} does not wait for stage {peer}")
