"""assign_versions: the weight version each compute uses and each optimizer step produces.

The weights a stage holds after n optimizer steps are version n. The forward of a microbatch of
batch b uses version `max(0, b - weight_delay)`; its backward (full, input or weight part) uses the
same version (weight stashing); the n-th `OptimizerStep` (from 0) produces version n + 1. Whether
those versions exist when needed is the validator's `check_versions` rule.
"""

from __future__ import annotations

from schedcc.program import Program

__all__ = ["assign_versions"]


def assign_versions(program: Program) -> Program:
    """The program with `versions[s][pos]` set for every compute and step."""
    schedule = program.schedule
    m, delay = schedule.num_microbatches, schedule.weight_delay
    versions = []
    for ops in program.stages:
        row: list[int | None] = []
        produced = 0
        for op in ops:
            if op.group == "compute":
                row.append(max(0, op.microbatch // m - delay))  # type: ignore[attr-defined]
            elif op.code == "Step":
                produced += 1
                row.append(produced)
            else:
                row.append(None)
        versions.append(tuple(row))
    return program.evolve(versions=tuple(versions))
