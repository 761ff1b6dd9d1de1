"""assign_versions: the weight version each compute uses and each optimizer step produces.

The rule itself lives in `schedcc.semantics.versions` (the validator and the runtime read the
same one; `Program.rule_versions` keeps its result with the program, for the validator);
whether those versions exist when needed is the validator's `check_versions` rule.
"""

from __future__ import annotations

from schedcc.program import Program

__all__ = ["assign_versions"]


def assign_versions(program: Program) -> Program:
    """The program with `versions[s][pos]` set for every compute and step.

    >>> import schedcc
    >>> program = schedcc.compile(schedcc.get_schedule("gpipe")(2, 1, num_batches=2))
    >>> program.stages[0][-1], program.versions[0][-1]
    (OptimizerStep(), 2)
    """
    return program.evolve(versions=program.rule_versions)
