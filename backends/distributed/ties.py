"""Tied parameters on the distributed backend: which parameters a rank's segments share with
other ranks', the process groups `ReduceTied` sums over, and the checks before training.

[Note: ties across ranks] Each rank trains its own copy of a tied parameter ([Note: copies of a
tied parameter] in `backends.runtime.tied`); `ReduceTied(g)` all-reduces the copies' gradients
over a process group of the stages holding group g's segments, in the same data-parallel replica
(one group per replica, made by every rank in the same order). Ties are found by object identity
among the segments a rank is given: given all `p*v` segments (each rank built the whole model),
every rank sees every tie, refuses a program whose `tied` does not cover one, and checks that the
copies on the group's ranks start bitwise equal. Given only its own segments, a rank sees ties
among those alone; for a group that spans ranks, the program's explicit `tied` says which
segments share, and the group's ranks find which parameters by value (`ties_by_value`): a
parameter is the copy of another segment's when their shapes, dtypes and values are bitwise
equal. A constant tensor (a norm's ones, a zero bias) cannot be told apart that way and is never
taken for a tie, except with the same name in a copy of its segment in another model replica
(DualPipe's segment `L + j` is segment `j` built again); a value found twice in one segment is
refused as ambiguous. A copy found by value is its segment's own `Parameter`, so a stage holding
two such copies trains each (no private copy, which serves only a `Parameter` object held
twice). An engine given a builder is in this second case ([Note: building only what a rank
holds] in `backends.engine`). Every rank learns every problem (one
`all_gather_object` over the world), so all refuse together, before any weight changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from schedcc.backends.distributed.groups import sum_in_rank_order
from schedcc.backends.distributed.transfers import first_line
from schedcc.backends.runtime.tied import (
    Tie,
    built_ties,
    check_ties,
    fingerprint,
    joined,
    private_copies,
    ties_by_value,
)
from schedcc.errors import RankFailure, ScheduleConfigError
from schedcc.program import Program
from schedcc.semantics import Layout
from schedcc.semantics.collectives import tie_members

__all__ = ["TieGroups", "plan_ties"]


class TieGroups:
    """The process groups of this rank's tied groups (in its replica) and their all-reduce.

    Made collectively: every rank of the world constructs one, in the same order, when the
    program has tied groups.
    """

    def __init__(self, program: Program, stage: int, pp_group, *, timeout: timedelta) -> None:
        self.stage, self.tied = stage, program.tied
        self.members = tie_members(program.tied, Layout.of(program.schedule))
        self.groups: dict[int, object] = {}
        self.ranks: dict[int, list[int]] = {}
        if not program.tied:
            return
        mine = dist.get_process_group_ranks(pp_group)
        replicas: list = [None] * dist.get_world_size()
        dist.all_gather_object(replicas, mine)
        for replica in sorted({tuple(r) for r in replicas}):
            for g, stages in enumerate(self.members):
                if len(stages) < 2:
                    continue
                ranks = [replica[s] for s in stages]
                group = dist.new_group(ranks, timeout=timeout)
                if replica == tuple(mine) and stage in stages:
                    self.groups[g], self.ranks[g] = group, ranks

    def all_reduce(self, group: int, tensor: torch.Tensor) -> None:
        """Sum `tensor` over the stages of tied group `group` in place, in stage order (exact:
        two parts add the same either way; more are gathered and added in order)."""
        handle = self.groups.get(group)
        if handle is None:  # every copy is on this stage
            return
        try:
            if len(self.ranks[group]) == 2:
                dist.all_reduce(tensor, group=handle)
            else:
                sum_in_rank_order(tensor, handle, len(self.ranks[group]))
        except RuntimeError as exc:
            raise RankFailure(
                f"rank {dist.get_rank()} (stage {self.stage}) failed at ReduceTied({group}), a "
                f"collective over the tied group's ranks {self.ranks[group]}: {first_line(exc)}"
            ) from exc

    def gather(self, group: int, value: object) -> list:
        """Every member's `value` for tied group `group`, in stage order."""
        out: list = [None] * len(self.ranks[group])
        dist.all_gather_object(out, value, group=self.groups[group])
        return out


