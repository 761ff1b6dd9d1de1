"""`schedcc.tune`, the library: typed results, ranking, the memory limit, skips and errors."""

from __future__ import annotations

import pytest

import schedcc
from schedcc import Backward, CostModel, Forward, Schedule, ScheduleConfigError, ScheduleError
from schedcc.schedule import ScheduleCodeError
from schedcc.tune import Candidate, Skipped, TuneResult


class OneChunkGPipe(Schedule):
    """README's GPipe: written for one chunk per stage (it never yields chunk 1)."""

    def order(self, stage):
        for batch in range(self.num_batches):
            mbs = self.microbatches(batch)
            yield from (Forward(i) for i in mbs)
            yield from (Backward(i) for i in reversed(mbs))


class ForwardsOnly(Schedule):
    """Never runs a backward: its program does not validate."""

    def order(self, stage):
        yield from (Forward(i) for i in range(self.num_microbatches))


class OrderRaises(Schedule):
    def order(self, stage):
        raise ZeroDivisionError("division by zero")


def test_tune_is_exported_at_the_top_level():
    """`schedcc.tune` is the library function and listed in `__all__`."""
    assert "tune" in schedcc.__all__
    assert callable(schedcc.tune)


def test_results_are_typed_and_ranked_fastest_first():
    """A TuneResult of Candidates sorted by time per microbatch, then memory; best is first."""
    result = schedcc.tune(["gpipe", "1f1b", "zb-h1"], num_stages=4, num_microbatches=[8, 16])
    assert isinstance(result, TuneResult)
    assert all(isinstance(c, Candidate) for c in result.ranked)
    keys = [(c.time_per_microbatch, c.peak_activations) for c in result.ranked]
    assert keys == sorted(keys)
    assert result.best == result.ranked[0]
    assert {(c.schedule, c.num_microbatches) for c in result.ranked} >= {("1f1b", 8), ("gpipe", 16)}
    one = next(c for c in result.ranked if (c.schedule, c.num_microbatches) == ("1f1b", 8))
    assert one.activations == (4, 3, 2, 1)
    assert one.makespan == 33.0


def test_eager_ranks_by_the_eager_timeline():
    """`tune(eager=True)` times each program as the engine runs it: every row's makespan is
    `simulate(..., eager=True)`'s, and interleaved 1F1B at p = 2, m = 8, v = 2 takes the ideal
    51 there against 57 under rendezvous ([Note: interleaved at two stages])."""
    from schedcc.registry import build_schedule, get_schedule
    from schedcc.tune import _per_chunk

    kwargs = {"num_stages": 2, "num_microbatches": 8, "num_chunks": 2}
    eager = schedcc.tune(["interleaved-1f1b", "looped-bfs", "zb-v"], eager=True, **kwargs)
    rendezvous = schedcc.tune(["interleaved-1f1b", "looped-bfs", "zb-v"], **kwargs)
    assert eager.eager
    assert not rendezvous.eager
    for c in eager.ranked:
        program = schedcc.compile(build_schedule(get_schedule(c.schedule), 2, 8, num_chunks=2))
        assert c.makespan == pytest.approx(
            schedcc.simulate(program, _per_chunk(CostModel(), 2), eager=True).makespan
        )
    [fast] = [c for c in eager.ranked if c.schedule == "interleaved-1f1b"]
    [slow] = [c for c in rendezvous.ranked if c.schedule == "interleaved-1f1b"]
    assert (2 * fast.makespan, 2 * slow.makespan) == (51.0, 57.0)  # in whole-stage forwards / 2


def test_every_registered_schedule_by_default_once_per_class():
    """schedules=None tries every registered schedule once, under its own name, not an alias."""
    result = schedcc.tune(num_stages=2, num_microbatches=4, num_chunks=[1, 2])
    names = {c.schedule for c in result.ranked}
    assert {"gpipe", "1f1b", "interleaved-1f1b", "2bw", "zb-h1", "zb-v"} <= names
    assert "pipedream-flush" not in names


def test_memory_limit_sets_programs_aside():
    """Programs above the limit go to over_limit, the rest stay ranked."""
    result = schedcc.tune(
        ["gpipe", "1f1b"], num_stages=4, num_microbatches=8, num_chunks=1, memory_limit=4
    )
    assert [c.schedule for c in result.ranked] == ["1f1b"]
    assert [c.schedule for c in result.over_limit] == ["gpipe"]


