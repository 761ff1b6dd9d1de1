"""What one rank of `schedcc run` does: set up torch.distributed, train, report on rank 0.

`main(rank, world_size, config)` is called by `backends.run.launch.spawn` in each local process, or
directly under torchrun. Rank 0 shows the progress bar, gathers every rank's measured instruction
times, and prints the summary (and, with `--check`, compares against non-pipelined training).
"""

from __future__ import annotations

import copy
import os
import time
from datetime import timedelta

import torch
import torch._dynamo  # torch.optim imports it (seconds): import once, before forking ranks
import torch.distributed as dist

from schedcc.backends.distributed.engine import Engine
from schedcc.backends.distributed.transfers import first_line
from schedcc.backends.run import models
from schedcc.backends.run.launch import keep_freed_memory
from schedcc.backends.tensor_parallel import ParallelBlock, ParallelMLP, shard_layers
from schedcc.compiler import compile
from schedcc.errors import RankFailure, ScheduleConfigError
from schedcc.program import Program
from schedcc.registry import get_schedule

__all__ = ["CHECK_TOLERANCE", "check_devices", "main"]

#: Largest parameter difference `--check` accepts (float64).
CHECK_TOLERANCE = 1e-9


def check_devices(num_local_ranks: int) -> None:
    """Raise `UserError` when CUDA is there but has fewer GPUs than local ranks (one each)."""
    from schedcc.errors import UserError

    if torch.cuda.is_available() and torch.cuda.device_count() < num_local_ranks:
        raise UserError(
            f"{num_local_ranks} local ranks need one GPU each but {torch.cuda.device_count()} "
            "are visible: lower p * dp, or run on the CPU with CUDA_VISIBLE_DEVICES="
        )


