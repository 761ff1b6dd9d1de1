"""The step model: each stage's program cut into steps, and one walk of their events.

[Note: the step model] (docs/design.md, "Semantics: the step model") Each stage's program is
cut into steps: one per compute or update instruction, one per maximal run of consecutive comm
instructions (a comm group, posted together). A compute step is one event; a group has a
*posted* event (when the stage reaches it) and a *done* event (once every op's partner group has
been posted: rendezvous). `walk` visits the events in a topological order, giving each a time; a
stage that can never finish its program is waiting at a group whose partner is never posted: a
deadlock, and following "waits for" from stage to stage finds the cycle.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import attrs

from schedcc.ir import Comm, Instruction

__all__ = ["Steps", "Walk", "wait_for_cycle", "walk"]


@attrs.frozen(slots=True)
class Steps:
    """Each stage's program cut into steps (see [Note: the step model]).

    `bounds[s][j]` is the `[start, end)` position range of step j on stage s; `is_group[s][j]`
    tells a comm group from a single compute or update instruction; `step_at[s][pos]` is the
    step that holds position pos.

    >>> from schedcc.ir import parse
    >>> steps = Steps.of([[parse(op) for op in "F0 RG0 SA0 B0 Step".split()]])
    >>> steps.bounds[0], steps.is_group[0]
    (((0, 1), (1, 3), (3, 4), (4, 5)), (False, True, False, False))
    """

    bounds: tuple[tuple[tuple[int, int], ...], ...]
    is_group: tuple[tuple[bool, ...], ...]
    step_at: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, stages: Sequence[Sequence[Instruction]]) -> Steps:
        bounds, is_group, step_at = [], [], []
        for ops in stages:
            starts: list[int] = []
            groups: list[bool] = []
            at: list[int] = []
            previous = False  # was the op before a comm op?
            for pos, op in enumerate(ops):
                comm = isinstance(op, Comm)
                if not (comm and previous):  # a new step starts here
                    starts.append(pos)
                    groups.append(comm)
                at.append(len(starts) - 1)
                previous = comm
            bounds.append(tuple(zip(starts, [*starts[1:], len(ops)])))
            is_group.append(tuple(groups))
            step_at.append(tuple(at))
        return cls(tuple(bounds), tuple(is_group), tuple(step_at))


def wait_for_cycle(waits_for: Mapping[int, int]) -> list[int]:
    """The stages of one wait-for cycle, from the lowest waiting stage's chain.

    `waits_for[a] = b`: stage a waits for stage b. Returns `[a, b, ...]`, each waiting for the
    next and the last for the first; empty if nothing waits.

    >>> wait_for_cycle({0: 2, 1: 0, 2: 1})
    [0, 2, 1]
    >>> wait_for_cycle({0: 1, 1: 2, 2: 1})
    [1, 2]
    """
    if not waits_for:
        return []
    stage = min(waits_for)
    order: list[int] = []
    while stage not in order:
        order.append(stage)
        stage = waits_for[stage]
    return order[order.index(stage) :]


@attrs.frozen(slots=True)
class Walk:
    """The result of `walk`: per stage and step, start and end times (posted and done, for a group).

    `stuck` maps each stage that cannot finish to `(step, peer stage, peer step)`: the group it
    waits at and the partner group that is never posted. Empty when the program completes.
    """

    start: tuple[tuple[float, ...], ...]
    end: tuple[tuple[float, ...], ...]
    stuck: dict[int, tuple[int, int, int]]

    def wait_for_cycle(self) -> list[int]:
        """The stages of one wait-for cycle (stage a waits for b, ..., which waits for a)."""
        return wait_for_cycle({s: peer for s, (_, peer, _) in self.stuck.items()})


def walk(
    steps: Steps,
    partner: Sequence[Sequence[tuple[int, int] | None]],
    duration: Callable[[int, int], float] | None = None,
) -> Walk:
    """Visit every step in a topological order of the step model, timing it.

    `partner[s][pos]` is the matched op of each comm op (`schedcc.semantics.match_comm`);
    `duration(stage, step)` gives a compute's run time or a group's comm cost (0 if omitted).
    Linear in the number of instructions.

    >>> import schedcc
    >>> from schedcc.semantics import Tensors, match_comm
    >>> program = schedcc.compile(schedcc.get_schedule("gpipe")(2, 1))
    >>> partner, _ = match_comm(program.stages, Tensors.of(program.schedule))
    >>> walk(Steps.of(program.stages), partner, lambda s, j: 1.0).end
    ((1.0, 5.0, 6.0, 7.0), (2.0, 3.0, 4.0, 5.0, 6.0))
    """
    num_stages = len(steps.bounds)
    start = [[0.0] * len(b) for b in steps.bounds]
    end = [[0.0] * len(b) for b in steps.bounds]
    posted = [[False] * len(b) for b in steps.bounds]
    clock = [0.0] * num_stages
    cursor = [0] * num_stages
    waiting: dict[tuple[int, int], list[int]] = {}
    blocked: dict[int, tuple[int, int, int]] = {}
    pending = list(range(num_stages))
    queued = [True] * num_stages
    step_at = steps.step_at

    while pending:
        s = pending.pop()
        queued[s] = False
        blocked.pop(s, None)
        bounds, groups, partner_s = steps.bounds[s], steps.is_group[s], partner[s]
        start_s, end_s, posted_s = start[s], end[s], posted[s]
        now, j, n = clock[s], cursor[s], len(bounds)
        while j < n:
            if not groups[j]:
                start_s[j] = now
                if duration is not None:
                    now += duration(s, j)
                end_s[j] = now
                j += 1
                continue
            if not posted_s[j]:
                posted_s[j] = True
                start_s[j] = now
                for waiter in waiting.pop((s, j), ()):
                    if not queued[waiter]:
                        queued[waiter] = True
                        pending.append(waiter)
            ready = start_s[j]
            missing = None
            lo, hi = bounds[j]
            for pos in range(lo, hi):
                peer = partner_s[pos]
                if peer is None:  # unmatched: the validator reports it; never completes
                    missing = (s, j)
                    break
                ps = peer[0]
                pstep = step_at[ps][peer[1]]
                if not posted[ps][pstep]:
                    missing = (ps, pstep)
                    break
                if start[ps][pstep] > ready:
                    ready = start[ps][pstep]
            if missing is not None:
                waiting.setdefault(missing, []).append(s)
                blocked[s] = (j, *missing)
                break
            now = ready + duration(s, j) if duration is not None else ready
            end_s[j] = now
            j += 1
        clock[s], cursor[s] = now, j
    return Walk(
        tuple(map(tuple, start)),
        tuple(map(tuple, end)),
        {s: blocked[s] for s in sorted(blocked)},
    )
