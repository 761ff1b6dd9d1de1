"""The gloo path's eager point-to-point plan (`backends.distributed.eager`): it cannot hang or
mispair.

An abstract executor runs every stage's plan together under the relaxed model the plan assumes
(sends never block; a receive completes once its channel's matching send was posted; per channel
the k-th receive pairs with the k-th send, as gloo pairs them). For random dependency-respecting
orders and the built-ins it must finish, pair every receive with a send of the same tensor, post
no send before its tensor is computed and wait no receive that was not posted.
"""

from __future__ import annotations

import pytest
from _orders import random_orders
from hypothesis import given
from hypothesis import strategies as st

import schedcc
from schedcc.backends.distributed.eager import RECV_LOOKAHEAD, EagerPlan
from schedcc.backends.distributed.groups import CommGroup, stage_ops
from schedcc.semantics import Layout, comm_route


def _run_relaxed(program, lookahead: int) -> None:
    layout = Layout.of(program.schedule)
    p = program.num_stages
    units = [stage_ops(program, s, layout) for s in range(p)]
    tensors = program.tensors
    plans = [EagerPlan(units[s], tensors, s, lookahead) for s in range(p)]
    sent: dict[tuple[int, int], list] = {}  # channel -> payloads, in posting order
    posted: dict[tuple[int, int], list] = {}  # channel -> receive payloads, in posting order
    where: list[dict] = [{} for _ in range(p)]  # receive op -> (channel, index), per stage
    done: list[set] = [set() for _ in range(p)]  # tensors made, per stage
    cursor, pre = [0] * p, [False] * p

    def route(s, op):
        src, dst, payload = comm_route(layout, s, op)
        return (src, dst), payload

    progress = True
    while progress:
        progress = False
        for s in range(p):
            while cursor[s] < len(units[s]):
                index = cursor[s]
                if type(units[s][index]) is CommGroup:  # comm groups carry no actions
                    assert not plans[s].post_before[index]
                    assert not plans[s].sends_after[index]
                    cursor[s] += 1
                    continue
                if not pre[s]:
                    for op, *_ in plans[s].post_before[index]:
                        channel, payload = route(s, op)
                        queue = posted.setdefault(channel, [])
                        where[s][op] = (channel, len(queue))
                        queue.append(payload)
                    pre[s] = True
                waits = plans[s].wait_before[index]
                assert all(op in where[s] for op, *_ in waits), "a receive waited, never posted"
                if any(len(sent.get(c, [])) <= k for c, k in (where[s][op] for op, *_ in waits)):
                    break  # blocked on a peer
                unit = units[s][index]
                done[s].add(tensors.makes(s, unit))
                for op, *_ in plans[s].sends_after[index]:
                    assert tensors.route(s, op).tensor in done[s], f"{op} posted before its compute"
                    channel, payload = route(s, op)
                    sent.setdefault(channel, []).append(payload)
                cursor[s] += 1
                pre[s] = False
                progress = True
    stuck = [s for s in range(p) if cursor[s] < len(units[s])]
    assert not stuck, f"stages {stuck} never finished: the eager plan would hang"
    assert sent == posted, "a receive paired with another tensor's send"


@given(random_orders(max_stages=5, max_microbatches=8), st.integers(0, 3))
def test_eager_plan_cannot_hang_or_mispair_on_random_orders(schedule, lookahead):
    _run_relaxed(schedcc.compile(schedule), lookahead)


@pytest.mark.parametrize(
    ("name", "p", "m", "v"),
    [
        ("gpipe", 4, 8, 1),
        ("1f1b", 4, 8, 1),
        ("interleaved-1f1b", 4, 8, 2),
        ("interleaved-1f1b", 2, 8, 2),
        ("2bw", 3, 6, 1),
        ("zb-h1", 4, 8, 1),
        ("zb-v", 4, 8, 2),
    ],
)
def test_eager_plan_runs_the_builtins(name, p, m, v):
    _run_relaxed(schedcc.compile(schedcc.get_schedule(name)(p, m, v)), lookahead=2)


def test_sends_leave_right_after_their_compute():
    """Interleaved 1F1B on 2 stages: stage 1's SA2 goes right after F2, not after B0 too."""
    program = schedcc.compile(schedcc.get_schedule("interleaved-1f1b")(2, 8, 2))
    units = stage_ops(program, 1, Layout.of(program.schedule))
    eager = EagerPlan(units, program.tensors, 1)
    after = {
        str(units[i]): [str(op) for op, *_ in sends]
        for i, sends in enumerate(eager.sends_after)
        if sends
    }
    order = [str(op) for op in program.stages[1]]
    assert order.index("SA2") > order.index("B0") > order.index("F2")  # the program's place
    assert after["F2"] == ["SA2"]
    assert after["B0"] == ["SG0"]


@pytest.mark.parametrize(
    ("name", "p", "m", "v"),
    [("1f1b", 4, 8, 1), ("1f1b", 2, 64, 1), ("interleaved-1f1b", 4, 64, 2), ("zb-v", 4, 8, 2)],
)
def test_receive_buffers_waiting_at_once_stay_bounded(name, p, m, v):
    """At most RECV_LOOKAHEAD + 1 receives are posted and not yet consumed, whatever m is."""
    program = schedcc.compile(schedcc.get_schedule(name)(p, m, v))
    layout = Layout.of(program.schedule)
    for stage in range(p):
        eager = EagerPlan(stage_ops(program, stage, layout), program.tensors, stage)
        waiting = most = 0
        for posts, waits in zip(eager.post_before, eager.wait_before):
            waiting += len(posts)
            most = max(most, waiting)
            waiting -= len(waits)
        assert waiting == 0
        assert most <= RECV_LOOKAHEAD + 1, (stage, most)