#: `--precision` to the engine's `mixed_precision`.
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def main(rank: int, world_size: int, config) -> int:
    """Train as `rank` of `world_size`; returns the exit code (0, or 1 for a failed check)."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
    keep_freed_memory()  # see [Note: keeping freed memory]
    if torch.cuda.is_available():
        backend, device = "nccl", torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        backend, device = "gloo", torch.device("cpu")
    try:
        # NCCL is told its device, so it never guesses one from the global rank.
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=config.timeout),
            device_id=device if device.type == "cuda" else None,
        )
        code = _train(rank, config, device)
    except dist.DistError as exc:  # e.g. a peer exited while process groups were being made
        raise RankFailure(f"rank {rank} lost contact with a peer rank: {first_line(exc)}") from None
    dist.destroy_process_group()
    return code


def _train(rank: int, config, device: torch.device) -> int:
    if config.check:
        torch.set_default_dtype(torch.float64)
    schedule = get_schedule(config.schedule)(
        config.num_stages, config.num_microbatches, config.num_chunks, config.num_batches
    )
    program = compile(
        schedule,
        data_parallel=config.data_parallel,
        zero=config.zero,
        grad_norm=config.grad_norm,
        recompute=config.recompute,
    )
    replicas = type(schedule).num_replicas  # DualPipe: each replica holds the same modules
    built = models.build(config.model, schedule.num_segments // replicas, seed=config.seed)
    built.segments = built.segments * replicas
    initial = copy.deepcopy(built.segments) if config.check and rank == 0 else None
    lr = config.lr

    def optimizer(params):
        return torch.optim.Adam(params, lr=lr)

    segments = [segment.to(device) for segment in built.segments]
    mesh = None
    if config.tp > 1:  # see [Note: the user's tensor parallelism]
        from torch.distributed.device_mesh import init_device_mesh

        shape = (config.data_parallel, config.num_stages, config.tp)
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=("dp", "pp", "tp"))
        segments = [shard_layers(segment, mesh.get_group("tp")) for segment in segments]
        split = (ParallelMLP, ParallelBlock)
        if not any(isinstance(m, split) for seg in segments for m in seg.modules()):
            raise ScheduleConfigError(
                f"--tp {config.tp}: model {config.model} has no attention block or "
                "Linear-activation-Linear run to split over tensor-parallel ranks"
            )
    engine = Engine(
        program,
        segments,
        built.loss_fn,
        optimizer,
        mesh=mesh,
        timeout=config.timeout,
        p2p=config.p2p,
        max_grad_norm=config.max_grad_norm,
        mixed_precision=PRECISIONS[config.precision],
    )
    dp_index = dist.get_rank(engine.dp_group)
    if config.resume:
        _resume(engine, config, rank)
    if engine.steps >= config.steps:
        if rank == 0:
            print(f"the checkpoint is at step {engine.steps}: nothing left to train", flush=True)
        return 0
    losses = _loop(engine, built, config, dp_index, show=rank == 0 and config.progress)
    state = None
    if config.check:
        with engine.unsharded():  # ZeRO-3: every replica gathers, the first one reports
            state = _state(engine, schedule) if dp_index == 0 else None
    mine = {
        "stage": engine.stage,
        "dp": dp_index,
        "times": engine.step_times,
        "peak": engine.runtime.peak_activation_bytes,
        "p2p": engine.point_to_point,
        "skipped": engine.skipped_steps,
        "norm": engine.last_grad_norm,
        "metrics": dict(engine.last_metrics),
        "state": state,
        "tp": engine.tp_rank or 0,
    }
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    try:
        dist.gather_object(mine, gathered, dst=0)
    except RuntimeError as exc:  # a peer died after training (see [Note: failures])
        raise RankFailure(
            f"rank {rank} (stage {engine.stage}) failed at gathering the measured times to "
            f"rank 0, a collective over every rank: {first_line(exc)}"
        ) from exc
    if rank != 0:
        return 0
    from schedcc.backends.run.report import check_line, summarize

    summarize(program, config, built, losses, [g for g in gathered if g["tp"] == 0])
    if not config.check:
        return 0
    worst = _check(program, config, built, initial, gathered)
    print(check_line(worst, CHECK_TOLERANCE), flush=True)
    return 0 if worst <= CHECK_TOLERANCE else 1


def _global_batches(built, config, start: int = 0):
    local = config.num_microbatches * config.microbatch_size
    for step in range(start, config.steps):
        yield built.data.batch(local * config.data_parallel, step)


def _resume(engine: Engine, config, rank: int) -> None:
    """Load the newest complete checkpoint under `--checkpoint`, if there is one."""
    from schedcc.backends.checkpoint.files import latest_checkpoint

    path = latest_checkpoint(config.checkpoint)
    if path is None:
        if rank == 0:
            print(f"no complete checkpoint in {config.checkpoint}: starting at step 0", flush=True)
        return
    engine.load(path)
    if rank == 0:
        print(f"resumed from {path} (step {engine.steps})", flush=True)


def _loop(engine: Engine, built, config, dp_index: int, *, show: bool) -> list[float]:
    from schedcc.backends.checkpoint.files import step_dir
    from schedcc.backends.run.report import Progress

    dp = config.data_parallel
    batches = _global_batches(built, config, engine.steps)
    local = ((x.chunk(dp)[dp_index], y.chunk(dp)[dp_index]) for x, y in batches)
    losses: list[float] = []
    with Progress(config.steps, enabled=show, completed=engine.steps) as progress:
        last = time.perf_counter()
        for loss in engine.train(local):
            now = time.perf_counter()
            losses.append(loss)
            progress.advance(loss, now - last, skipped=engine.skipped_steps)
            if config.checkpoint and config.every and engine.steps % config.every == 0:
                engine.save(step_dir(config.checkpoint, engine.steps))
            last = time.perf_counter()
    return losses


def _state(engine: Engine, schedule) -> dict[int, dict[str, torch.Tensor]]:
    return {
        schedule.segment_of(engine.stage, c): {
            name: tensor.detach().cpu() for name, tensor in module.state_dict().items()
        }
        for c, module in enumerate(engine.modules)
    }


def _check(program: Program, config, built, initial, gathered) -> float:
    from schedcc.backends.reference import train_reference

    lr = config.lr
    train_reference(
        initial[: len(initial) // type(program.schedule).num_replicas],  # one model replica
        built.loss_fn,
        lambda params: torch.optim.Adam(params, lr=lr),
        _global_batches(built, config),
        weight_delay=program.schedule.weight_delay,
        batches_per_run=program.schedule.num_batches,
        max_grad_norm=config.max_grad_norm,
        skip_nonfinite=config.grad_norm,
    )
    pipelined: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for payload in gathered:
        for k, state in (payload["state"] or {}).items():
            pipelined[k, payload["tp"]] = state
    worst = 0.0
    for k, module in enumerate(initial):
        for t in range(config.tp):
            if config.tp > 1:  # the same shard of the non-pipelined, dense result
                module = shard_layers(initial[k], None, rank=t, size=config.tp)
            for name, expected in module.state_dict().items():
                got = pipelined[k, t][name]
                worst = max(worst, float((got - expected.cpu()).abs().max()))
    return worst
