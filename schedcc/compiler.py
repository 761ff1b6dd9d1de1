"""`compile`: a schedule in, a lowered and validated `Program` out."""

from __future__ import annotations

from collections.abc import Iterable

from schedcc._gc import paused_gc
from schedcc.errors import ScheduleConfigError
from schedcc.ir import Forward, RecvActivation, SendActivation
from schedcc.passes import PASSES, collect, insert_comm
from schedcc.passes.insert_offload import ByteLimit, insert_offload, offload_policy
from schedcc.passes.insert_recompute import (
    OverLimit,
    Policy,
    insert_recompute,
    recompute_policy,
)
from schedcc.program import Program
from schedcc.schedule import Schedule
from schedcc.validate import validate as _validate

__all__ = ["compile", "computes", "normalize_tied", "with_replicas"]


def compile(
    schedule: Schedule,
    *,
    data_parallel: int = 1,
    zero: int = 0,
    tied: Iterable[Iterable[int]] = (),
    forward_only: bool = False,
    recompute: bool | Iterable | Policy | OverLimit = False,
    offload: bool | float | Iterable | Policy | ByteLimit = False,
    grad_norm: bool = False,
    validate: bool = True,
    max_activations: int | None = None,
) -> Program:
    """Compile `schedule` into per-stage programs: collect, insert comm, insert updates, versions.

    Args:
        schedule: a `Schedule` instance (shape given).
        data_parallel: pipeline replicas; above 1, gradients are reduced across them.
        zero: 0, 1 (ZeRO-1: reduce-scatter, sharded step, all-gather), 2 (reduce-scatter
            after every backward) or 3 (as 2, and each chunk's parameters stay sharded between
            uses: `Unshard` before its first compute of a batch, `Reshard` after its last).
        tied: groups of segment indices whose segments share parameters (e.g. `[(0, 3)]` for an
            LM head tied to the token embedding; a negative index counts from the last segment
            of a model replica, so `[(0, -1)]` says the same at any cut); each stage holding a
            segment of group `g` gets a `ReduceTied(g)` per batch that sums the gradients of
            every copy before the step.
            A schedule with model replicas (DualPipe) ties each segment to its copies itself,
            joined with these groups (see [Note: replicas] in `schedcc.semantics.layout`).
        forward_only: keep only the schedule's forwards (and its activation comm, if it yields
            comm): the program evaluation runs, with no backward and no update, every forward on
            the live weights; compiled, validated and simulated like any other.
        recompute: which forwards keep only their inputs and are recomputed right before their
            backward (a `Recompute` placed by `schedcc.passes.insert_recompute`): False (only
            those the schedule yields itself), True (all: full activation recomputation), a
            collection of stages or of `(stage, chunk)` pairs, `policy(stage, chunk) -> bool`, or
            `OverLimit(n)` (`schedcc.passes.insert_recompute`: the stages holding over `n`).
        offload: which forwards move their saved activations to host memory after they run and
            back before their backward (an `Offload` and a `Reload` placed by
            `schedcc.passes.insert_offload`): False (only those the schedule yields itself),
            True (every forward with a compute to overlap), a fraction in (0, 1] (on each
            stage, that share, spread evenly), a collection of stages or of
            `(stage, chunk)` pairs, `policy(stage, chunk) -> bool`, or `ByteLimit(max_bytes,
            memory)` (one size or one per stage; on each stage, at each point over the limit
            the forward held there that comes back last, until its device activation bytes
            fit).
        grad_norm: put a `GradNorm` before every stage's step: one scalar all-reduce over all
            stages that gives the whole model's gradient norm, which an engine needs for
            `max_grad_norm` clipping, fp16 loss scaling, and for skipping a step whose gradients
            are not finite on every stage alike.
        validate: run the validator on the result (raises its `ScheduleError`).
        max_activations: with `validate`, also bound the microbatch activations per stage.

    Raises:
        ScheduleConfigError: bad `data_parallel`, `zero`, `recompute`, `offload` or `tied` (a
            group of fewer than two segments, a segment out of range or in two groups),
            `zero=3` with a weight delay (2BW), or `recompute` with sequence parts.
        ScheduleError: the schedule yields something invalid, or the program does not validate.

    >>> import schedcc
    >>> program = schedcc.compile(schedcc.get_schedule("gpipe")(2, 2))
    >>> print(program.to_text())
    stage 0: F0 SA0 F1 SA1 RG1 B1 RG0 B0 Step
    stage 1: RA0 F0 RA1 F1 B1 SG1 B0 SG0 Step
    """
    if not isinstance(schedule, Schedule):
        raise ScheduleConfigError(
            f"compile() needs a Schedule instance, got {schedule!r}; e.g. "
            "compile(get_schedule('1f1b')(num_stages=4, num_microbatches=8))"
        )
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
        raise ScheduleConfigError(
            f"data_parallel must be a positive integer, got {data_parallel!r}"
        )
    if type(zero) is not int or zero not in (0, 1, 2, 3):
        raise ScheduleConfigError(f"zero must be 0, 1, 2 or 3, got {zero!r}")
    if type(forward_only) is not bool:
        raise ScheduleConfigError(f"forward_only must be True or False, got {forward_only!r}")
    if type(grad_norm) is not bool:
        raise ScheduleConfigError(f"grad_norm must be True or False, got {grad_norm!r}")
    replicas = type(schedule).num_replicas
    groups = with_replicas(normalize_tied(tied, schedule.num_segments, replicas), schedule)
    policy = _recompute_policy(schedule, recompute)
    offloads = offload_policy(offload, schedule.num_stages, schedule.num_chunks)
    if zero == 3:
        _check_zero3(schedule)
    with paused_gc():
        program: Program = collect(schedule, data_parallel=data_parallel, zero=zero)
        if policy is not None and not forward_only:
            program = insert_recompute(program, policy)
        if forward_only:
            program = _forwards(program)
        else:  # a forward-only program has no gradients to tie or clip
            program = program.evolve(tied=groups, grad_norm=grad_norm)
        program = insert_comm(program)
        if offloads is not None and not forward_only:  # on the lowered program, beside its comm
            program = insert_offload(program, offloads)
        for lower in PASSES[1:]:  # after insert_comm
            program = lower(program)
        if validate:
            _validate(program, max_activations=max_activations)
    return program


