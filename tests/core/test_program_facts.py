"""A program's derived facts (`Program.tensors`, `rendezvous_model`, `rule_versions`,
`reference_walk`, `graph`, `problems`): cached properties, built once, handed to a copy only when
the fields they are read from are unchanged, and the validator's proof never."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

import schedcc
from schedcc.errors import DependencyError, ScheduleError
from schedcc.ir import Forward, RecvActivation
from schedcc.program import Program, _Derived
from schedcc.semantics import RendezvousModel
from schedcc.simulate import simulate
from schedcc.testing import schedules
from schedcc.validate import ensure_valid

#: the derived facts, read off the class (what [Note: derived facts] lists)
_FACTS = tuple(name for name, value in vars(Program).items() if isinstance(value, _Derived))

programs = st.builds(
    lambda schedule, grad_norm: schedcc.compile(schedule, grad_norm=grad_norm),
    st.sampled_from(("1f1b", "interleaved-1f1b", "zb-h1")).flatmap(
        lambda name: schedules(
            schedcc.get_schedule(name), max_stages=4, max_microbatches=6, max_chunks=2
        )
    ),
    st.booleans(),
)

#: a change of each field but `schedule` and `stages`, and one of the stages
_CHANGES = (
    {"versions": None},
    {"data_parallel": 2},
    {"zero": 1},
    {"tied": ()},
    {"forward_only": True},
    {"grad_norm": False},
    {"stages": "reversed"},
)


def _value(program: Program, name: str):
    """A fact in a form that compares by value (`Tensors` by its layout, `RendezvousModel` by its
    fields, the graph by its nodes and edges)."""
    fact = getattr(program, name)
    if name == "tensors":
        return fact.layout, fact.span
    if isinstance(fact, RendezvousModel):
        return [getattr(fact, f.name) for f in attrs.fields(RendezvousModel) if f.name != "tensors"]
    if name == "graph":
        return sorted(map(str, fact.nodes)), sorted(map(str, fact.edges))
    return fact


def test_the_facts_are_the_ones_the_note_lists():
    """Every derived fact is a `_derived` property of `Program`, named in its [Note: derived
    facts]; the graph and the validator's problems are read from every field."""
    assert set(_FACTS) == {
        "tensors",
        "rendezvous_model",
        "rule_versions",
        "reference_walk",
        "graph",
        "problems",
    }
    note = Program.__doc__.split("[Note: derived facts]", 1)[1]
    assert all(f"`{name}`" in note for name in _FACTS)
    assert vars(Program)["graph"].inputs is None
    assert vars(Program)["problems"].inputs is None


@given(programs)
def test_a_fact_is_built_once_and_shared(program):
    """Reading a fact twice gives the same object, and the rendezvous model uses the program's own
    tensor keys."""
    for name in _FACTS:
        assert getattr(program, name) is getattr(program, name)
    assert program.rendezvous_model.tensors is program.tensors


@given(programs)
def test_evolve_keeps_exactly_the_facts_of_unchanged_fields(program):
    """A copy keeps a fact when no field it is read from changed, and then the kept fact is
    the one the copy would build itself; the graph and the proof are never kept."""
    for name in _FACTS:
        getattr(program, name)
    for changes in _CHANGES:
        if changes.get("stages") == "reversed":
            changes = {"stages": program.stages[::-1]}
        copy = program.evolve(**changes)
        fresh = attrs.evolve(program, **changes)  # builds every fact itself
        for name in _FACTS:
            inputs = vars(Program)[name].inputs
            kept = inputs is not None and inputs.isdisjoint(changes)
            assert (name in vars(copy)) is kept
            if kept:
                assert getattr(copy, name) is getattr(program, name)
                assert _value(copy, name) == _value(fresh, name), (name, changes)


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
