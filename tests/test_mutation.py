"""Mutation tests: a broken program is rejected with a ScheduleError, never anything else.

Drop, duplicate, swap or move instructions (comm and updates included) of a valid program. The
validator must either accept the result, and then an independent naive executor (below) must
run it to completion with every tensor where it is needed, or raise a `ScheduleError` subclass:
never another exception, never a hang (every algorithm involved is linear; the executor is
bounded). Mutated compute-only orders go through `compile` under the same rule.
"""

from __future__ import annotations

import pytest
from _orders import OrderSchedule, random_orders
from hypothesis import given
from hypothesis import strategies as st

import schedcc
from schedcc import Program, ScheduleError, validate

_KINDS = ("drop", "duplicate", "swap", "move")


@st.composite
def mutations(draw, max_count: int = 3):
    """A list of (kind, stage, position, other position) as fractions in [0, 1)."""
    unit = st.floats(0, 1, exclude_max=True)
    return draw(
        st.lists(
            st.tuples(st.sampled_from(_KINDS), unit, unit, unit), min_size=1, max_size=max_count
        )
    )


def mutate(stages, edits) -> tuple[tuple, ...]:
    """`stages` with the edits applied (empty stages are left alone)."""
    out = [list(ops) for ops in stages]
    for kind, at_stage, at, other in edits:
        ops = out[int(at_stage * len(out))]
        if not ops:
            continue
        j, k = int(at * len(ops)), int(other * len(ops))
        if kind == "drop":
            del ops[j]
        elif kind == "duplicate":
            ops.insert(k, ops[j])
        elif kind == "swap":
            ops[j], ops[k] = ops[k], ops[j]
        else:
            ops.insert(k, ops.pop(j))
    return tuple(tuple(ops) for ops in out)


_SMALL = {"max_stages": 4, "max_microbatches": 4, "max_chunks": 2}
_PARALLEL = st.sampled_from([(1, 0), (2, 0), (2, 1), (2, 2)])


@given(random_orders(**_SMALL), _PARALLEL, mutations())
def test_mutated_program_is_rejected_or_runs(schedule, parallel, edits):
    """A mutated lowered program raises a ScheduleError, or validates and runs correctly."""
    data_parallel, zero = parallel
    program = schedcc.compile(schedule, data_parallel=data_parallel, zero=zero)
    mutated = program.evolve(stages=mutate(program.stages, edits))
    try:
        validate(mutated)
    except ScheduleError:
        return
    execute(mutated)


@given(random_orders(**_SMALL), _PARALLEL, mutations())
def test_mutated_compute_order_is_rejected_or_compiles(schedule, parallel, edits):
    """A mutated compute order fails to compile with a ScheduleError, or compiles and runs."""
    data_parallel, zero = parallel
    orders = mutate(schedule.orders, edits)
    mutated = OrderSchedule(
        schedule.num_stages,
        schedule.num_microbatches,
        schedule.num_chunks,
        schedule.num_batches,
        vshape=schedule.vshape,
        orders=orders,
    )
    try:
        program = schedcc.compile(mutated, data_parallel=data_parallel, zero=zero)
    except ScheduleError:
        return
    execute(program)


@given(random_orders(**_SMALL), _PARALLEL)
def test_executor_runs_every_valid_program(schedule, parallel):
    """The executor accepts what the compiler produces (so its rejections above mean something)."""
    data_parallel, zero = parallel
    execute(schedcc.compile(schedule, data_parallel=data_parallel, zero=zero))


def test_executor_catches_a_bad_program():
    """The executor is a real check: it rejects a program the validator is not asked about."""
    program = schedcc.compile(schedcc.get_schedule("gpipe")(2, 2), validate=False)
    swapped = list(program.stages[1])
    swapped[0], swapped[1] = swapped[1], swapped[0]  # F0 before RA0
    with pytest.raises(AssertionError, match="input"):
        execute(program.evolve(stages=(program.stages[0], tuple(swapped))))


# -- an independent naive executor ---------------------------------------------------------------


class _Stage:
    """One stage's state while executing: its cursor and what tensors it holds."""

    def __init__(self, ops):
        self.ops = ops
        self.pos = 0
        self.group: list[tuple[int, int, int]] | None = None  # (position, channel, index)
        self.outputs: set[tuple] = set()  # ("F" | "G", microbatch, segment) held here
        self.forwarded: set[tuple] = set()
        self.input_grad: set[tuple] = set()