def computes(
    schedule: Schedule, *, data_parallel: int = 1, zero: int = 0, recompute: bool = False
) -> Program:
    """`schedule`'s instructions as collected, its recomputations placed (all of them with
    `recompute=True`), before any lowering: no comm, update or version, and not validated.
    Its computes run in the order `compile` gives them; `schedcc.search` times them on its
    quick clock before it compiles the fastest.

    Raises:
        ScheduleConfigError: `recompute` with sequence parts, as `compile`.
        ScheduleError: the schedule yields something invalid.
    """
    policy = _recompute_policy(schedule, recompute)
    with paused_gc():
        program = collect(schedule, data_parallel=data_parallel, zero=zero)
        if policy is not None:
            program = insert_recompute(program, policy)
    return program


def _recompute_policy(schedule: Schedule, recompute) -> Policy | None:
    """`recompute=` as a policy, refused for a schedule of sequence parts."""
    policy = recompute_policy(recompute, schedule.num_stages, schedule.num_chunks)
    if policy is not None and schedule.num_parts > 1:
        raise ScheduleConfigError(
            f"{schedule!r} splits microbatches into sequence parts, whose forwards hand their "
            "carry on (see [Note: sequence parts]); compile it without recompute="
        )
    return policy


def _check_zero3(schedule: Schedule) -> None:
    """ZeRO-3 keeps one whole copy of a chunk's weights at most, for one batch at a time."""
    if schedule.weight_delay:
        raise ScheduleConfigError(
            f"zero=3 cannot run {schedule!r}: its weight delay ({schedule.weight_delay}) keeps "
            "stashed whole copies of the weights, which ZeRO-3 releases; use zero=2 or a "
            "schedule without a weight delay"
        )


