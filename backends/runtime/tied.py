"""Tied parameters in the runtime: one parameter held by several segments (`head.weight =
tok.weight`), and what `ReduceTied` does to them.

[Note: copies of a tied parameter] Each segment trains its own copy of a tied parameter, as
each rank of the distributed backend must: `ReduceTied(g)` sums the gradients of every copy of
group g's parameters and gives the sum to each, so every copy takes the same step from the same
optimizer state and the copies stay bitwise equal, exactly as non-pipelined training of the tied
model steps its one parameter on the summed gradient. Where one process holds several segments
of a tie (the local backend, or a stage holding both ends as zb-v's stage 0 does), they still
share one `Parameter` object; the first segment that holds it trains the caller's object, and
every later one a private copy, swapped in by `torch.func.functional_call`. So no stage's
optimizer steps a parameter another stage's steps too (Adam would otherwise step it twice, with
two states), zeroing one stage's gradients never clears another's, and the caller's parameter
holds the trained weights. A checkpoint saves each segment's module state (the copies are equal
at a step boundary) and a load refreshes the private copies from it.

`find_ties` and `check_ties` find ties by object identity among the segments an engine is
given and refuse a program whose `tied` groups do not cover them, before anything runs;
`tied_groups` is the `tied=` that covers them (what `schedcc run` compiles with). Segments built
apart (a builder, or a rank given only its own) share no object: `ties_by_value` finds a
declared group's ties among their `fingerprint`s ([Note: ties across ranks] in
`backends.distributed.ties`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping, Sequence

import attrs
import torch
from torch import nn

from schedcc.backends.runtime.syncs import host_read
from schedcc.errors import RuntimeInstructionError, ScheduleConfigError

__all__ = [
    "ChunkParams",
    "StageTies",
    "Tie",
    "TieMeetings",
    "built_ties",
    "check_ties",
    "find_ties",
    "fingerprint",
    "private_copies",
    "stage_ties",
    "joined",
    "tied_groups",
    "ties_by_value",
]


@attrs.frozen
class Tie:
    """One parameter that segments of tied group `group` share.

    `copies` lists `(segment, its name there)` for every segment that holds it, in segment
    order; `name` is its name in the first of them (what messages say).
    """

    group: int
    copies: tuple[tuple[int, str], ...]
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def name(self) -> str:
        return self.copies[0][1]

    @property
    def segments(self) -> tuple[int, ...]:
        return tuple(k for k, _ in self.copies)


def find_ties(segments: Mapping[int, nn.Module]) -> list[tuple[nn.Parameter, tuple]]:
    """Each parameter object held by more than one of `segments` ({segment: module}), with its
    `(segment, name)` copies in segment order; in order of first appearance."""
    seen: dict[int, tuple[nn.Parameter, list[tuple[int, str]]]] = {}
    for k in sorted(segments):
        for name, param in segments[k].named_parameters():
            seen.setdefault(id(param), (param, []))[1].append((k, name))
    return [
        (param, tuple(copies)) for param, copies in seen.values() if len({k for k, _ in copies}) > 1
    ]


def check_ties(
    modules: Mapping[int, nn.Module],
    tied: Sequence[Sequence[int]],
    *,
    whole: Sequence[int] = (),
) -> list[Tie]:
    """The `Tie`s among `modules` ({segment: module}) under the program's `tied` groups.

    Args:
        modules: the segments given, by index.
        tied: `Program.tied`.
        whole: the groups whose segments were all given (for them, every segment of the group
            that holds a parameter must share one with another: a group that shares nothing is
            a mistake; a segment without parameters, such as a model replica's activation-only
            first segment, has nothing to share).

    Raises:
        ScheduleConfigError: a parameter is shared by segments that no one group holds (naming
            it, its segments and the `tied=` to compile with), or a segment of a group in
            `whole` shares nothing with the others.
    """
    found = find_ties(modules)
    group_of = {k: g for g, group in enumerate(tied) for k in group}
    ties = []
    for param, copies in found:
        segments = sorted({k for k, _ in copies})
        groups = {group_of.get(k) for k in segments}
        if len(groups) != 1 or None in groups:
            raise ScheduleConfigError(
                f"parameter {copies[0][1]!r} of segment {segments[0]} is the same Parameter "
                f"object in segments {segments}, but the program does not tie them (its tied "
                f"groups: {[tuple(g) for g in tied]}): without a ReduceTied each copy would "
                f"train on its own gradient alone. Compile with "
                f"schedcc.compile(..., tied={_suggest(found, tied)})"
            )
        (g,) = groups
        ties.append(Tie(g, tuple(copies), tuple(param.shape), param.dtype))
    for g in whole:
        shared = {k for tie in ties if tie.group == g for k in tie.segments}
        bare = {k for k in tied[g] if k in modules and not _holds_parameters(modules[k])}
        alone = [k for k in tied[g] if k not in shared and k not in bare]
        if alone:
            raise ScheduleConfigError(
                f"tied group {tuple(tied[g])}: segment(s) {alone} share no Parameter object "
                "with the others of the group; tie only segments that hold the same Parameter "
                "(a deepcopy of a segment makes new ones)"
            )
    return sorted(ties, key=lambda tie: (tie.group, tie.copies))


def _holds_parameters(module: nn.Module) -> bool:
    return next(iter(module.parameters()), None) is not None


def _suggest(found, tied) -> list[tuple[int, ...]]:
    """The tied groups that would cover `found`: the program's, merged with every sharing."""
    parent: dict[int, int] = {}

    def root(k: int) -> int:
        while parent.setdefault(k, k) != k:
            k = parent[k]
        return k

    for segments in [*(tuple(group) for group in tied), *((k for k, _ in c) for _, c in found)]:
        segments = list(segments)
        for k in segments[1:]:
            parent[root(k)] = root(segments[0])
    groups: dict[int, set[int]] = {}
    for k in parent:
        groups.setdefault(root(k), set()).add(k)
    return sorted(tuple(sorted(group)) for group in groups.values() if len(group) > 1)


