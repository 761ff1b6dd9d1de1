"""insert_recompute: a `Recompute` right before each chosen forward's backward (full recompute).

`compile(schedule, recompute=True)` is what DeepSpeed's and Megatron's full activation
checkpointing do: every forward keeps only its input, and its graph is rebuilt right before its
backward. Here that is a pass over the schedule's compute order: on each chosen `(stage, chunk)`,
an `R i.c` goes right before the first backward piece of `i` on that chunk (`B`, or `I` when the
backward is split), unless the schedule already placed its own or offloads that forward. It
runs before comm insertion, so a receive of the output gradient lands after the `R` and the
recompute overlaps the wait.

A policy says where to recompute: `True` (everywhere), a collection of stages (`{0, 1}`) or of
`(stage, chunk)` pairs (`{(0, 0), (1, 1)}`), a callable `policy(stage, chunk) -> bool`, or
`OverLimit(max_activations)`: only the stages that would hold more microbatch activations than
that without recomputation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import attrs

from schedcc.errors import ScheduleConfigError, call_user, name_of
from schedcc.ir import (
    Backward,
    BackwardInput,
    Instruction,
    Offload,
    OverlappedBackward,
    Recompute,
)
from schedcc.program import Program
from schedcc.semantics import peak_activations

__all__ = ["OverLimit", "Policy", "ask", "chosen_policy", "insert_recompute", "recompute_policy"]

#: `policy(stage, chunk)`: whether that chunk's forwards keep only their inputs.
Policy = Callable[[int, int], bool]

_FIRST_BACKWARD = (Backward, BackwardInput)


@attrs.frozen
class OverLimit:
    """Recompute every forward of the stages whose compute order, as the schedule yields it,
    holds more than `max_activations` microbatch activations at once (full recomputation holds
    one); the others keep theirs.

    >>> import schedcc
    >>> program = schedcc.compile(schedcc.get_schedule("1f1b")(4, 8), recompute=OverLimit(2))
    >>> schedcc.simulate(program).peak_activations
    (1, 1, 2, 1)
    """

    max_activations: int = attrs.field()

    @max_activations.validator
    def _positive(self, attribute, value) -> None:
        if type(value) is not int or value < 1:
            raise ScheduleConfigError(
                f"OverLimit(max_activations) must be a positive integer, got {value!r}"
            )

    def for_program(self, program: Program) -> Policy:
        """The stages of `program` over the limit, as a `Policy`."""
        limit = self.max_activations
        over = {s for s, ops in enumerate(program.stages) if peak_activations(ops) > limit}
        return lambda stage, chunk: stage in over


def recompute_policy(recompute: object, num_stages: int, num_chunks: int) -> Policy | None:
    """`recompute` (what `compile` takes) as a `Policy`, or None for no recomputation.

    Raises:
        ScheduleConfigError: not a bool, a callable, or a collection of stages or
            `(stage, chunk)` pairs in range.

    >>> policy = recompute_policy({(1, 0)}, 2, 1)
    >>> policy(0, 0), policy(1, 0)
    (False, True)
    """
    if recompute is None or recompute is False:
        return None
    if recompute is True:
        return lambda stage, chunk: True
    if isinstance(recompute, OverLimit):
        return recompute  # type: ignore[return-value]  # resolved by insert_recompute
    if callable(recompute):
        return recompute  # type: ignore[return-value]
    example = "e.g. recompute=True, recompute={0, 1} (stages) or recompute={(0, 1)} (stage, chunk)"
    if isinstance(recompute, (str, bytes)) or not isinstance(recompute, Iterable):
        raise ScheduleConfigError(
            f"recompute must be True/False, a set of stages or of (stage, chunk) pairs, or a "
            f"callable policy(stage, chunk) -> bool, {example}; got {recompute!r}"
        )
    return chosen_policy(recompute, num_stages, num_chunks, what="recompute", example=example)


def chosen_policy(
    items: Iterable, num_stages: int, num_chunks: int, *, what: str, example: str
) -> Policy:
    """The policy that picks the stages and `(stage, chunk)` pairs in `items` (what `compile`'s
    `recompute=` and `offload=` take as a collection).

    Raises:
        ScheduleConfigError: an item is neither a stage nor a pair in range (`what` names the
            argument, `example` shows good ones).

    >>> chosen_policy([0, (1, 1)], 2, 2, what="recompute", example="")(0, 1)
    True
    """
    chosen: set[tuple[int, int]] = set()
    for item in items:
        if type(item) is int and 0 <= item < num_stages:
            chosen.update((item, c) for c in range(num_chunks))
        elif (
            isinstance(item, tuple)
            and len(item) == 2
            and all(type(x) is int for x in item)
            and 0 <= item[0] < num_stages
            and 0 <= item[1] < num_chunks
        ):
            chosen.add(item)
        else:
            raise ScheduleConfigError(
                f"{what}: {item!r} is neither a stage in [0, {num_stages}) nor a (stage, "
                f"chunk) pair with chunk in [0, {num_chunks}); {example}"
            )
    return lambda stage, chunk: (stage, chunk) in chosen


def ask(policy: Policy, stage: int, chunk: int, *, what: str) -> bool:
    """`policy(stage, chunk)` through the user-code guard, checked to be a bool (`what`: the
    policy's argument, "recompute" or "offload")."""
    function = f"the {what} policy {name_of(policy)}({stage}, {chunk})"
    answer = call_user(function, lambda: policy(stage, chunk))
    if not isinstance(answer, bool):
        raise ScheduleConfigError(
            f"the {what} policy must return True or False, got {answer!r} for "
            f"(stage {stage}, chunk {chunk})"
        )
    return answer


def insert_recompute(program: Program, policy: Policy | OverLimit) -> Program:
    """`program` with an `R` before the first backward piece of every forward `policy` picks.

    >>> import schedcc
    >>> from schedcc.passes.collect import collect
    >>> program = collect(schedcc.get_schedule("gpipe")(1, 2))
    >>> " ".join(map(str, insert_recompute(program, lambda s, c: True).stages[0]))
    'F0 F1 R1 B1 R0 B0'
    """
    if isinstance(policy, OverLimit):
        policy = policy.for_program(program)
    stages = []
    for s, ops in enumerate(program.stages):
        wanted: dict[int, bool] = {}
        # a forward the schedule offloads itself is not recomputed too ([Note: offloading])
        placed = {(op.microbatch, op.chunk) for op in ops if type(op) in (Recompute, Offload)}
        row: list[Instruction] = []
        for op in ops:
            if isinstance(op, _FIRST_BACKWARD) and (op.microbatch, op.chunk) not in placed:
                chunk = op.chunk
                if chunk not in wanted:
                    wanted[chunk] = ask(policy, s, chunk, what="recompute")
                if wanted[chunk]:
                    # an overlapped pair `F +B` stays together: its `R` goes before the `F`
                    at = len(row) - 1 if type(op) is OverlappedBackward else len(row)
                    row.insert(at, Recompute(op.microbatch, chunk))
                    placed.add((op.microbatch, chunk))
            row.append(op)
        stages.append(tuple(row))
    return program.evolve(stages=tuple(stages))