def test_a_chunk_copies_its_share_of_the_bytes():
    """At v = 2 a chunk's offload and reload take half a stage's copy time, as its computes
    take half their cost ([Note: tune's units]): interleaved 1F1B with every forward offloaded
    and copies of 2 units a stage is as fast as at v = 1 with copies of 1."""
    from schedcc.tune import _per_chunk

    halved = _per_chunk(CostModel(forward=2, offload=2, reload=4, comm=1), 2)
    assert (halved.forward, halved.offload, halved.reload, halved.comm) == (1, 1, 2, 1)
    program = schedcc.compile(schedcc.get_schedule("interleaved-1f1b")(2, 4, 2), offload=True)
    at_two = schedcc.simulate(program, _per_chunk(CostModel(offload=2, reload=2), 2)).makespan
    at_one = schedcc.simulate(program, CostModel(forward=0.5, backward=1, offload=1, reload=1))
    assert at_two == at_one.makespan


def test_rejected_shapes_are_skipped_with_the_reason():
    """A shape the constructor rejects is a Skipped naming the rule (1F1B with v = 2)."""
    result = schedcc.tune(["1f1b"], num_stages=2, num_microbatches=4, num_chunks=[1, 2])
    (skipped,) = result.skipped
    assert isinstance(skipped, Skipped)
    assert (skipped.schedule, skipped.num_chunks) == ("1f1b", 2)
    assert "one chunk per stage" in skipped.reason


def test_a_one_chunk_schedule_is_skipped_for_more_chunks_not_failed():
    """README's GPipe (never yields chunk 1) is ranked at v = 1 and skipped at v = 2."""
    result = schedcc.tune([OneChunkGPipe], num_stages=2, num_microbatches=4, num_chunks=[1, 2])
    assert [(c.schedule, c.num_chunks) for c in result.ranked] == [("OneChunkGPipe", 1)]
    assert [s.num_chunks for s in result.skipped] == [2]
    assert "one chunk per stage" in result.skipped[0].reason


def test_a_schedule_that_does_not_validate_is_an_error_not_a_drop():
    """A program that fails validation raises, naming the schedule and shape, on one line."""
    with pytest.raises(ScheduleError, match=r"ForwardsOnly at p=2, m=4, v=1") as info:
        schedcc.tune([ForwardsOnly], num_stages=2, num_microbatches=4, num_chunks=1)
    assert len(str(info.value).splitlines()) == 1


def test_a_schedule_whose_code_fails_is_a_code_error():
    """order() raising is a ScheduleCodeError naming the class and method."""
    with pytest.raises(ScheduleCodeError, match=r"OrderRaises\.order\(0\) raised ZeroDivision"):
        schedcc.tune([OrderRaises], num_stages=2, num_microbatches=2, num_chunks=1)


def test_costs_that_overflow_are_a_config_error():
    """Costs whose simulated makespan is infinite are refused, not ranked."""
    costs = CostModel(forward=1e308, backward=1e308)
    with pytest.raises(ScheduleConfigError, match="overflows"):
        schedcc.tune(["1f1b"], num_stages=4, num_microbatches=8, num_chunks=1, costs=costs)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"num_stages": 0}, "num_stages"),
        ({"num_stages": 2, "num_microbatches": []}, "num_microbatches is empty"),
        ({"num_stages": 2, "num_chunks": [1, "2"]}, "num_chunks"),
        ({"num_stages": 2, "memory_limit": -1}, "memory_limit"),
        ({"num_stages": 2, "costs": {"forward": 1}}, "CostModel"),
        ({"num_stages": 2, "zero": 5}, "zero"),
        ({"num_stages": 2, "eager": "yes"}, "eager"),
    ],
)
def test_bad_arguments_are_config_errors(kwargs, says):
    """Each bad argument is a ScheduleConfigError naming it."""
    with pytest.raises(ScheduleConfigError, match=says):
        schedcc.tune(["1f1b"], **kwargs)


def test_to_dict_is_json_ready():
    """to_dict gives plain dicts with the fields of each row."""
    import json

    result = schedcc.tune(["1f1b"], num_stages=2, num_microbatches=2, num_chunks=[1, 2])
    data = json.loads(json.dumps(result.to_dict()))
    assert data["ranked"][0]["schedule"] == "1f1b"
    assert data["ranked"][0]["activations"] == [2, 1]
    assert data["skipped"][0]["num_chunks"] == 2
