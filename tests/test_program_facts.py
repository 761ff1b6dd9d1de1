"""A program's derived facts (`Program.tensors`, `step_model`, `rule_versions`, `reference_walk`,
`graph`, `problems`): cached properties, built once, never carried to a copy."""

from __future__ import annotations

from functools import cached_property

import pytest
from hypothesis import given
from hypothesis import strategies as st

import schedcc
from schedcc.errors import DependencyError, ScheduleError
from schedcc.ir import Forward, RecvActivation
from schedcc.program import Program
from schedcc.simulate import simulate
from schedcc.testing import schedules
from schedcc.validate import ensure_valid

#: the derived facts, read off the class (what [Note: derived facts] lists)
_FACTS = tuple(name for name, value in vars(Program).items() if isinstance(value, cached_property))

programs = st.sampled_from(("1f1b", "interleaved-1f1b", "zb-h1")).flatmap(
    lambda name: schedules(
        schedcc.get_schedule(name), max_stages=4, max_microbatches=6, max_chunks=2
    )
).map(schedcc.compile)


def test_the_facts_are_the_ones_the_note_lists():
    """Every derived fact is a cached property of `Program`, named in its [Note: derived facts]."""
    assert set(_FACTS) == {
        "tensors",
        "step_model",
        "rule_versions",
        "reference_walk",
        "graph",
        "problems",
    }
    note = Program.__doc__.split("[Note: derived facts]", 1)[1]
    assert all(f"`{name}`" in note for name in _FACTS)


@given(programs)
def test_a_fact_is_built_once_and_shared(program):
    """Reading a fact twice gives the same object, and the step model uses the program's own
    tensor keys."""
    for name in _FACTS:
        assert getattr(program, name) is getattr(program, name)
    assert program.step_model.tensors is program.tensors


@given(programs, st.sampled_from(({}, {"versions": None}, {"grad_norm": False})))
def test_evolve_drops_every_fact(program, changes):
    """A copy starts with none of the facts its original read, and builds equal ones anew."""
    for name in _FACTS:
        getattr(program, name)
    copy = program.evolve(**changes)
    assert not set(_FACTS) & set(vars(copy))
    assert copy.step_model is not program.step_model
    assert copy.step_model.partner == program.step_model.partner
    assert copy.rule_versions == program.rule_versions
    assert copy.problems == program.problems == ()


def test_an_evolved_program_is_proved_only_by_its_own_validation():
    """A proved program's copy that runs a forward before its input arrives is caught when
    read, not trusted because the original was proved."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4))
    ensure_valid(program)
    assert program.problems == ()
    stage = list(program.stages[1])
    recv, forward = stage.index(RecvActivation(0)), stage.index(Forward(0))
    stage[recv], stage[forward] = stage[forward], stage[recv]
    wrong = program.evolve(stages=(program.stages[0], tuple(stage)))
    with pytest.raises(DependencyError, match="stage 1"):
        ensure_valid(wrong)
    with pytest.raises(DependencyError):
        simulate(wrong)
    assert DependencyError in {type(error) for error in schedcc.validate(wrong, collect=True)}
    assert program.problems == ()


def test_validate_with_limits_adds_to_the_kept_problems():
    """A limit the program passes without finds nothing new; one it breaks is reported, and the
    program's own problems (found once) stay as they were."""
    program = schedcc.compile(schedcc.get_schedule("gpipe")(2, 4))
    assert schedcc.validate(program, collect=True, max_activations=4) == []
    with pytest.raises(ScheduleError, match="activations"):
        schedcc.validate(program, max_activations=1)
    assert len(schedcc.validate(program, collect=True, max_activations=1)) >= 1
    assert program.problems == ()
