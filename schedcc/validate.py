"""The validator: a table of small named rules, each returning the problems it finds.

`validate(program)` raises the first problem as its own `ScheduleError` subclass, with the
stage-by-position grid around it and `<-- here` on the failing row; `validate(program,
collect=True)` returns every problem instead. Each rule is linear in the program size.

    >>> import schedcc
    >>> program = schedcc.compile(schedcc.get_schedule("1f1b")(4, 8), validate=False)
    >>> schedcc.validate(program, collect=True)
    []
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from functools import cached_property

import attrs

from schedcc.analysis import Layout, Steps, match_comm, paused_gc, walk
from schedcc.errors import (
    DeadlockError,
    DependencyError,
    IncompleteScheduleError,
    MemoryBoundError,
    ScheduleConfigError,
    ScheduleError,
    UnmatchedCommError,
    WeightVersionError,
)
from schedcc.ir import Instruction
from schedcc.program import Program

__all__ = ["RULES", "render_grid", "validate"]


@attrs.frozen
class Problem:
    """One finding of a rule: the error class, what is wrong and how to fix it, and where."""

    error: type[ScheduleError]
    message: str
    stage: int | None = None
    position: int | None = None


class _Context:
    """What several rules read, computed once per validation."""

    def __init__(self, program: Program, max_activations: int | None):
        self.program = program
        self.schedule = program.schedule
        self.max_activations = max_activations
        self.layout = Layout.of(program.schedule)

    @cached_property
    def matching(self):
        return match_comm(self.program, self.layout)

    def where(self, stage: int, pos: int) -> str:
        return f"stage {stage}, position {pos} ({self.program.stages[stage][pos]})"


Rule = Callable[[_Context], Iterator[Problem]]


def check_complete(ctx: _Context) -> Iterator[Problem]:
    """Each (microbatch, segment) is forwarded once and backwarded once (B, or I then W)."""
    # counts[4 * (i * num_segments + k) + n]: how often code "FBIW"[n] runs (i, k).
    num_segments = len(ctx.layout.stage_of)
    counts = [0] * (4 * num_segments * ctx.schedule.num_microbatches_total)
    column = {"F": 0, "B": 1, "I": 2, "W": 3}
    for s, ops in enumerate(ctx.program.stages):
        seg = ctx.layout.segment[s]
        for op in ops:
            if op.group == "compute":
                counts[4 * (op.microbatch * num_segments + seg[op.chunk]) + column[op.code]] += 1
    stage_of, chunk_of = ctx.layout.stage_of, ctx.layout.chunk_of
    quads = zip(counts[0::4], counts[1::4], counts[2::4], counts[3::4])
    for index, (f, b, inp, w) in enumerate(quads):
        if f == 1 and ((b, inp, w) == (1, 0, 0) or (b, inp, w) == (0, 1, 1)):
            continue
        i, k = divmod(index, num_segments)
        s, c = stage_of[k], chunk_of[k]
        what = f"microbatch {i}, segment {k} (stage {s}, chunk {c})"
        if f != 1:
            yield Problem(
                IncompleteScheduleError,
                f"{what} is forwarded {f} times; stage {s} must yield Forward({i}, chunk={c}) "
                "exactly once",
                s,
            )
        if (b, inp, w) != (1, 0, 0) and (b, inp, w) != (0, 1, 1):
            yield Problem(
                IncompleteScheduleError,
                f"{what} has {b} Backward, {inp} BackwardInput and {w} BackwardWeight; stage "
                f"{s} must yield either Backward({i}, chunk={c}) once, or "
                f"BackwardInput({i}, chunk={c}) and BackwardWeight({i}, chunk={c}) once each",
                s,
            )
    num_batches = ctx.schedule.num_batches
    for s, ops in enumerate(ctx.program.stages):
        steps = sum(1 for op in ops if op.code == "Step")
        if steps != num_batches:
            yield Problem(
                IncompleteScheduleError,
                f"stage {s} has {steps} OptimizerStep instructions; it needs one per batch "
                f"({num_batches})",
                s,
            )


def check_dependencies(ctx: _Context) -> Iterator[Problem]:
    """On its own stage, each instruction comes after what it needs."""
    for s in range(ctx.program.num_stages):
        yield from _stage_dependencies(ctx, s)


def _stage_dependencies(ctx: _Context, s: int) -> Iterator[Problem]:
    """Stage `s` in program order: data dependencies first; an instruction that passes them is
    then checked against the optimizer steps, reductions and gathers (`_UpdateOrder`)."""
    need_of, updates = _data_needs(ctx, s), _UpdateOrder(ctx)
    for pos, op in enumerate(ctx.program.stages[s]):
        need = need_of(op)
        if need:
            yield Problem(DependencyError, f"{ctx.where(s, pos)} needs {need}", s, pos)
            continue
        if op.group != "comm":
            for text in updates.problems(op):
                yield Problem(DependencyError, f"{ctx.where(s, pos)} {text}", s, pos)


def _data_needs(ctx: _Context, s: int) -> Callable[[Instruction], str | None]:
    """A function that records each compute or comm of stage `s`, in order, and returns what it
    needed that had not come before it on this stage (None: nothing)."""
    layout = ctx.layout
    seg, stage_of, chunk_of, last = layout.segment[s], layout.stage_of, layout.chunk_of, layout.last
    forwarded, input_grad, split, got_act, got_grad = set(), set(), set(), set(), set()

    def need(op: Instruction) -> str | None:
        if op.group not in ("compute", "comm"):
            return None
        code, i, c = op.code, op.microbatch, op.chunk
        k = seg[c]
        text = None
        if code == "F":
            if k > 0 and stage_of[k - 1] == s and (i, chunk_of[k - 1]) not in forwarded:
                before = _short("F", i, chunk_of[k - 1])
                text = f"{before} (the forward of segment {k - 1}) before it"
            elif k > 0 and stage_of[k - 1] != s and (i, c) not in got_act:
                text = f"its input received first: a RecvActivation {_short('RA', i, c)} before it"
            forwarded.add((i, c))
        elif code in ("B", "I"):
            if (i, c) not in forwarded:
                text = f"its forward {_short('F', i, c)} before it"
            elif k < last and stage_of[k + 1] == s and (i, chunk_of[k + 1]) not in input_grad:
                text = f"the backward of segment {k + 1} ({_short('B', i, chunk_of[k + 1])})"
            elif k < last and stage_of[k + 1] != s and (i, c) not in got_grad:
                text = f"its output gradient received first: {_short('RG', i, c)} before it"
            input_grad.add((i, c))
            if code == "I":
                split.add((i, c))
        elif code == "W" and (i, c) not in split:
            text = f"its BackwardInput {_short('I', i, c)} before it"
        elif code == "SA" and (i, c) not in forwarded:
            text = f"the forward that produces it, {_short('F', i, c)}, before it"
        elif code == "SG" and (i, c) not in input_grad:
            text = f"the backward that produces it, {_short('B', i, c)} or {_short('I', i, c)}"
        elif code == "RA":
            got_act.add((i, c))
        elif code == "RG":
            got_grad.add((i, c))
        return text

    return need


class _UpdateOrder:
    """One stage's optimizer steps, reductions and gathers against its weight gradients: the
    n-th step applies exactly batch n's weight gradients, reduced (data parallel) and, under
    ZeRO-1, gathered before the next compute of the chunk."""

    def __init__(self, ctx: _Context):
        program = ctx.program
        self.m, self.num_chunks = ctx.schedule.num_microbatches, ctx.schedule.num_chunks
        self.zero = program.zero
        self.must_reduce = program.data_parallel > 1 or program.zero > 0
        self.grads_of_batch: Counter = Counter()
        self.unreduced = [0] * self.num_chunks
        self.reduced = [0] * self.num_chunks
        self.stale = [False] * self.num_chunks
        self.steps = 0

    def problems(self, op) -> list[str]:
        """Record a compute or update `op`; return what is wrong with its place (after "where")."""
        code = op.code
        found = self._gradient(op.microbatch // self.m, op.chunk) if code in ("B", "W") else []
        if op.group == "compute" and self.stale[op.chunk]:
            found.append(
                f"runs on chunk {op.chunk} after the optimizer step but before its "
                f"GatherParams({op.chunk}) (ZeRO-1): its weights are stale; gather them first"
            )
        if code == "Reduce":
            if not self.unreduced[op.chunk]:
                found.append(
                    "has no gradient to reduce since the last reduction; put it after the "
                    "chunk's last backward of the batch"
                )
            self.unreduced[op.chunk] = 0
            self.reduced[op.chunk] += 1
        elif code == "Step":
            found = self._step()
        elif code == "Gather":
            self.stale[op.chunk] = False
        return found

    def _gradient(self, batch: int, c: int) -> list[str]:
        found = []
        if batch != self.steps:
            when = f"after only {self.steps}" if batch > self.steps else f"after {self.steps}"
            found.append(
                f"is a weight gradient of batch {batch}, but runs {when} optimizer step(s) on "
                "this stage; the n-th OptimizerStep must come after every weight gradient of "
                "batch n and before any of batch n + 1"
            )
        self.grads_of_batch[batch] += 1
        self.unreduced[c] += 1
        if self.must_reduce and self.zero < 2 and self.reduced[c]:
            found.append(
                f"adds a gradient after this batch's ReduceGrads of chunk {c}; it would never be "
                "reduced: move ReduceGrads after it"
            )
        return found

    def _step(self) -> list[str]:
        num_chunks, steps = self.num_chunks, self.steps
        expected = self.m * num_chunks
        pending = [c for c in range(num_chunks) if self.unreduced[c]] if self.must_reduce else []
        found = []
        if self.grads_of_batch[steps] < expected:
            found.append(
                f"is the step of batch {steps}, but only {self.grads_of_batch[steps]} of its "
                f"{expected} weight gradients on this stage come before it; move it after the "
                "batch's last backward"
            )
        elif pending:
            found.append(
                f"steps before the gradients of chunk(s) {pending} are reduced across "
                "data-parallel ranks; put ReduceGrads for them before it"
            )
        self.steps += 1
        self.unreduced, self.reduced = [0] * num_chunks, [0] * num_chunks
        if self.zero >= 1:
            self.stale = [True] * num_chunks
        return found


def _short(code: str, i: int, c: int) -> str:
    return f"{code}{i}.{c}" if c else f"{code}{i}"


def check_comm(ctx: _Context) -> Iterator[Problem]:
    """Every send meets exactly its receive, one-to-one and in FIFO order per channel."""
    _, problems = ctx.matching
    stages = ctx.program.stages
    for p in problems:
        where = ctx.where(p.stage, p.position)
        if p.kind == "nowhere":
            text = (
                f"{where} has nothing to move: its segment's neighbour in that direction is on "
                "the same stage or does not exist; remove it"
            )
        elif p.kind == "unmatched":
            op = stages[p.stage][p.position]
            other = "receive" if op.is_send else "send"
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


def check_deadlock(ctx: _Context) -> Iterator[Problem]:
    """The stages, each running its program in order with rendezvous comm groups, all finish."""
    partner, problems = ctx.matching
    if problems:  # unmatched comm is check_comm's to report; the step model needs pairs
        return
    stages = ctx.program.stages
    steps = Steps.of(stages)
    result = walk(steps, partner)
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


def check_versions(ctx: _Context) -> Iterator[Problem]:
    """Each compute's weight version exists when it runs, and at most d + 1 are kept."""
    schedule = ctx.schedule
    m, delay = schedule.num_microbatches, schedule.weight_delay
    for s, ops in enumerate(ctx.program.stages):
        produced = 0
        for pos, op in enumerate(ops):
            if op.code == "Step":
                produced += 1
            elif op.group == "compute":
                batch = op.microbatch // m
                version = max(0, batch - delay)
                if version > produced:
                    yield Problem(
                        WeightVersionError,
                        f"{ctx.where(s, pos)} needs weight version {version} (batch {batch}, "
                        f"weight_delay {delay}) but only {produced} optimizer step(s) have run on "
                        "this stage; run it after the step that produces that version",
                        s,
                        pos,
                    )
                elif version < produced - delay:
                    yield Problem(
                        WeightVersionError,
                        f"{ctx.where(s, pos)} needs weight version {version}, but after "
                        f"{produced} steps only versions {produced - delay}..{produced} are kept "
                        f"(weight_delay {delay} keeps {delay + 1}); run it before step "
                        f"{version + delay} or raise weight_delay",
                        s,
                        pos,
                    )


