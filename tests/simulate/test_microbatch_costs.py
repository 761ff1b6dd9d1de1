"""`CostModel(per_microbatch=...)`: both simulators and `tune` see microbatches of unequal cost."""

from __future__ import annotations

import pytest
from hypothesis import given
from strategies import microbatch_sizes

import schedcc
from schedcc import CostModel, ScheduleConfigError
from schedcc.ir import COMPUTE

FACTORS = [1, 3, 2, 6]


def _program(name="1f1b", p=2, m=4, v=1):
    return schedcc.compile(schedcc.get_schedule(name)(p, m, v))


@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize(("name", "v"), [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)])
def test_each_compute_takes_its_microbatchs_share(name, v, eager):
    """In the step-model and the eager simulation each compute of microbatch i lasts
    factor[i % m] times its kind's cost; comm and updates keep theirs."""
    costs = CostModel(forward=1.0, backward=2.0, comm=0.25, per_microbatch=FACTORS)
    timeline = schedcc.simulate(_program(name, v=v), costs, eager=eager)
    plain = CostModel(forward=1.0, backward=2.0, comm=0.25)
    computes = [e for e in timeline.events if isinstance(e.instruction, COMPUTE)]
    for event in computes:
        op = event.instruction
        want = plain.cost(event.stage, op) * FACTORS[op.microbatch % 4]
        assert event.end - event.start == pytest.approx(want), event
    program = timeline.program
    assert len(computes) == sum(isinstance(op, COMPUTE) for ops in program.stages for op in ops)


@given(microbatch_sizes(4, max_size=6))
def test_one_stage_takes_the_sum_of_its_microbatches(factors):
    """On one stage GPipe's makespan is the sum over microbatches of factor * (F + B)."""
    costs = CostModel(forward=1.0, backward=2.0, per_microbatch=factors)
    program = _program("gpipe", p=1)
    for eager in (False, True):
        assert schedcc.simulate(program, costs, eager=eager).makespan == sum(factors) * 3.0


def test_imbalance_lengthens_the_pipeline():
    """Unequal microbatches of the same total cost take longer than equal ones through a
    pipeline (the slow one holds every stage up), and more so the larger the imbalance."""
    program = _program("1f1b", p=4, m=4)
    equal = schedcc.simulate(program, CostModel(per_microbatch=[3, 3, 3, 3])).makespan
    mild = schedcc.simulate(program, CostModel(per_microbatch=[2, 4, 3, 3])).makespan
    heavy = schedcc.simulate(program, CostModel(per_microbatch=[1, 1, 1, 9])).makespan
    assert equal < mild < heavy


def test_tune_sees_the_imbalance_and_skips_other_counts():
    """tune ranks with the per-microbatch costs at their m and skips other values of m."""
    costs = CostModel(per_microbatch=FACTORS)
    result = schedcc.tune(
        ["gpipe", "1f1b"], num_stages=2, num_microbatches=(4, 8), num_chunks=1, costs=costs
    )
    assert {c.num_microbatches for c in result.ranked} == {4}
    assert {(s.num_microbatches, s.reason) for s in result.skipped} == {
        (8, "costs.per_microbatch gives 4 microbatches")
    }
    for candidate in result.ranked:
        want = schedcc.simulate(_program(candidate.schedule), costs).makespan
        assert candidate.makespan == want


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ([1, 0], r"per_microbatch\[1\] must be a positive finite number"),
        ([1, -2], r"per_microbatch\[1\]"),
        ([1, float("inf")], r"per_microbatch\[1\]"),
        ("13", "must be a sequence of numbers"),
        ({0: 1.0}, "must be a sequence of numbers"),
        (3, "must be a sequence of numbers"),
    ],
)
def test_bad_factors_are_refused(value, words):
    """Zero, negative or infinite factors and non-sequences are a ScheduleConfigError."""
    with pytest.raises(ScheduleConfigError, match=words):
        CostModel(per_microbatch=value)


def test_another_count_than_m_is_refused_by_the_simulators():
    """Factors for 3 microbatches under a program of m = 4: a ScheduleConfigError naming both."""
    for eager in (False, True):
        with pytest.raises(ScheduleConfigError, match="gives 3 factors but the program has m=4"):
            schedcc.simulate(_program(), CostModel(per_microbatch=[1, 2, 3]), eager=eager)