def execute(program: Program) -> None:
    """Run `program` under rendezvous comm groups, asserting every data dependency holds.

    Deliberately naive and separate from `schedcc.analysis`: ops name tensors by segment, FIFO
    channels are queues, and stages are polled round-robin until none can move.
    """
    schedule = program.schedule
    table = schedule.segment_table()
    stage_of = {k: s for s, row in enumerate(table) for k in row}
    last = schedule.num_segments - 1
    stages = [_Stage(ops) for ops in program.stages]
    posted: dict[tuple[str, int, int], list[tuple]] = {}  # (side, src, dst) -> payloads
    counts = {"F": 0, "B": 0}
    progress = True
    while progress:
        progress = False
        for s, stage in enumerate(stages):
            while _advance(s, stage, table, stage_of, last, posted, counts):
                progress = True
    stuck = [s for s, stage in enumerate(stages) if stage.pos < len(stage.ops)]
    assert not stuck, f"stages {stuck} never finish"
    total = schedule.num_microbatches_total * schedule.num_segments
    assert counts == {"F": total, "B": total}, counts


def _advance(s, stage, table, stage_of, last, posted, counts) -> bool:
    """Run one step of `stage`; False if it is finished or blocked."""
    if stage.group is not None:
        return _finish_group(s, stage, table, stage_of, last, posted)
    if stage.pos >= len(stage.ops):
        return False
    op = stage.ops[stage.pos]
    if op.group == "comm":
        _post_group(s, stage, table, stage_of, last, posted)
        return True
    if op.group == "compute":
        _compute(stage, op, table[s][op.chunk], last, counts)
    stage.pos += 1
    return True


def _compute(stage, op, k, last, counts) -> None:
    i = op.microbatch
    if op.code == "F":
        assert k == 0 or ("F", i, k - 1) in stage.outputs, f"{op} runs without its input"
        assert (i, k) not in stage.forwarded, f"{op} runs twice"
        stage.forwarded.add((i, k))
        stage.outputs.add(("F", i, k))
        counts["F"] += 1
    elif op.code in ("B", "I"):
        assert (i, k) in stage.forwarded, f"{op} runs before its forward"
        assert k == last or ("G", i, k + 1) in stage.outputs, f"{op} runs without its input grad"
        assert (i, k) not in stage.input_grad, f"{op} runs twice"
        stage.input_grad.add((i, k))
        stage.outputs.add(("G", i, k))
        counts["B"] += op.code == "B"
    else:
        assert (i, k) in stage.input_grad, f"{op} runs before its input gradient"
        counts["B"] += 1


def _route(s, op, table, stage_of, last):
    """(src, dst, payload) of a comm op, or fail: the op must move something."""
    k, i = table[s][op.chunk], op.microbatch
    if op.code == "SA":
        assert k < last, f"{op} has no peer"
        assert stage_of[k + 1] != s, f"{op} has no peer"
        return s, stage_of[k + 1], ("F", i, k)
    if op.code == "RA":
        assert k > 0, f"{op} has no peer"
        assert stage_of[k - 1] != s, f"{op} has no peer"
        return stage_of[k - 1], s, ("F", i, k - 1)
    if op.code == "SG":
        assert k > 0, f"{op} has no peer"
        assert stage_of[k - 1] != s, f"{op} has no peer"
        return s, stage_of[k - 1], ("G", i, k)
    assert k < last, f"{op} has no peer"
    assert stage_of[k + 1] != s, f"{op} has no peer"
    return stage_of[k + 1], s, ("G", i, k + 1)


def _post_group(s, stage, table, stage_of, last, posted) -> None:
    stage.group = []
    while stage.pos < len(stage.ops) and stage.ops[stage.pos].group == "comm":
        op = stage.ops[stage.pos]
        src, dst, payload = _route(s, op, table, stage_of, last)
        side = "send" if op.is_send else "recv"
        if op.is_send:
            assert payload in stage.outputs, f"{op} sends a tensor this stage does not hold"
        queue = posted.setdefault((side, src, dst), [])
        stage.group.append((stage.pos, (src, dst), len(queue)))
        queue.append(payload)
        stage.pos += 1


def _finish_group(s, stage, table, stage_of, last, posted) -> bool:
    for pos, (src, dst), index in stage.group:
        op = stage.ops[pos]
        other = posted.get(("recv" if op.is_send else "send", src, dst), [])
        if len(other) <= index:
            return False
    for pos, (src, dst), index in stage.group:
        op = stage.ops[pos]
        if not op.is_send:
            payload = posted[("send", src, dst)][index]
            assert payload == posted[("recv", src, dst)][index], f"{op} receives {payload}"
            stage.outputs.add(payload)
    stage.group = None
    return True