def _forwards(program: Program) -> Program:
    """`program` with only its forwards and activation comm, marked forward-only."""
    keep = (Forward, SendActivation, RecvActivation)
    stages = tuple(tuple(op for op in ops if type(op) in keep) for ops in program.stages)
    return program.evolve(stages=stages, forward_only=True)


def with_replicas(
    groups: tuple[tuple[int, ...], ...], schedule: Schedule
) -> tuple[tuple[int, ...], ...]:
    """`groups` joined with the ties between each segment and its copies in the other model
    replicas (none for one replica): overlapping groups merge into one.

    >>> from schedcc.schedules.dualpipe import DualPipe
    >>> with_replicas(((0, 3),), DualPipe(2, 4))
    ((0, 1, 2, 3),)
    >>> with_replicas((), DualPipe(4, 8))
    ((0, 4), (1, 5), (2, 6), (3, 7))
    """
    replicas = type(schedule).num_replicas
    if replicas == 1:
        return groups
    length = schedule.num_segments // replicas
    parent = list(range(schedule.num_segments))

    def root(k: int) -> int:
        while parent[k] != k:
            k = parent[k]
        return k

    copies = [tuple(range(j, schedule.num_segments, length)) for j in range(length)]
    for group in (*groups, *copies):
        for k in group[1:]:
            parent[root(k)] = root(group[0])
    merged: dict[int, list[int]] = {}
    for k in range(schedule.num_segments):
        merged.setdefault(root(k), []).append(k)
    return tuple(sorted(tuple(g) for g in merged.values() if len(g) > 1))


def normalize_tied(
    tied: Iterable[Iterable[int]], num_segments: int, num_replicas: int = 1
) -> tuple[tuple[int, ...], ...]:
    """`tied` as a sorted tuple of sorted tuples of segment indices, checked; a negative index
    counts from the end of one model replica (`num_segments / num_replicas` segments), so
    `[(0, -1)]` ties the first segment to the last however the model is cut.

    Raises:
        ScheduleConfigError: `tied` is not a collection of groups of ints, a group has fewer than
            two segments, a segment is out of range, or a segment is in two groups.

    >>> normalize_tied([[3, 0], (5, 1)], 6)
    ((0, 3), (1, 5))
    >>> normalize_tied([(0, -1)], 8), normalize_tied([(0, -1)], 8, num_replicas=2)
    (((0, 7),), ((0, 3),))
    """
    length = num_segments // num_replicas
    example = f"e.g. tied=[(0, {length - 1})] (or (0, -1)) for the first and last segment"
    if isinstance(tied, (str, bytes)) or not isinstance(tied, Iterable):
        raise ScheduleConfigError(
            f"tied must be groups of segment indices, {example}; got {tied!r}"
        )
    groups = []
    owner: dict[int, tuple[int, ...]] = {}
    for group in tied:
        if isinstance(group, (str, bytes)) or not isinstance(group, Iterable):
            raise ScheduleConfigError(
                f"each group in tied must be a tuple of segment indices, {example}; got {group!r}"
            )
        members = tuple(group)
        bad = [k for k in members if type(k) is not int or not -length <= k < num_segments]
        if bad:
            raise ScheduleConfigError(
                f"tied group {members!r}: {bad[0]!r} is not a segment index in "
                f"[{-length}, {num_segments}) (the schedule has p*v = {num_segments} segments"
                + (f", {length} a model replica" if num_replicas > 1 else "")
                + "; a negative index counts from the last)"
            )
        members = tuple(sorted({k % length if k < 0 else k for k in members}))
        if len(members) < 2:
            raise ScheduleConfigError(
                f"tied group {tuple(group)!r} names fewer than two segments; a group lists the "
                f"segments that share parameters, {example}"
            )
        for k in members:
            if k in owner:
                raise ScheduleConfigError(
                    f"segment {k} is in two tied groups, {owner[k]!r} and {members!r}: merge "
                    "them into one group"
                )
            owner[k] = members
        groups.append(members)
    return tuple(sorted(groups))