def check_memory(ctx: _Context) -> Iterator[Problem]:
    """No stage holds more than `max_activations` microbatch activations at once."""
    limit = ctx.max_activations
    if limit is None:
        return
    for s, ops in enumerate(ctx.program.stages):
        held = 0
        for pos, op in enumerate(ops):
            if op.code == "F":
                held += 1
                if held > limit:
                    yield Problem(
                        MemoryBoundError,
                        f"{ctx.where(s, pos)} makes stage {s} hold {held} microbatch activations, "
                        f"over the limit of {limit}; run a backward earlier or lower the "
                        "in-flight microbatches",
                        s,
                        pos,
                    )
                    break
            elif op.code in ("B", "I"):
                held -= 1


#: The rules, in the order they run.
RULES: tuple[Rule, ...] = (
    check_complete,
    check_dependencies,
    check_comm,
    check_deadlock,
    check_versions,
    check_memory,
)


def validate(
    program: Program, *, collect: bool = False, max_activations: int | None = None
) -> list[ScheduleError] | None:
    """Prove `program` safe, or say what is wrong.

    Args:
        program: a compiled program.
        collect: return every problem as a list (empty when valid) instead of raising the first.
        max_activations: also check that no stage holds more microbatch activations than this.

    Raises:
        ScheduleError: the subclass of the first failing rule (unless `collect`).
        ScheduleConfigError: `program` is not a compiled `Program`, or `max_activations` is not
            a positive integer.
    """
    if not isinstance(program, Program):
        raise ScheduleConfigError(f"validate() needs a compiled Program, got {program!r}")
    if max_activations is not None and (
        isinstance(max_activations, bool)
        or not isinstance(max_activations, int)
        or max_activations < 1
    ):
        raise ScheduleConfigError(
            f"max_activations must be a positive integer (or None), got {max_activations!r}"
        )
    ctx = _Context(program, max_activations)
    found: list[ScheduleError] = []
    with paused_gc():
        for rule in RULES:
            for problem in rule(ctx):
                error = _as_error(program, problem)
                if not collect:
                    raise error
                found.append(error)
    return found if collect else None


