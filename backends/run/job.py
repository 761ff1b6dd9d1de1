"""What one rank of `schedcc run` does: set up torch.distributed, train, report on rank 0.

`main(rank, world_size, config)` is called by `backends.run.launch.spawn` in each local process, or
directly under torchrun. Each rank finds its stage in the mesh (`--rank-order`), builds only that
stage's segments (`--model`'s factory given `segments=`, or the whole model with the rest dropped
for a factory that builds all; see `backends.run.models`), puts them alone on its device,
compiles the program with the ties the command found in the whole model (`config.tied`; their
copies on other ranks are found by value), and trains its own stage. Rank 0 shows the
progress bar, gathers every rank's measured instruction times, and prints the summary (and, with
`--check`, compares against non-pipelined training).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import os
import time
from datetime import timedelta

import torch
import torch._dynamo  # torch.optim imports it (seconds): import once, before forking ranks
import torch.distributed as dist

from schedcc.backends.batches import local_batches
from schedcc.backends.distributed.engine import Engine
from schedcc.backends.distributed.groups import bound_waits, default_mesh
from schedcc.backends.distributed.transfers import first_line
from schedcc.backends.run import models
from schedcc.backends.run.launch import keep_freed_memory
from schedcc.backends.run.models import RunModel
from schedcc.backends.runtime.syncs import WATCHDOG_GRACE_S
from schedcc.backends.tensor_parallel import (
    ParallelBlock,
    ParallelGPTBlock,
    ParallelMLP,
    shard_layers,
)
from schedcc.compiler import compile
from schedcc.errors import RankFailure, ScheduleConfigError, call_user
from schedcc.program import Program
from schedcc.registry import get_schedule

__all__ = [
    "CHECK_TOLERANCE",
    "DEFAULT_LR",
    "check_devices",
    "eval_batch_size",
    "global_batch_size",
    "lr_factor",
    "lr_scheduler_of",
    "main",
    "optimizer_of",
]

#: Largest parameter difference `--check` accepts (float64).
CHECK_TOLERANCE = 1e-9
#: The learning rate of the default optimizer (Adam) when `--lr` is not given.
DEFAULT_LR = 1e-2


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


def main(rank: int, world_size: int, config, model: RunModel | None = None) -> int:
    """Train as `rank` of `world_size`; returns the exit code (0, or 1 for a failed check).

    `model` is the run's whole model already built in this process, else None (what `schedcc
    run` passes): only this rank's segments are built here.
    """
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
            timeout=timedelta(
                seconds=config.timeout + (WATCHDOG_GRACE_S if backend == "nccl" else 0)
            ),
            device_id=device if device.type == "cuda" else None,
        )
        code = _train(rank, config, device, model)
    except dist.DistError as exc:  # e.g. a peer exited while process groups were being made
        raise RankFailure(f"rank {rank} lost contact with a peer rank: {first_line(exc)}") from None
    dist.destroy_process_group()
    return code


def _train(rank: int, config, device: torch.device, model: RunModel | None) -> int:
    if config.check:
        torch.set_default_dtype(torch.float64)
    parts = {} if config.num_parts is None else {"num_parts": config.num_parts}  # -k
    schedule = get_schedule(config.schedule)(
        config.num_stages, config.num_microbatches, config.num_chunks, config.num_batches, **parts
    )
    program = compile(
        schedule,
        data_parallel=config.data_parallel,
        zero=config.zero,
        tied=config.tied,
        grad_norm=config.grad_norm,
        recompute=config.recompute,
    )
    mesh = default_mesh(  # see [Note: rank layout]
        device.type,
        config.num_stages,
        config.data_parallel,
        config.tp,
        rank_order=config.rank_order,
    )
    bound_waits(  # every wait has the run's timeout ([Note: failures])
        timedelta(seconds=config.timeout), *map(mesh.get_group, mesh.mesh_dim_names)
    )
    model, own, initial = _own_model(schedule, mesh.get_local_rank("pp"), config, model, rank)
    dropped = _without_dropout(own, initial, schedule) if config.check else []
    optimizer = optimizer_of(model, config)
    own = {j: segment.to(device) for j, segment in own.items()}  # only this stage's
    if config.tp > 1:  # see [Note: the user's tensor parallelism]
        own = {j: shard_layers(segment, mesh.get_group("tp")) for j, segment in own.items()}
        _check_split(own, config, device)
    engine = Engine(
        program,
        own.__getitem__,  # a builder: this stage's segments, built above
        model.loss_fn,
        optimizer,
        groups=mesh,
        timeout=config.timeout,
        p2p=config.p2p,
        max_grad_norm=config.max_grad_norm,
        mixed_precision=PRECISIONS[config.precision],
        lr_scheduler=lr_scheduler_of(model, config),
        recompute_layers=config.recompute_layers,
        compile=config.compile or False,
    )
    dp_index = dist.get_rank(engine.dp_group)
    if config.resume:
        _resume(engine, config, rank)
    if engine.steps >= config.steps:
        if rank == 0:
            print(f"the checkpoint is at step {engine.steps}: nothing left to train", flush=True)
        return 0
    losses, sizes, evals = _loop(
        engine, model, config, dp_index, show=rank == 0 and config.progress
    )
    state = None
    if config.check:
        with engine.unsharded():  # ZeRO-3: every replica gathers, the first one reports
            state = _state(engine, schedule) if dp_index == 0 else None
    mine = {
        "stage": engine.stage,
        "dp": dp_index,
        "times": list(engine.unit_times),
        "segment": list(engine.segment_times),
        "first": engine.runs_timed - len(engine.unit_times),  # the first kept run's index
        "peak": engine.runtime.peak_activation_bytes,
        "sizes": engine.runtime.microbatch_bytes,
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
    from schedcc.backends.run.report import check_line, dropout_line, summarize

    summarize(program, config, model, losses, sizes, [g for g in gathered if g["tp"] == 0], evals)
    if not config.check:
        return 0
    if dropped:
        print(dropout_line(dropped), flush=True)
    worst, objective = _check(program, config, model, initial, gathered)
    print(check_line(worst, CHECK_TOLERANCE, objective=objective), flush=True)
    if not evals:
        return 0 if worst <= CHECK_TOLERANCE else 1
    expected = _reference_eval(initial, program, model, config)  # `initial` is trained now
    gap = abs(evals[-1][1] - expected)
    print(check_line(gap, CHECK_TOLERANCE, what="final evaluation loss"), flush=True)
    return 0 if max(worst, gap) <= CHECK_TOLERANCE else 1


def _own_model(schedule, stage: int, config, model: RunModel | None, rank: int):
    """`(model, {j: module} of the segments stage `stage` holds, the --check reference)`.

    `j` is a segment of one model replica (DualPipe holds each twice). The segments are built
    alone where the factory can (`models.build(..., segments=)`); of a whole model given, the
    stage's are kept and the rest dropped. With `--check`, rank 0 also builds the whole model,
    the non-pipelined reference (`None` elsewhere), as one list of `p*v` segments (a replica's
    held again for each other replica, as in the engines).
    """
    replicas = type(schedule).num_replicas
    length = schedule.num_segments // replicas
    held = sorted({schedule.segment_of(stage, c) % length for c in range(schedule.num_chunks)})
    initial = None
    parts = schedule.num_parts
    if config.check and rank == 0:
        whole = model or models.build(config.model, length, seed=config.seed, parts=parts)
        initial = copy.deepcopy(list(whole.segments)) * replicas
    if model is None:
        model = models.build(config.model, length, seed=config.seed, segments=held, parts=parts)
    else:
        model = dataclasses.replace(model, segments={j: model.segments[j] for j in held})
    return model, dict(model.segments), initial


def _without_dropout(own: dict, initial, schedule) -> list[str]:
    """`--check`: every dropout probability of this rank's segments and of the reference set to
    0 (`reference.without_dropout`); what was changed in the whole model (rank 0), else []."""
    from schedcc.backends.reference import without_dropout

    without_dropout(own.values())
    if initial is None:
        return []
    return without_dropout(initial[: len(initial) // type(schedule).num_replicas])


def _check_split(own: dict, config, device: torch.device) -> None:
    """`--tp`: some rank's segments hold a run to split over the tensor-parallel ranks, or
    every rank refuses (agreed over the world, so none waits on one that refused)."""
    split = (ParallelMLP, ParallelBlock, ParallelGPTBlock)
    found = any(isinstance(m, split) for segment in own.values() for m in segment.modules())
    flag = torch.tensor([float(found)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not flag.item():
        raise ScheduleConfigError(
            f"--tp {config.tp}: model {config.model} has no attention block or "
            "Linear-activation-Linear run to split over tensor-parallel ranks"
        )


def optimizer_of(model: RunModel, config):
    """The model's optimizer factory, or Adam at `--lr`."""
    if model.optimizer is not None:
        return model.optimizer
    lr = DEFAULT_LR if config.lr is None else config.lr

    def adam(params):
        return torch.optim.Adam(params, lr=lr)

    return adam


def lr_scheduler_of(model: RunModel, config):
    """The model's learning-rate scheduler factory, or `--lr-schedule` and `--warmup`'s (None:
    a constant rate)."""
    if model.lr_scheduler is not None:
        return model.lr_scheduler
    if config.lr_schedule == "constant" and not config.warmup:
        return None
    factor = functools.partial(
        lr_factor, warmup=config.warmup, steps=config.steps, cosine=config.lr_schedule == "cosine"
    )

    def schedule(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    return schedule


def lr_factor(step: int, *, warmup: int, steps: int, cosine: bool) -> float:
    """The rate's factor after `step` optimizer steps: linear over the first `warmup` (from
    1/warmup to 1), then 1, or with `cosine` a half cosine from 1 down to 0 at `steps`.

    >>> [round(lr_factor(n, warmup=2, steps=6, cosine=True), 3) for n in range(6)]
    [0.5, 1.0, 1.0, 0.854, 0.5, 0.146]
    """
    if step < warmup:
        return (step + 1) / warmup
    if not cosine:
        return 1.0
    done = (step - warmup) / max(1, steps - warmup)
    return 0.5 * (1 + math.cos(math.pi * min(done, 1.0)))


def global_batch_size(config) -> int:
    """Samples in one optimizer step's batch, over every data-parallel replica."""
    return config.num_microbatches * config.microbatch_size * config.data_parallel


def eval_batch_size(config) -> int:
    """Samples in one held-out batch: what one run of the program takes (`num_batches` steps'
    worth, which `Engine.evaluate` splits into `m * num_batches` microbatches)."""
    return global_batch_size(config) * config.num_batches


def _eval_batches(model: RunModel, config):
    """The held-out batches of every evaluation: `--eval-batches` of them, the same each time."""
    size = eval_batch_size(config)
    return [_draw(model, config, "eval_batch", size, k) for k in range(config.eval_batches)]


def _draw(model: RunModel, config, field: str, size: int, index: int):
    """`model.<field>(size, index)` (`batch` or `eval_batch`), through the user-code guard."""
    draw = getattr(model, field)
    return call_user(f"--model {config.model}: {field}({size}, {index})", lambda: draw(size, index))


def _evaluate(engine: Engine, batches, config, dp_index: int) -> float:
    """The mean over the held-out batches of each one's loss (`Engine.evaluate`, collective)."""
    losses = [
        engine.evaluate(*local_batches(batch, k, config.data_parallel)[dp_index])
        for k, batch in enumerate(batches)
    ]
    return sum(losses) / len(losses)


def _global_batches(model: RunModel, config, start: int = 0):
    for step in range(start, config.steps):
        yield _draw(model, config, "batch", global_batch_size(config), step)


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


def _loop(
    engine: Engine, model: RunModel, config, dp_index: int, *, show: bool
) -> tuple[list[float], list[int], list[tuple[int, float]]]:
    """Train to `config.steps`; each step's loss, what its global batch counts for, and
    `(step, loss)` of each evaluation on held-out batches (`--eval-every`)."""
    from schedcc.backends.checkpoint.files import step_dir
    from schedcc.backends.run.report import Progress

    sizes: list[int] = []

    def local():
        for step, batch in enumerate(_global_batches(model, config, engine.steps), engine.steps):
            count = f"--model {config.model}: count(inputs, targets) of step {step}"
            sizes.append(call_user(count, lambda batch=batch: model.size(*batch)))
            yield local_batches(batch, step, config.data_parallel)[dp_index]

    losses: list[float] = []
    evals: list[tuple[int, float]] = []
    held_out = _eval_batches(model, config) if config.eval_every else []
    with (
        Progress(config.steps, enabled=show, completed=engine.steps) as progress,
        _metrics(engine, model, config, sizes) as on_step,
    ):
        last = time.perf_counter()
        for loss in engine.train(local(), on_step=on_step):
            now = time.perf_counter()
            losses.append(loss)
            progress.advance(loss, now - last, skipped=engine.skipped_steps)
            if config.checkpoint and config.every and engine.steps % config.every == 0:
                engine.save(step_dir(config.checkpoint, engine.steps))
            every, steps = config.eval_every, engine.steps
            if every and (steps % every == 0 or steps == config.steps):
                evals.append((steps, _evaluate(engine, held_out, config, dp_index)))
                progress.evaluated(evals[-1][1])
            last = time.perf_counter()
    return losses, sizes, evals


@contextlib.contextmanager
def _metrics(engine: Engine, model: RunModel, config, sizes: list[int]):
    """`--metrics`: the `on_step` that writes each step's record with what its global batch
    counts for (`model.unit`, e.g. "tokens", from `sizes`), on the rank that writes; None else.
    A resumed run appends to the stream it continues."""
    from schedcc.backends.metrics import open_metrics

    if not config.metrics or not engine.writes_metrics:
        yield None
        return
    start = engine.steps  # sizes[0] is the first step this process trains
    with open_metrics(config.metrics, append=config.resume) as writer:

        def on_step(record):
            writer({**record, model.unit: sizes[record["step"] - 1 - start]})

        yield on_step


def _state(engine: Engine, schedule) -> dict[int, dict[str, torch.Tensor]]:
    return {
        schedule.segment_of(engine.stage, c): {
            name: tensor.detach().cpu() for name, tensor in module.state_dict().items()
        }
        for c, module in enumerate(engine.modules)
    }


def _reference_eval(initial, program: Program, model: RunModel, config) -> float:
    """The held-out loss of the non-pipelined model `initial` (one replica), as `_evaluate`
    averages it: each batch's loss over its local batches (`reference_loss`), in eval mode;
    with sequence parts, on the whole sequences (`Chain(..., carries=True)`)."""
    from schedcc.backends.reference import Chain, reference_loss

    schedule = program.schedule
    replica = initial[: len(initial) // type(schedule).num_replicas]
    chain = Chain(replica, carries=schedule.num_parts > 1).eval()
    # as `Engine.evaluate` splits, each microbatch of the data whole
    split = config.num_microbatches * config.num_batches // schedule.num_parts
    with torch.no_grad():
        losses = [
            float(
                reference_loss(
                    chain,
                    model.loss_fn,
                    local_batches(batch, k, config.data_parallel),
                    num_microbatches=split,
                )
            )
            for k, batch in enumerate(_eval_batches(model, config))
        ]
    return sum(losses) / len(losses)


def _check(program: Program, config, model: RunModel, initial, gathered) -> tuple[float, str]:
    """`(largest parameter difference, the objective compared)`: non-pipelined training of the
    objective the run trains, on the same local batches and microbatches (with sequence parts,
    each microbatch of the data as one whole sequence)."""
    from schedcc.backends.reference import train_reference

    dp, parts = config.data_parallel, program.schedule.num_parts
    objectives: list[str] = []
    train_reference(
        initial[: len(initial) // type(program.schedule).num_replicas],  # one model replica
        model.loss_fn,
        optimizer_of(model, config),
        (local_batches(b, step, dp) for step, b in enumerate(_global_batches(model, config))),
        weight_delay=program.schedule.weight_delay,
        batches_per_run=program.schedule.num_batches,
        max_grad_norm=config.max_grad_norm,
        skip_nonfinite=config.grad_norm,
        num_microbatches=config.num_microbatches // parts,
        objectives=objectives,
        lr_scheduler=lr_scheduler_of(model, config),
        carries=parts > 1,
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
    return worst, objectives[0]
