"""The one rendezvous model (`schedcc.semantics`): what every part of schedcc reads a program
through.

Memory is counted from a microbatch's forward to its last backward piece everywhere; the
simulators refuse what the validator refuses; tensor identity, versions and the module
structure (no import cycle, the simulator imports no compiler pass) are checked here.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
from _orders import OrderSchedule, random_orders
from hypothesis import given

import schedcc
from schedcc import (
    BackwardInput,
    BackwardWeight,
    DeadlockError,
    Forward,
    MemoryBoundError,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
    simulate,
    validate,
)
from schedcc.ir import RECEIVES, SENDS, Comm, Compute, parse
from schedcc.semantics import Tensors, match_comm, version_used

ROOT = Path(__file__).resolve().parents[2]


def _zb_h1_order(text: str, p: int = 2, m: int = 4) -> OrderSchedule:
    order = [parse(word) for word in text.split()]
    return OrderSchedule(p, m, orders=[order] * p)


def test_memory_holds_a_microbatch_until_its_weight_gradient():
    """zb-h1's shape p=2 m=4 running `F I` four times, then the four `W`, holds 4 microbatches
    (the runtime keeps each graph until W): refused at max_activations=1 (it was accepted when
    I freed it); the alternating order holds 1."""
    late = _zb_h1_order("F0 I0 F1 I1 F2 I2 F3 I3 W0 W1 W2 W3")
    with pytest.raises(MemoryBoundError, match=r"\(F1\) makes stage 0 hold 2 microbatch"):
        schedcc.compile(late, max_activations=1)
    program = schedcc.compile(late)
    assert simulate(program).peak_activations == (4, 4)
    alternating = _zb_h1_order("F0 I0 W0 F1 I1 W1 F2 I2 W2 F3 I3 W3")
    program = schedcc.compile(alternating, max_activations=1)
    assert simulate(program).peak_activations == (1, 1)


def test_memory_count_is_the_same_in_validator_and_simulator():
    """For every built-in, the simulator's peak is the smallest bound the validator accepts."""
    for name, v in (("1f1b", 1), ("zb-h1", 1), ("zb-v", 2), ("interleaved-1f1b", 2)):
        program = schedcc.compile(schedcc.get_schedule(name)(4, 8, v))
        peak = max(simulate(program).peak_activations)
        validate(program, max_activations=peak)
        with pytest.raises(MemoryBoundError):
            validate(program, max_activations=peak - 1)


class Hangs(schedcc.Schedule):
    """README's deadlocking example: stage 0 waits for a gradient before it sends the
    activation that produces it."""

    name = "hangs"

    def order(self, stage):
        if stage == 0:
            return [Forward(0), RecvGrad(0), schedcc.Backward(0), SendActivation(0)]
        return [RecvActivation(0), Forward(0), schedcc.Backward(0), SendGrad(0)]


@pytest.mark.parametrize("eager", [False, True])
def test_simulators_refuse_what_the_validator_refuses(eager):
    """A program compiled with validate=False that does not validate is refused by both
    simulators with the validator's own error (the eager one used to time it at 6)."""
    program = schedcc.compile(Hangs(2, 1), validate=False)
    with pytest.raises(DeadlockError, match="stage 0 waits at RG0"):
        simulate(program, eager=eager)


def test_simulate_validates_once(monkeypatch):
    """simulate validates a program it has not seen proved, once; a program compile proved (or
    a second simulate) is not validated again, and a copy is validated anew."""
    module = importlib.import_module("schedcc.validate")
    calls = []
    real = module.find_problems

    def counted(program):
        calls.append(real(program))
        return calls[-1]

    monkeypatch.setattr(module, "find_problems", counted)
    schedule = schedcc.get_schedule("1f1b")(4, 8)
    unproved = schedcc.compile(schedule, validate=False)
    simulate(unproved)
    simulate(unproved, eager=True)
    assert calls == [()]
    proved = schedcc.compile(schedule)
    simulate(proved)
    assert calls == [(), ()]
    simulate(unproved.evolve())
    assert calls == [(), (), ()]


