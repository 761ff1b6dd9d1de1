"""dualpipe-v on the distributed backend (2 forked processes, gloo on 127.0.0.1): its overlapped
pairs run as forward then backward on each rank, and training equals the local backend exactly,
over shared memory and over gloo point-to-point."""

from __future__ import annotations

from test_distributed import _compare, _init

from schedcc.backends.run.launch import spawn


def _worker(rank: int, world_size: int) -> int:
    _init(rank, world_size)
    _compare(rank, "dualpipe-v", 2, 2, 1, 2)
    _compare(rank, "dualpipe-v", 2, 2, 2, 2, linked=False, shared_memory=False)
    return 0


def test_dualpipe_v_on_two_ranks_equals_local():
    """Two steps of dualpipe-v (p = 2, m = 4), one batch per run and two, equal the local
    backend's losses and weights to 1e-12 on every rank."""
    assert spawn(_worker, 2, grace=60, threads=1) == 0
