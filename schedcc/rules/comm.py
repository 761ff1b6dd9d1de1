"""Rules on communication: every send meets its receive in FIFO order, and nothing deadlocks."""

from __future__ import annotations

from collections.abc import Iterator

from schedcc.errors import DeadlockError, UnmatchedCommError
from schedcc.ir import SENDS
from schedcc.rules import Context, Problem
from schedcc.semantics import reference_walk

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
    partner, problems = ctx.matching
    if problems:  # unmatched comm is check_comm's to report; the step model needs pairs
        return
    stages, steps = ctx.stages, ctx.model.steps
    result = reference_walk(ctx.program)  # timed, for the simulator: [Note: the reference walk]
    if not result.stuck:
        return
    cycle = result.wait_for_cycle()
    links = []
    for s in cycle:
        step, peer, peer_step = result.stuck[s]
        lo, hi = steps.bounds[s][step]
        waits = next(
            pos
            for pos in range(lo, hi)
            if partner[s][pos] is not None and steps.step_at[peer][partner[s][pos][1]] == peer_step
        )
        peer_pos = partner[s][waits][1]
        links.append(
            f"stage {s} waits at {stages[s][waits]} (position {waits}) for stage {peer}'s "
            f"{stages[peer][peer_pos]} (position {peer_pos})"
        )
    first = cycle[0]
    first_pos = steps.bounds[first][result.stuck[first][0]][0]
    yield Problem(
        DeadlockError,
        "deadlock (a wait-for cycle): "
        + "; ".join(links)
        + f"; back to stage {first}. Reorder the comm so each send and its receive can be "
        "reached together (or yield no comm and let the compiler insert it)",
        first,
        first_pos,
    )