def tied_groups(segments: Sequence[nn.Module]) -> list[tuple[int, ...]]:
    """The `tied=` that covers every Parameter object `segments` (a model's, in order) share:
    groups of segment indices, merged where they overlap; `[]` when nothing is shared.

    >>> from schedcc.backends.run.gpt import GPT, GPTConfig, gpt_segments
    >>> tied_groups(gpt_segments(GPT(GPTConfig(num_blocks=3)), 3))  # tok.weight is head.weight
    [(0, 2)]
    """
    return _suggest(find_ties(dict(enumerate(segments))), ())


def built_ties(
    held: Mapping[int, nn.Module],
    tied: Sequence[Sequence[int]],
    groups: Iterable[int],
    *,
    length: int | None = None,
) -> list[Tie]:
    """The ties among segments one process holds (`held`, {segment: module}) that were built
    apart: by object identity (refusing a sharing `tied` does not cover), and within each of
    `groups` (whose segments are all held) also by value, a parameter found both ways being
    one tie (`length`: as for `ties_by_value`).

    Raises:
        ScheduleConfigError: as `check_ties` (without `whole`) and `ties_by_value`.
    """
    ties = check_ties(held, tied)
    for g in groups:
        found = {k: {n: fingerprint(p) for n, p in held[k].named_parameters()} for k in tied[g]}
        mine = [t for t in ties if t.group == g] + ties_by_value(g, tied[g], found, length=length)
        ties = [t for t in ties if t.group != g] + joined(mine)
    return sorted(ties, key=lambda tie: (tie.group, tie.copies))


