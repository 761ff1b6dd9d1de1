"""Channels: every send paired with its receive, FIFO per ordered pair of stages.

The n-th send from stage s to stage t meets the n-th receive on t from s, and the two must carry
the same tensor (docs/design.md, "Semantics: the rendezvous model").
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from schedcc.ir import COMM, Instruction
from schedcc.semantics.tensors import Tensors

__all__ = ["CommProblem", "Partner", "match_comm"]

#: `partner[s][pos]`: the `(stage, position)` of the op matched with comm op `pos` of stage `s`.
Partner = list[list[tuple[int, int] | None]]

_COMM = frozenset(COMM)


@attrs.frozen(slots=True)
class CommProblem:
    """One reason the sends and receives do not pair up; `kind` names it."""

    kind: str  # "nowhere", "unmatched", "order", "duplicate"
    stage: int
    position: int
    peer: int | None = None
    peer_position: int | None = None


def match_comm(
    stages: Sequence[Sequence[Instruction]], tensors: Tensors
) -> tuple[Partner, list[CommProblem]]:
    """Pair every send with its receive, FIFO per (src, dst) channel; linear.

    Returns `(partner, problems)`: `partner[s][pos]` is the `(stage, position)` of the matched
    op (None for non-comm or unmatched ops), and a list of `CommProblem`.

    >>> import schedcc
    >>> program = schedcc.compile(schedcc.get_schedule("gpipe")(2, 1))
    >>> program.to_text()
    'stage 0: F0 SA0 RG0 B0 Step\\nstage 1: RA0 F0 B0 SG0 Step'
    >>> partner, problems = match_comm(program.stages, program.tensors)
    >>> partner[0][1], problems
    ((1, 0), [])
    """
    partner: Partner = [[None] * len(ops) for ops in stages]
    # A channel (src, dst) holds its ops in program order as (tensor key, position).
    sends: dict[tuple[int, int], list[tuple[int, int]]] = {}
    recvs: dict[tuple[int, int], list[tuple[int, int]]] = {}
    problems: list[CommProblem] = []
    span = tensors.span
    for s, ops in enumerate(stages):
        # (class, chunk) -> (the queue of its channel and direction, the tensor's offset)
        queues = {
            kind: ((sends if kind[0].is_send else recvs).setdefault((src, dst), []), carries)
            for kind, (src, dst, carries) in tensors.comm_table(s).items()
        }
        for pos, op in enumerate(ops):
            if type(op) not in _COMM:
                continue
            found = queues.get((type(op), op.chunk))
            if found is None:
                problems.append(CommProblem("nowhere", s, pos))
                continue
            found[0].append((op.microbatch * span + found[1], pos))
    seen: set[int] = set()
    for channel in sorted(sends.keys() | recvs.keys()):
        src, dst = channel
        out, into = sends.get(channel, []), recvs.get(channel, [])
        for (key, pos), (want, recv_pos) in zip(out, into):
            if key != want or key in seen:
                problems.append(_mismatch(channel, out, into, seen, key, pos, want, recv_pos))
                break
            seen.add(key)
            partner[src][pos] = (dst, recv_pos)
            partner[dst][recv_pos] = (src, pos)
        else:
            for _, pos in out[len(into) :]:
                problems.append(CommProblem("unmatched", src, pos, dst))
            for _, pos in into[len(out) :]:
                problems.append(CommProblem("unmatched", dst, pos, src))
    return partner, problems


def _mismatch(channel, out, into, seen, key, pos: int, want, recv_pos: int) -> CommProblem:
    """Why the FIFO pairing of a channel fails at a send and a receive: the most specific cause.

    A repeated tensor is a duplicate; a tensor the other side never mentions is unmatched; else
    both sides move the same tensors in different orders.
    """
    src, dst = channel
    if key in seen:
        return CommProblem("duplicate", src, pos, dst, recv_pos)
    if want in seen:
        return CommProblem("duplicate", dst, recv_pos, src, pos)
    if key not in {k for k, _ in into}:
        return CommProblem("unmatched", src, pos, dst)
    if want not in {k for k, _ in out}:
        return CommProblem("unmatched", dst, recv_pos, src)
    return CommProblem("order", src, pos, dst, recv_pos)
