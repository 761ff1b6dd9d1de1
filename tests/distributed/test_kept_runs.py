"""The distributed engine keeps the times of its last `KEPT_RUNS` runs only: a long training
holds no more of them, and knows how many it timed."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import schedcc
from schedcc.backends.distributed import engine as engine_module
from schedcc.backends.distributed.engine import Engine
from schedcc.backends.run import models


def test_the_engine_keeps_the_last_runs_times(monkeypatch):
    monkeypatch.setattr(engine_module, "KEPT_RUNS", 3)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        program = schedcc.compile(schedcc.get_schedule("1f1b")(1, 2))
        segments = models.mlp_segments(1, width=4, seed=0)
        engine = Engine(program, segments, F.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.1))
        data = models.TeacherData(width=4, seed=1)
        for step in range(5):
            engine.train_step(*data.batch(4, step))
        assert engine.runs_timed == 5
        assert len(engine.unit_times) == len(engine.segment_times) == 3
        events = engine.trace_events(own=True)
        assert [str(op) for _, op, *_ in events] == [str(op) for op in program.stages[0]]
        assert all(own > 0 for _, op, _, _, own in events if op.group == "compute")
    finally:
        dist.destroy_process_group()
