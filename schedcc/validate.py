"""The validator: a table of small named rules, each returning the problems it finds.

`validate(program)` raises the first problem as its own `ScheduleError` subclass, with the
stage-by-position grid around it and `<-- here` on the failing row; `validate(program,
collect=True)` returns every problem instead. Each rule is linear in the program size. The
problems are found once per program and kept on it (`Program.problems`), so a program is
validated once however many readers ask.

    >>> import schedcc
    >>> program = schedcc.compile(schedcc.get_schedule("1f1b")(4, 8), validate=False)
    >>> schedcc.validate(program, collect=True)
    []
"""

from __future__ import annotations

from schedcc._gc import paused_gc
from schedcc.errors import ScheduleConfigError, ScheduleError
from schedcc.memory_model import MemoryModel
from schedcc.program import Program
from schedcc.rules import Context, Problem, Rule
from schedcc.rules.bytes import check_bytes
from schedcc.rules.comm import check_comm, check_deadlock
from schedcc.rules.computes import check_complete, check_dependencies, check_memory
from schedcc.rules.norm import check_norm
from schedcc.rules.offload import check_offload
from schedcc.rules.overlap import check_overlaps
from schedcc.rules.parts import check_parts
from schedcc.rules.recompute import check_recompute
from schedcc.rules.sharding import check_sharding
from schedcc.rules.tied import check_tied
from schedcc.rules.updates import (
    check_gathers,
    check_reductions,
    check_replicas,
    check_step_order,
    check_update_window,
    check_versions,
)
from schedcc.sizes import parse_size

__all__ = ["RULES", "ensure_valid", "find_problems", "render_grid", "validate"]

#: The rules, in the order they run.
RULES: tuple[Rule, ...] = (
    check_replicas,
    check_complete,
    check_dependencies,
    check_parts,
    check_recompute,
    check_offload,
    check_overlaps,
    check_step_order,
    check_reductions,
    check_gathers,
    check_sharding,
    check_tied,
    check_norm,
    check_comm,
    check_deadlock,
    check_versions,
    check_update_window,
    check_memory,
    check_bytes,
)

#: The rules that only a caller's limits (`max_activations`, `max_bytes`) make find anything;
#: they run last, so a program's other problems come first.
_LIMITS = (check_memory, check_bytes)
assert RULES[-len(_LIMITS) :] == _LIMITS


def validate(
    program: Program,
    *,
    collect: bool = False,
    max_activations: int | None = None,
    max_bytes: float | str | None = None,
    memory: MemoryModel | None = None,
) -> list[ScheduleError] | None:
    """Prove `program` safe, or say what is wrong.

    Args:
        program: a compiled program.
        collect: return every problem as a list (empty when valid) instead of raising the first.
        max_activations: also check that no stage holds more microbatch activations than this.
        max_bytes: also check that no stage holds more bytes than this (a number or a size
            such as "12GiB"), counted with `memory` ([Note: bytes per stage] in
            `schedcc.semantics.stage_bytes`).
        memory: the `MemoryModel` that `max_bytes` counts with.

    Raises:
        ScheduleError: the subclass of the first failing rule (unless `collect`).
        ScheduleConfigError: `program` is not a compiled `Program`, `max_activations` is not
            a positive integer, or `max_bytes` is not a size or comes without `memory`.
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
    limit = _byte_limit(program, max_bytes, memory)
    limited = max_activations is not None or limit is not None
    with paused_gc():
        if collect and limited:
            found = _run(program, Context(program, max_activations, max_bytes=limit, memory=memory))
        else:
            found = list(program.problems)
            if limited and not found:
                context = Context(program, max_activations, max_bytes=limit, memory=memory)
                found = _run(program, context, _LIMITS)
    if found and not collect:
        raise found[0]
    return found if collect else None


def find_problems(program: Program) -> tuple[ScheduleError, ...]:
    """Every problem `RULES` find in `program` without limits, in order (what
    `Program.problems` keeps; read it there)."""
    with paused_gc():
        return tuple(_run(program, Context(program, None)))


def _run(program: Program, ctx: Context, rules: tuple[Rule, ...] | None = None) -> list:
    """The problems `rules` (all of `RULES` by default) find, as errors."""
    found: list[ScheduleError] = []
    for rule in RULES if rules is None else rules:
        found.extend(_as_error(program, problem) for problem in rule(ctx))
        if found and rule is check_replicas:  # the other rules read one program per stage
            break
    return found


def _byte_limit(program: Program, max_bytes, memory) -> float | None:
    """`max_bytes` as a number of bytes (None: no limit), checked with its memory model."""
    if max_bytes is None:
        return None
    if not isinstance(memory, MemoryModel):
        raise ScheduleConfigError(
            f"max_bytes needs memory=MemoryModel(activations=..., parameters=..., ...) to count "
            f"bytes with, got memory={memory!r}"
        )
    memory.check(program.schedule.num_segments, type(program.schedule).num_replicas)
    limit = parse_size(max_bytes)
    if limit <= 0:
        raise ScheduleConfigError(f"max_bytes must be positive, got {max_bytes!r}")
    return float(limit)


def ensure_valid(program: Program) -> None:
    """Raise `program`'s first problem, if it has one (`Program.problems`, found once: the
    program is immutable; `compile(validate=True)` proves what it returns).

    Raises:
        ScheduleError: the first problem, as `validate` does.

    >>> import schedcc
    >>> program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4), validate=False)
    >>> ensure_valid(program)  # validates once; a second call returns at once
    >>> ensure_valid(program)
    """
    if program.problems:
        raise program.problems[0]


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