def _as_error(program: Program, problem: Problem) -> ScheduleError:
    text = problem.message
    if problem.stage is not None and problem.position is not None:
        text += "\n\n" + render_grid(program, problem.stage, problem.position)
    return problem.error(text, stage=problem.stage, position=problem.position)


def render_grid(
    program: Program, stage: int, position: int, *, rows: int = 4, stages: int = 2
) -> str:
    """The instructions around `(stage, position)`: a row per position, a column per stage.

    The failing cell is starred and its row ends with `<-- here`.
    """
    lo_s, hi_s = max(0, stage - stages), min(program.num_stages, stage + stages + 1)
    lo, hi = max(0, position - rows), position + rows + 1
    header = ["pos"] + [f"stage {s}" for s in range(lo_s, hi_s)]
    lines = []
    for pos in range(lo, hi):
        cells = [str(pos)]
        for s in range(lo_s, hi_s):
            ops = program.stages[s]
            cell = str(ops[pos]) if pos < len(ops) else ""
            cells.append(f"*{cell}*" if (s, pos) == (stage, position) else cell)
        if all(not cell for cell in cells[1:]):
            break
        lines.append(cells)
    widths = [max(len(row[col]) for row in [header, *lines]) for col in range(len(header))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(header, widths)).rstrip()]
    for pos, cells in zip(range(lo, hi), lines):
        row = "  ".join(cell.ljust(w) for cell, w in zip(cells, widths))
        out.append(row + "  <-- here" if pos == position else row.rstrip())
    return "\n".join(out)
