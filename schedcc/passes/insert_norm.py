"""insert_norm: a `GradNorm` before every optimizer step, on every stage.

When the program asks for it (`Program.grad_norm`, from `compile(..., grad_norm=True)`), each
stage's n-th `OptimizerStep` gets a `GradNorm` right before it: after the batch's last weight
gradient, `ReduceGrads` and `ReduceTied` on that stage (all of which `insert_updates` puts before
the step), so the norm sees the final gradients. The comm of a later batch that insert_comm put
among them (`SG1 RA2 Reduce Step`: a receive posted early) goes after the norm when its partner
runs after the peer's own step, since that peer reaches the step only through the norm, with
what depends on it there (`with_dependents`: a forward of that batch that a tie's later step
lets run first, say). The
n-th `GradNorm`s of all stages form one collective ([Note: the norm collective] in
`schedcc.semantics.norms`); it closes no cycle when the cut "every stage up to just before its
n-th norm" is consistent, that is when nothing before one stage's norm waits for anything after
another stage's norm. That is the earliest cut
holding those steps (`earliest_cut`); a schedule where it reaches past some stage's step (a
stage must run work of the next batch before another can step) is refused.
"""

from __future__ import annotations

from schedcc.errors import ScheduleConfigError
from schedcc.ir import GradNorm, Instruction, OnMicrobatch, OptimizerStep, Update
from schedcc.program import Program
from schedcc.semantics.collectives import earliest_cut, with_dependents

__all__ = ["insert_norm"]


def insert_norm(program: Program) -> Program:
    """The program with a `GradNorm` before each step of every stage; unchanged unless
    `program.grad_norm`, or if it is forward-only or already holds a `GradNorm`.

    Raises:
        ScheduleConfigError: some stage can reach its n-th step only after another stage has
            passed its own n-th step, so no all-stage collective fits before the steps.

    >>> import schedcc
    >>> schedcc.compile(schedcc.get_schedule("gpipe")(2, 1), grad_norm=True).to_text()
    'stage 0: F0 SA0 RG0 B0 Norm Step\\nstage 1: RA0 F0 B0 SG0 Norm Step'
    """
    stages = program.stages
    present = any(type(op) is GradNorm for ops in stages for op in ops)
    if not program.grad_norm or program.forward_only or present:
        return program
    m = program.schedule.num_microbatches
    steps = [_steps(ops) for ops in stages]
    partner = program.rendezvous_model.partner
    tensors = program.tensors
    out = []
    for s, ops in enumerate(stages):
        new: list[Instruction] = []
        done = 0
        for n, step in enumerate(steps[s]):
            at = _norm_at(ops, step, n, m)
            waits = set()  # comm of later batches before the step that waits on a peer's next batch
            for pos in range(at, step):
                peer = partner[s][pos]
                if peer is not None and n < len(steps[peer[0]]) and peer[1] > steps[peer[0]][n]:
                    waits.add(pos)
            later = with_dependents(ops, at, step, waits, tensors, s) if waits else []
            new.extend(op for pos, op in enumerate(ops[done:step], done) if pos not in later)
            new.append(GradNorm())
            new.extend(ops[pos] for pos in later)
            done = step
        new.extend(ops[done:])
        out.append(tuple(new))
    normed = program.evolve(stages=tuple(out))
    # The n-th norms of all stages meet: every stage up to just before its n-th norm must be a
    # consistent cut, or one stage waits in it for what another sends only after its own.
    norms_at = [[pos for pos, op in enumerate(ops) if type(op) is GradNorm] for ops in out]
    model = normed.rendezvous_model
    prefix = [-1] * len(stages)
    for n in range(min(map(len, norms_at), default=0)):
        seeds = {s: model.units.unit_at[s][row[n]] - 1 for s, row in enumerate(norms_at)}
        earliest_cut(model.units.bounds, model.units.unit_at, model.partner, prefix, seeds)
        late = [s for s, j in seeds.items() if prefix[s] > j]
        if late:
            raise ScheduleConfigError(
                f"grad_norm: in {program.schedule.name}, stage {late[0]} must run past its "
                f"step of batch {n} before every other stage can reach its own, so no gradient "
                "norm over all stages fits before the steps; compile without grad_norm (no "
                "global clipping or non-finite skipping) or use a flush schedule"
            )
    return normed


def _steps(ops: tuple[Instruction, ...]) -> list[int]:
    return [pos for pos, op in enumerate(ops) if type(op) is OptimizerStep]


def _norm_at(ops: tuple[Instruction, ...], step: int, batch: int, m: int) -> int:
    """Where the comm of later batches just before batch `batch`'s step begins (the step itself
    when there is none); the updates between it and the step stay before the norm."""
    at = step
    while at and (
        isinstance(ops[at - 1], Update)
        or (isinstance(ops[at - 1], OnMicrobatch) and ops[at - 1].microbatch // m > batch)
    ):
        at -= 1
    return at
