"""The weight-version rule: which weights each compute uses and which versions a stage keeps.

The weights a stage holds after n optimizer steps are version n. The forward of a microbatch of
batch b uses version `max(0, b - weight_delay)`, and its backward (full, input or weight part)
the same one (weight stashing); the n-th `OptimizerStep` (from 0) produces version n + 1. After
n steps a stage keeps versions `n - weight_delay .. n`. With a weight delay every forward runs on
a stashed copy of its version, so updates of the live weights (a step, a ZeRO gather) between a
forward and its backward leave that backward's weights alone; with none they would change them.
"""

from __future__ import annotations

from collections.abc import Sequence

from schedcc.ir import Compute, Instruction, OptimizerStep

__all__ = ["kept_versions", "peak_live_versions", "stashes", "version_used", "versions_of"]


def version_used(microbatch: int, num_microbatches: int, weight_delay: int) -> int:
    """The weight version a compute of `microbatch` uses.

    >>> version_used(5, 4, 0), version_used(5, 4, 1), version_used(1, 4, 1)
    (1, 0, 0)
    """
    return max(0, microbatch // num_microbatches - weight_delay)


def kept_versions(produced: int, weight_delay: int) -> range:
    """The versions a stage keeps after `produced` optimizer steps.

    >>> kept_versions(3, 1)
    range(2, 4)
    """
    return range(max(0, produced - weight_delay), produced + 1)


def stashes(weight_delay: int) -> bool:
    """Whether a forward runs on a stashed copy of its weights (see the module docstring)."""
    return weight_delay > 0


def versions_of(
    ops: Sequence[Instruction], num_microbatches: int, weight_delay: int
) -> tuple[int | None, ...]:
    """Per position of one stage's program: the version each compute uses or each step makes.

    >>> from schedcc.ir import parse
    >>> ops = [parse(op) for op in "F0 B0 Step F1 B1 Step".split()]
    >>> versions_of(ops, 1, 0)
    (0, 0, 1, 1, 1, 2)
    """
    row: list[int | None] = []
    produced = 0
    for op in ops:
        if isinstance(op, Compute):
            row.append(max(0, op.microbatch // num_microbatches - weight_delay))
        elif type(op) is OptimizerStep:
            produced += 1
            row.append(produced)
        else:
            row.append(None)
    return tuple(row)


def peak_live_versions(ops: Sequence[Instruction], row: Sequence[int | None]) -> int:
    """The most weight versions one stage holds at once (`Timeline.peak_versions`), from its
    program and the version of each position (`row`, as `versions_of` gives it).

    Version 0 is live from the start and version n from the n-th optimizer step; a version
    stays live while it is the newest or until its last use by a compute on the stage.

    >>> from schedcc.ir import parse
    >>> ops = [parse(op) for op in "F0 F1 Step B1 Step".split()]
    >>> peak_live_versions(ops, [0, 0, 1, 0, 2])
    2
    """
    born = {0: -1}
    last_use: dict[int, int] = {}
    for pos, op in enumerate(ops):
        version = row[pos]
        if version is None:
            continue
        if type(op) is OptimizerStep:
            born[version] = pos
        else:
            last_use[version] = pos
    deltas: dict[int, int] = {}
    for version, birth in born.items():
        newer = born.get(version + 1, len(ops))
        death = max(last_use.get(version, birth) + 1, newer)
        deltas[birth] = deltas.get(birth, 0) + 1
        deltas[death] = deltas.get(death, 0) - 1
    live = peak = 0
    for pos in sorted(deltas):
        live += deltas[pos]
        peak = max(peak, live)
    return peak