@given(random_orders(max_stages=4, max_microbatches=4, max_chunks=2))
def test_receives_carry_exactly_the_remote_needs(schedule):
    """In a compiled program, the tensors a stage receives are exactly the ones its computes
    need from other stages, and every send carries a tensor a compute on its stage made."""
    program = schedcc.compile(schedule)
    tensors = Tensors.of(schedule)
    partner, problems = match_comm(program.stages, tensors)
    assert not problems
    for s, ops in enumerate(program.stages):
        table = tensors.compute_table(s)
        remote, made = set(), set()
        for op in ops:
            if isinstance(op, Compute):
                base = op.microbatch * tensors.span
                remote.update(base + o for o in table[type(op), op.chunk].remote)
                made.add(tensors.makes(s, op))
        received = {tensors.route(s, op).tensor for op in ops if isinstance(op, RECEIVES)}
        sent = {tensors.route(s, op).tensor for op in ops if isinstance(op, SENDS)}
        assert received == remote
        assert sent <= made
        for pos, op in enumerate(ops):
            if isinstance(op, Comm):
                peer, peer_pos = partner[s][pos]
                other = program.stages[peer][peer_pos]
                assert tensors.route(s, op) == tensors.route(peer, other)


@given(random_orders(weight_delay=1, max_stages=3, max_microbatches=3, max_chunks=2))
def test_assigned_versions_follow_the_one_rule(schedule):
    """assign_versions' versions are `version_used`, the rule the validator checks."""
    program = schedcc.compile(schedule)
    m, delay = schedule.num_microbatches, schedule.weight_delay
    for ops, row in zip(program.stages, program.versions):
        for op, version in zip(ops, row):
            if isinstance(op, Compute):
                assert version == version_used(op.microbatch, m, delay)


def test_split_backward_needs_and_makes():
    """I makes the gradient W needs; on a one-stage pipeline nothing is remote."""
    tensors = Tensors.of(schedcc.get_schedule("zb-h1")(1, 2))
    assert tensors.makes(0, BackwardInput(1)) in tensors.needs(0, BackwardWeight(1))
    assert tensors.makes(0, BackwardWeight(1)) is None
    assert tensors.compute_table(0)[Forward, 0].remote == ()


def _runtime_imports(path: Path) -> set[str]:
    """The schedcc modules `path` imports when it runs (not under TYPE_CHECKING, not lazily)."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {name for name in names if name.startswith("schedcc")}


def test_semantics_imports_no_program_and_simulate_no_pass():
    """The rendezvous model imports neither `Program` nor a compiler pass (no program -> passes ->
    semantics -> program cycle), and the simulator imports no compiler pass."""
    for path in (ROOT / "schedcc" / "semantics").glob("*.py"):
        imports = _runtime_imports(path)
        assert "schedcc.program" not in imports, path
        assert not any(name.startswith("schedcc.passes") for name in imports), path
    for name in ("simulate.py", "simulate_eager.py", "program.py"):
        imports = _runtime_imports(ROOT / "schedcc" / name)
        assert not any(i.startswith("schedcc.passes") for i in imports), name


def test_the_reference_walk_is_the_default_simulation():
    """The deadlock rule's walk is timed with `UNIT_COSTS`, `CostModel()`'s durations, so the
    default simulation reuses it and equals one timed from scratch."""
    from schedcc.costs import ALL_KINDS, kind_cost
    from schedcc.semantics import UNIT_COSTS

    assert all(kind_cost(schedcc.CostModel(), cls) == UNIT_COSTS.get(cls, 0.0) for cls in ALL_KINDS)
    for name, v in (("1f1b", 1), ("interleaved-1f1b", 2), ("zb-v", 2)):
        program = schedcc.compile(schedcc.get_schedule(name)(4, 8, v), data_parallel=2)
        reused = simulate(program)
        timed = simulate(program, schedcc.CostModel(per_stage={0: schedcc.CostModel()}))
        assert reused.events == timed.events
        assert reused.critical_path == timed.critical_path


def test_evolve_keeps_what_depends_on_the_stages_only():
    """A copy with other versions keeps the rendezvous model; one with other stages does not, nor
    does any copy keep the validator's proof."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 2))
    model = program.rendezvous_model
    assert program.evolve(versions=None).rendezvous_model is model
    moved = program.evolve(stages=program.stages[::-1])
    assert "rendezvous_model" not in vars(moved)
    assert program.problems == ()
    assert "problems" not in vars(program.evolve(versions=None))
