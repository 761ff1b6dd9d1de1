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

__all__ = ["kept_versions", "stashes", "version_used", "versions_of"]


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