def joined(ties: Sequence[Tie]) -> list[Tie]:
    """`ties` (of one group) with those sharing a copy joined into one."""
    out: list[Tie] = []
    for tie in ties:
        copies = set(tie.copies)
        for other in [t for t in out if copies & set(t.copies)]:
            out.remove(other)
            copies |= set(other.copies)
        out.append(attrs.evolve(tie, copies=tuple(sorted(copies))))
    return out


def private_copies(
    ties: Sequence[Tie], held: Sequence[int], modules: Mapping[int, nn.Module] | None = None
) -> set[tuple[int, str]]:
    """The copies among segments `held` (those one process runs) that train a private copy:
    every one but the first of each tie ([Note: copies of a tied parameter]). Given the held
    `modules` ({segment: module}), only the copies that are the very `Parameter` object of an
    earlier one: a copy built apart (found by value) already is its segment's own."""
    held = set(held)
    private = set()
    for tie in ties:
        mine = [copy for copy in tie.copies if copy[0] in held]
        if modules is None:
            private.update(mine[1:])
            continue
        seen: set[int] = set()
        for k, name in mine:
            param = modules[k].get_parameter(name)
            if id(param) in seen:
                private.add((k, name))
            seen.add(id(param))
    return private


def fingerprint(param: torch.Tensor) -> tuple:
    """`(shape, dtype, digest, constant)` of a parameter's values, to find its copies by value;
    `constant`: every element is the same (a norm's ones, a zero bias)."""
    data = param.detach().cpu().contiguous()
    digest = hashlib.sha256(data.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
    constant = data.numel() == 0 or bool((data == data.view(-1)[0]).all())
    return (tuple(data.shape), str(data.dtype), digest, constant)


def ties_by_value(
    g: int,
    group: Sequence[int],
    found: Mapping[int, Mapping[str, tuple]],
    *,
    length: int | None = None,
) -> list[Tie]:
    """The ties of tied group `g` (its segments `group`) among segments built apart, found by
    value: `found` is `{segment: {name: fingerprint}}` over the group's segments.

    A parameter is a copy of another segment's when their shapes, dtypes and values are
    bitwise equal. A constant cannot be told apart that way and is taken for a tie only with
    the same name in a copy of its segment in another model replica (`length`: segments per
    replica, under DualPipe), which is the same module built again.

    Raises:
        ScheduleConfigError: a value found twice in one segment (ambiguous), or a segment of
            the group holding no parameter equal to another's.
    """
    by_key: dict[tuple, list[tuple[int, str]]] = {}
    for k in sorted(found):
        for name, (shape, dtype, digest, constant) in found[k].items():
            key: tuple = (shape, dtype, digest)
            if constant:
                if length is None:
                    continue
                key = (*key, k % length, name)
            copies = by_key.setdefault(key, [])
            if any(j == k for j, _ in copies):
                raise ScheduleConfigError(
                    f"tied group {tuple(group)}: segment {k} holds two parameters with the "
                    f"same values ({copies[-1][1]!r} and {name!r}), so segments built apart "
                    "cannot tell which one is tied: pass all p*v segments of one model"
                )
            copies.append((k, name))
    ties = [
        Tie(g, tuple(copies), key[0], getattr(torch, key[1].removeprefix("torch.")))
        for key, copies in by_key.items()
        if len(copies) > 1
    ]
    shared = {k for tie in ties for k in tie.segments}
    alone = [k for k in group if k not in shared]
    if alone:
        raise ScheduleConfigError(
            f"tied group {tuple(group)}: segment(s) {alone} hold no parameter equal to another "
            "segment's of the group; the copies of a tied parameter must start equal (build "
            "every segment with the same seed), or pass all p*v segments of one model"
        )
    return sorted(ties, key=lambda tie: tie.copies)


class ChunkParams:
    """A chunk's parameters as its stage trains them: the module's own, with private copies in
    place of the tied ones another segment trains ([Note: copies of a tied parameter])."""

    def __init__(self, module: nn.Module, private: Mapping[str, nn.Parameter]) -> None:
        self.module = module
        self.private = dict(private)
        self._named = [(n, self.private.get(n, p)) for n, p in module.named_parameters()]

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return iter(self._named)

    def parameters(self) -> Iterator[nn.Parameter]:
        return (p for _, p in self._named)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, p in self._named:
            p.grad = None

    def refresh(self) -> None:
        """Copy the module's values into the private copies (after a checkpoint is loaded)."""
        with torch.no_grad():
            for name, copy in self.private.items():
                copy.copy_(self.module.get_parameter(name))


class StageTies:
    """The tied parameters one stage holds, and its side of `ReduceTied`.

    Args:
        segments: the stage's segment of each chunk.
        modules: the stage's modules, by chunk.
        ties: every tie of the program (also those this stage holds no copy of, for the shapes
            of its part of a collective).
        private: the `(segment, name)` copies that train a private copy (`private_copies`).
        device: where a part is made for a tie this stage holds no copy of.
    """

    def __init__(
        self,
        segments: Sequence[int],
        modules: Sequence[nn.Module],
        ties: Sequence[Tie],
        private: set[tuple[int, str]],
        device: torch.device,
    ) -> None:
        chunk_of = {k: c for c, k in enumerate(segments)}
        views: list[nn.Module | ChunkParams] = list(modules)
        for c, (k, module) in enumerate(zip(segments, modules)):
            mine = {name: _copy(module.get_parameter(name)) for j, name in private if j == k}
            if mine:
                views[c] = ChunkParams(module, mine)
        #: per chunk, what its stage trains: the module, or a `ChunkParams` with private copies
        self.views = views
        #: the chunks that run on private copies (through `functional_call`)
        self.shadowed = {c for c, view in enumerate(views) if isinstance(view, ChunkParams)}
        #: per group this stage holds a segment of: per tie, (tie, this stage's copies)
        self.groups: dict[int, list[tuple[Tie, list[nn.Parameter]]]] = {}
        #: the ids of the copies here that are not a tie's first copy (a norm counts a tied
        #: parameter once: [Note: one norm, every stage alike] in `backends.runtime.clipping`)
        self.later_copies: set[int] = set()
        for tie in ties:
            copies = [(k, name) for k, name in tie.copies if k in chunk_of]
            held = [dict(views[chunk_of[k]].named_parameters())[name] for k, name in copies]
            self.groups.setdefault(tie.group, []).append((tie, held))
            self.later_copies.update(
                id(p) for copy, p in zip(copies, held) if copy != tie.copies[0]
            )
        self._device = device
        #: per group, how many copies here had a gradient at its latest `parts`, per tie
        self._counted: dict[int, list[int]] = {}

    def parts(self, group: int) -> list[torch.Tensor]:
        """This stage's part of `ReduceTied(group)`: per tie, the sum of its copies' gradients
        here, flat, and one more element counting the copies that have a gradient."""
        out, counts = [], []
        for tie, held in self.groups.get(group, ()):
            total = torch.zeros(tie.shape, dtype=tie.dtype, device=self._device)
            count = 0
            for copy in held:
                if copy.grad is not None:
                    total = total + copy.grad
                    count += 1
            out.append(torch.cat([total.reshape(-1), total.new_full((1,), count)]))
            counts.append(count)
        self._counted[group] = counts
        return out

    def apply(self, group: int, totals: Sequence[torch.Tensor]) -> None:
        """Give every copy here its tie's summed gradient (`totals`: the parts, summed over the
        group's stages); a tie no copy has a gradient of keeps none, as autograd would.

        [Note: a tie's gradient known here] Whether a tie has a gradient anywhere on its group
        is the summed count, on the device: reading it waits for the GPU ([Note: host syncs]).
        A stage whose own copy has a gradient knows the sum is not 0 without it, so only a
        stage holding no copy with a gradient reads, once for all such ties of the group: the
        tied embedding and head of a language model, each with its gradient, read nothing.
        """
        pairs = list(zip(self.groups.get(group, ()), totals))
        known = self._counted.get(group, [0] * len(pairs))
        unknown = [t[-1] for (_, t), here in zip(pairs, known) if not here]
        read = iter(host_read(torch.stack(unknown)) if unknown else [])
        for ((tie, held), total), here in zip(pairs, known):
            if not (here or next(read)):
                continue
            grad = total[:-1].view(tie.shape)
            for copy in held:
                if copy.grad is None:
                    copy.grad = grad.clone()
                else:  # in place: it may be a view of its chunk's gradient buffer
                    copy.grad.copy_(grad)

    def reduce(self, group: int, all_reduce) -> None:
        """`ReduceTied(group)` where the collective blocks: `all_reduce(group, tensor)` sums a
        tensor over the group's stages in place. The group's parts go as one flat tensor, one
        collective (a model replica ties every parameter: one collective each took most of a
        DualPipe step on gloo); a sum of parts is elementwise, so each is the sum it would be
        alone."""
        parts = self.parts(group)
        if len({(part.dtype, part.device) for part in parts}) == 1:
            flat = torch.cat(parts)
            all_reduce(group, flat)
            parts = list(flat.split([part.numel() for part in parts]))
        else:  # none, or of several dtypes: one collective each
            for part in parts:
                all_reduce(group, part)
        self.apply(group, parts)

    def refresh(self) -> None:
        """Copy loaded module values into the private copies."""
        for view in self.views:
            if isinstance(view, ChunkParams):
                view.refresh()


def stage_ties(
    ties: Sequence[Tie], segments: Sequence[int], modules: Sequence[nn.Module], private
) -> StageTies | None:
    """The `StageTies` of a stage holding `segments` (by chunk) in `modules`; None when the
    program has no ties."""
    if not ties:
        return None
    device = next((p.device for m in modules for p in m.parameters()), torch.device("cpu"))
    return StageTies(segments, modules, ties, private, device)


def _in_order(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The sum of `parts`, added in order (as the distributed backend adds them)."""
    total = parts[0].clone()
    for part in parts[1:]:
        total.add_(part)
    return total


def _copy(param: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad)


class TieMeetings:
    """Where the stages of one replica meet for `ReduceTied` on the local backend (its stages
    run in turns in one thread, so a stage posts its part and waits, like a comm group).

    Args:
        members: per tied group, the stages that hold one of its segments, in order.
    """

    def __init__(self, members: Sequence[Sequence[int]]) -> None:
        self._members = members
        self._arrivals: dict[tuple[int, int], int] = {}  # (group, stage) -> posted so far
        self._parts: dict[tuple[int, int], dict[int, list[torch.Tensor]]] = {}
        self._totals: dict[tuple[int, int], tuple[list[torch.Tensor], set[int]]] = {}

    def post(self, group: int, stage: int, parts: list[torch.Tensor]) -> None:
        """Stage `stage` reached its next `ReduceTied(group)` with `parts`."""
        n = self._arrivals.get((group, stage), 0)
        self._arrivals[group, stage] = n + 1
        self._parts.setdefault((group, n), {})[stage] = parts

    def take(self, group: int, stage: int) -> list[torch.Tensor] | None:
        """The summed parts of stage `stage`'s latest `ReduceTied(group)` once every member has
        posted (in stage order), else None."""
        n = self._arrivals.get((group, stage), 0) - 1
        if n < 0:
            raise RuntimeInstructionError(
                f"stage {stage}: ReduceTied({group}) taken before it was posted", stage=stage
            )
        members = self._members[group]
        key = (group, n)
        if key not in self._totals:
            parts = self._parts.get(key, {})
            if len(parts) < len(members):
                return None
            totals = [_in_order(column) for column in zip(*(parts[s] for s in members))]
            self._totals[key] = (totals, set())
            del self._parts[key]
        totals, taken = self._totals[key]
        taken.add(stage)
        if len(taken) == len(members):
            del self._totals[key]
        return totals
