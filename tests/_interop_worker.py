"""A rank of torch's `_PipelineScheduleRuntime` running a schedule that schedcc exported (CSV).

Run in a spawned process per rank by tests/schedules/test_interop.py: builds the rank's
`PipelineStage` around its float64 segment, loads the CSV in torch's "compute_comms" format and
trains with `schedule.step`, then saves the segment's parameters for the test to compare.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["run_rank"]


def run_rank(rank: int, port: int, runs: list[tuple[str, str]], num_microbatches: int) -> None:
    """For each `(csv_path, out_path)`: train that schedule as rank `rank` of 2 from fresh
    segments and save this rank's segment parameters to `out_path`."""
    from _models import batches, make_segments, mse, sgd
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=60),
    )
    try:
        for csv_path, out_path in runs:
            segment = make_segments(2)[rank]
            stage = PipelineStage(segment, rank, 2, torch.device("cpu"))
            schedule = _PipelineScheduleRuntime([stage], num_microbatches, loss_fn=mse)
            schedule._load_csv(csv_path, format="compute_comms")
            optimizer = sgd(segment.parameters())
            for inputs, targets in batches(2, 2 * num_microbatches):
                optimizer.zero_grad()
                if rank == 0:
                    schedule.step(inputs)
                else:
                    schedule.step(target=targets)
                optimizer.step()
            state = {k: v.detach().clone() for k, v in segment.state_dict().items()}
            torch.save(state, out_path)
    finally:
        dist.destroy_process_group()