def plan_ties(
    program: Program,
    stage: int,
    given: Sequence[nn.Module],
    modules: Sequence[nn.Module],
    groups: TieGroups,
) -> tuple[list[Tie], set[tuple[int, str]]]:
    """This rank's ties and the copies it trains privately (see [Note: ties across ranks]).

    Args:
        given: the segments the engine was given (all `p*v`, or this stage's `v`).
        modules: this stage's segments, by chunk.

    Raises:
        ScheduleConfigError: a shared parameter the program does not tie (on the ranks that
            see it), or, on every rank, copies that start different, a tied group whose
            segments share nothing, or an ambiguous value.
    """
    schedule, tied = program.schedule, program.tied
    segments = [schedule.segment_of(stage, c) for c in range(len(modules))]
    complete = len(given) == schedule.num_segments
    held = dict(enumerate(given)) if complete else dict(zip(segments, modules))
    spans = [len(stages) > 1 for stages in groups.members]
    whole = [g for g in range(len(tied)) if complete or not spans[g]]
    length = schedule.num_segments // type(schedule).num_replicas  # replicas: [Note: replicas]
    mine = dict(zip(segments, modules))

    def on_this_rank() -> list[Tie]:
        if complete:
            return check_ties(held, tied, whole=whole)
        here = [g for g in whole if set(tied[g]) <= set(held)]  # held apart: also by value
        return built_ties(held, tied, here, length=length)

    if not tied:  # no collective: every rank given all segments refuses alike
        ties = on_this_rank()
        return ties, private_copies(ties, segments, mine)
    ties = _agreed(stage, on_this_rank)

    def across_ranks() -> list[Tie]:
        found_ties = list(ties)
        for g in groups.groups:
            found = _exchange(g, segments, modules, groups)
            if complete:
                _check_equal([t for t in found_ties if t.group == g], found)
            else:
                by_value = ties_by_value(g, tied[g], found, length=length)
                same = [t for t in found_ties if t.group == g]  # by identity, here
                found_ties = [t for t in found_ties if t.group != g] + joined(same + by_value)
        return sorted(found_ties, key=lambda tie: (tie.group, tie.copies))

    ties = _agreed(stage, across_ranks)
    return ties, private_copies(ties, segments, mine)


def _agreed(stage: int, work):
    """`work()`, or on every rank the first rank's `ScheduleConfigError` (one collective)."""
    result, problem = None, None
    try:
        result = work()
    except ScheduleConfigError as exc:
        problem = f"rank {dist.get_rank()} (stage {stage}): {exc}"
    problems: list = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    first = next((text for text in problems if text), None)
    if first is not None:
        raise ScheduleConfigError(first)
    return result


def _exchange(g: int, segments, modules, groups: TieGroups) -> dict[int, dict[str, tuple]]:
    """`{segment: {name: (shape, dtype, digest, constant)}}` over the segments of tied group g
    that the group's ranks hold."""
    group = set(groups.tied[g])
    mine = {
        k: {name: fingerprint(p) for name, p in module.named_parameters()}
        for k, module in zip(segments, modules)
        if k in group
    }
    found: dict[int, dict[str, tuple]] = {}
    for part in groups.gather(g, mine):
        found.update(part)
    return found


def _check_equal(ties: list[Tie], found: dict[int, dict[str, tuple]]) -> None:
    """Every copy of each tie starts with the same values on every rank."""
    for tie in ties:
        prints = {k: found[k][name] for k, name in tie.copies if k in found}
        if len({value[2] for value in prints.values()}) > 1:
            raise ScheduleConfigError(
                f"the copies of tied parameter {tie.name!r} (segments {list(tie.segments)}) "
                "start with different values on the ranks of its stages: build the model with "
                "the same seed on every rank, or load the same weights, before the Engine"
            )
