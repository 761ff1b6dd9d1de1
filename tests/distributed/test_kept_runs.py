"""The distributed engine keeps the times of its last `KEPT_RUNS` runs only: a long training
holds no more of them, and knows how many it timed."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _ranks import init

import schedcc
from schedcc.backends.distributed import engine as engine_module
from schedcc.backends.distributed.engine import Engine
from schedcc.backends.run import models
from schedcc.backends.run.launch import spawn


def _kept_worker(rank: int, world_size: int) -> int:
    init(rank, world_size)
    engine_module.KEPT_RUNS = 3  # this rank's process only
    program = schedcc.compile(schedcc.get_schedule("1f1b")(world_size, 2))
    segments = models.mlp_segments(world_size, width=4, seed=0)
    engine = Engine(program, segments, F.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.1))
    data = models.TeacherData(width=4, seed=1)
    for step in range(5):
        engine.train_step(*data.batch(4, step))
    assert engine.runs_timed == 5
    assert len(engine.unit_times) == len(engine.segment_times) == 3
    events = engine.trace_events(own=True)
    assert [op for _, op, *_ in events] == list(program.stages[engine.stage])
    assert all(own > 0 for _, op, _, _, own in events if op.group == "compute")
    return 0


def test_the_engine_keeps_the_last_runs_times():
    """Five steps with three runs kept: the last three, and a count of five. (In ranks of their
    own: an engine made in the test's process holds its process groups in a reference cycle,
    and a rank a later test forks from it would free them, their threads not copied, and hang.)"""
    assert spawn(_kept_worker, 2, grace=30, threads=1) == 0
