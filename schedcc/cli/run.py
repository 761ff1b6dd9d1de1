"""`schedcc run`: train a model with a pipeline schedule on `torch.distributed`.

With no flags it trains the built-in tiny GPT (tied LM head, padding mask and position ids
crossing every stage, variable-length batches) on generated bigram data with 1F1B over 2 local
processes (gloo on CPU; NCCL and one process per GPU when CUDA is there), shows progress, and ends
with a summary: final loss against the entropy floor, step time, tokens/s, measured against
simulated bubble, and peak activation memory per stage. `--model file.py:make` trains a model of
one's own (the contract is `schedcc.backends.run.models`). Under `torchrun` it uses the
launcher's ranks instead of spawning. torch is imported only when a run starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import tempfile
from pathlib import Path

from schedcc.cli import args as shared
from schedcc.cli import memory_flags
from schedcc.cli.args import UsageError, positive_int
from schedcc.cli.tune import add_other_cut, trace_costs
from schedcc.compiler import compile
from schedcc.errors import ScheduleConfigError
from schedcc.registry import build_schedule, get_schedule

__all__ = ["Config", "register", "run"]

EPILOG = """examples:
  schedcc run
  schedcc run --schedule interleaved-1f1b -p 2 -v 2 -m 8 --steps 50 --trace run.json
  schedcc run --schedule seq1f1b -m 8 -k 4 --check
  schedcc run --dp 2 --zero 1 --check
  schedcc run --schedule my_schedules.py:MySchedule --model mlp
  schedcc run --schedule search --search-memory-limit 1   (first runs traced, then searched)
  schedcc run --schedule search --costs-from run.json     (run.json: a first run's --trace)
  schedcc run --model examples/char_lm.py:make -p 4 --check
  schedcc run --steps 100 --checkpoint ckpt --every 10      (then add --resume after a crash)
  torchrun --nproc-per-node 4 -m schedcc run -p 2          (dp = world / p)
"""

#: Batches one program covers for weight-delayed schedules (2BW), so the delay shows.
DELAYED_BATCHES_PER_RUN = 4


@dataclasses.dataclass(frozen=True)
class Config:
    """What every rank of `schedcc run` needs to know (picklable, torch-free)."""

    schedule: str
    num_stages: int
    num_microbatches: int
    num_chunks: int
    num_batches: int
    data_parallel: int
    zero: int
    steps: int
    model: str
    microbatch_size: int
    lr: float | None
    seed: int
    trace: str | None
    check: bool
    timeout: float
    progress: bool
    checkpoint: str | None = None
    every: int = 0
    resume: bool = False
    #: The groups of segments that share parameters, found in the model `--model` builds.
    tied: tuple[tuple[int, ...], ...] = ()
    p2p: str | None = None
    max_grad_norm: float | None = None
    precision: str = "fp32"
    grad_norm: bool = False
    tp: int = 1
    recompute: bool = False
    #: `--recompute-layers N`: recompute every N layers inside each segment (None: off).
    recompute_layers: int | None = None
    #: `--compile [BACKEND]`: the torch.compile backend each segment runs through (None: eager).
    compile: str | None = None
    #: Evaluate on held-out batches every this many steps and after the last (0: never).
    eval_every: int = 0
    eval_batches: int = 2
    #: The default mesh's order ([Note: rank layout] in `backends.distributed.groups`).
    rank_order: str = "pp-inner"
    #: The learning rate's schedule when the model brings no scheduler: "constant" or
    #: "cosine" (to 0 at the last step), after a linear warmup over `warmup` steps.
    lr_schedule: str = "constant"
    warmup: int = 0
    #: `--metrics`: a JSONL file, or `tb:DIR` (`backends.metrics.open_metrics`); None: none.
    metrics: str | None = None
    #: `-k`: sequence parts per microbatch (None: the schedule's own `default_num_parts`).
    num_parts: int | None = None

    @property
    def world_size(self) -> int:
        return self.num_stages * self.data_parallel * self.tp

    def describe(self, rank: int) -> str:
        """`rank 3 (stage 1, dp 1)`: global rank = (dp_index * p + stage) * tp + tp_index
        ("pp-inner"), or (stage * dp + dp_index) * tp + tp_index ("dp-inner")."""
        rank_tp, tp_index = divmod(rank, self.tp)
        if self.rank_order == "dp-inner":
            stage, dp_index = divmod(rank_tp, self.data_parallel)
        else:
            dp_index, stage = divmod(rank_tp, self.num_stages)
        if self.tp > 1:
            return f"rank {rank} (stage {stage}, dp {dp_index}, tp {tp_index})"
        return f"rank {rank} (stage {stage}, dp {dp_index})"


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "run",
        help="train a model with a schedule on torch.distributed",
        description=__doc__.splitlines()[0],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    shared.add_schedule(parser, default="1f1b")
    shared.add_stages(parser, found=2)
    shared.add_microbatches(parser, found=8)
    shared.add_chunks(parser)
    shared.add_parts(parser)
    shared.add_parallel(parser, dp_default=None, zero_choices=(0, 1, 2, 3))
    parser.add_argument("--steps", type=positive_int, default=30, help="optimizer steps")
    parser.add_argument(
        "--model",
        default="tiny-gpt",
        metavar="NAME",
        help="tiny-gpt (default), mlp, or your factory: module:make or path/to/file.py:make "
        "(make(num_segments, *, seed) -> schedcc.backends.run.models.RunModel)",
    )
    parser.add_argument(
        "--microbatch-size", type=positive_int, default=2, help="samples per microbatch"
    )
    parser.add_argument(
        "--lr", type=float, help="learning rate of the default optimizer, Adam (default 0.01)"
    )
    parser.add_argument(
        "--lr-schedule",
        choices=("constant", "cosine"),
        default="constant",
        help="the learning rate after --warmup: constant (default), or a cosine decay to 0 at "
        "the last step; stepped with every rank's optimizer",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=0,
        metavar="N",
        help="raise the learning rate linearly over the first N optimizer steps (default 0)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", metavar="FILE", help="write the measured Chrome trace here")
    parser.add_argument(
        "--costs-from",
        type=Path,
        default=None,
        metavar="TRACE",
        help="with --schedule search: train the order schedcc search finds for the costs "
        "measured in this trace (a first run's --trace; default: first runs of its own)",
    )
    add_other_cut(parser)
    parser.add_argument(
        "--search-time",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds --schedule search may search (default 10)",
    )
    parser.add_argument(
        "--search-memory-limit",
        type=memory_flags.memory_limit,
        default=None,
        metavar="N|SIZE",
        help="with --schedule search: hold each stage to N microbatches of its activations "
        "(1F1B's stage 0 holds p), or to SIZE bytes of them (e.g. 40MiB, as the summary's peak "
        "activations count them, measured per microbatch in the --costs-from run), "
        "recomputing where that asks for it",
    )
    parser.add_argument(
        "--search-offload",
        action="store_true",
        help="with --search-memory-limit: let the search offload activations to host memory too",
    )
    parser.add_argument(
        "--metrics",
        metavar="PATH",
        help="write one record per optimizer step: JSONL to PATH, or TensorBoard with tb:DIR",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="train in float64 and compare with non-pipelined training (exit 1 if they differ)",
    )
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="seconds any rank may wait on a peer"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--p2p",
        choices=("shm", "gloo", "broadcast", "nccl"),
        default=None,
        help="how stages exchange tensors: under gloo shared memory on the same machine "
        "(default), gloo's send/recv, broadcasts within two-rank groups, or nccl's protocol "
        "emulated; under nccl, nccl",
    )
    parser.add_argument(
        "--max-grad-norm",
        type=float,
        metavar="X",
        help="clip the whole model's gradient norm to X before each step",
    )
    parser.add_argument(
        "--tp",
        type=positive_int,
        default=1,
        help="tensor-parallel ranks per stage (attention heads and MLPs split Megatron-style)",
    )
    parser.add_argument(
        "--precision",
        choices=("fp32", "bf16", "fp16"),
        default="fp32",
        help="compute and stage-to-stage tensors in bf16 or fp16 (dynamic loss scaling); "
        "weights and optimizer state stay fp32",
    )
    parser.add_argument(
        "--rank-order",
        choices=("pp-inner", "dp-inner"),
        default="pp-inner",
        help="how ranks are laid out: a pipeline's stages on consecutive ranks (pp-inner, the "
        "default: one node per pipeline), or a stage's data-parallel peers (dp-inner, "
        "Megatron-LM's order)",
    )
    parser.add_argument(
        "--no-bind",
        action="store_true",
        help="leave the spawned ranks unbound (default: each its own slice of the cores)",
    )
    parser.add_argument(
        "--checkpoint", metavar="DIR", help="checkpoint directory (DIR/step-NNNNNNNN/ per save)"
    )
    parser.add_argument(
        "--every", type=positive_int, metavar="N", help="save a checkpoint every N steps"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint in --checkpoint (if any)",
    )
    parser.add_argument(
        "--recompute",
        action="store_true",
        help="recompute every forward before its backward (compile(..., recompute=True))",
    )
    parser.add_argument(
        "--recompute-layers",
        type=positive_int,
        metavar="N",
        help="keep every N-th layer boundary of each segment and recompute each group of N "
        "layers in the backward (Engine(..., recompute_layers=N); nn.Sequential segments)",
    )
    parser.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        metavar="BACKEND",
        help="run each segment through torch.compile (Engine(..., compile=...)): inductor, or "
        "the backend named (e.g. aot_eager)",
    )
    parser.add_argument(
        "--eval-every",
        type=positive_int,
        metavar="N",
        help="every N steps and after the last, the mean loss on held-out batches (forward "
        "only, in eval mode: Engine.evaluate)",
    )
    parser.add_argument(
        "--eval-batches",
        type=positive_int,
        default=2,
        metavar="K",
        help="held-out batches per evaluation (default 2)",
    )
    parser.add_argument(
        "--oversubscribe",
        action="store_true",
        help="start more ranks than there are cores (refused otherwise: it runs very slowly); "
        "SCHEDCC_OVERSUBSCRIBE=1 in the environment does the same",
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="print the traceback of a rank's failure (default: one line naming a log file)",
    )
    parser.set_defaults(func=run)


def run(args) -> int:
    """Validate the request, then train on spawned processes or on torchrun's ranks."""
    from schedcc.backends.run import launch

    config, schedule = _config(args, launch.in_torchrun())
    if not launch.in_torchrun():
        try:  # before torch is imported or a model built: see [Note: one core a rank]
            launch.check_cores(config.world_size, oversubscribe=args.oversubscribe)
        except launch.UserError as exc:
            raise UsageError(str(exc)) from None
    from schedcc.backends.run import job  # imports torch

    model, tied = _model(config, schedule)
    config = dataclasses.replace(config, tied=tied)
    del model  # each rank builds only its own stage's segments (under torchrun too)
    if launch.in_torchrun():
        rank = int(os.environ["RANK"])
        return launch.run_rank(job.main, rank, config.world_size, config, debug=args.debug)
    try:
        job.check_devices(config.world_size)
    except launch.UserError as exc:
        raise UsageError(str(exc)) from None
    return launch.spawn(
        job.main,
        config.world_size,
        (config,),
        grace=config.timeout + 10.0,
        threads=max(1, (os.cpu_count() or 1) // config.world_size),
        describe=config.describe,
        bind_cores=not args.no_bind,
        debug=args.debug,
    )


def _model(config: Config, schedule):
    """`--model` built here, before any rank starts, and its ties, the program compiled with
    them: a bad factory, model, batch or program is one line (exit 2), not one from every rank.

    The whole model is built here only to check it and find its ties (on one thread, so no
    thread pool exists when it forks the ranks); every rank, this process under torchrun too,
    then builds only its own stage's segments.
    """
    import torch

    from schedcc.backends.run import job, models
    from schedcc.backends.runtime.tied import tied_groups
    from schedcc.errors import UserError

    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    torch.set_num_threads(1)  # no thread pool started before the ranks are forked
    if config.check:
        torch.set_default_dtype(torch.float64)  # what the ranks build in
    try:
        replicas = type(schedule).num_replicas  # DualPipe: one replica's segments, held twice
        model = models.build(
            config.model,
            schedule.num_segments // replicas,
            seed=config.seed,
            parts=schedule.num_parts,
        )
        models.check_batch(
            model,
            config.model,
            batch_size=job.global_batch_size(config),
            num_microbatches=config.num_microbatches,
            data_parallel=config.data_parallel,
            parts=schedule.num_parts,
            seq_dim=schedule.seq_dim,
        )
        if config.eval_every and model.eval_batch is None:
            raise UserError(
                f"--eval-every: --model {config.model} has no held-out data; give its RunModel "
                "an eval_batch(batch_size, k)"
            )
        if config.eval_every:
            models.check_batch(
                model,
                config.model,
                batch_size=job.eval_batch_size(config),
                num_microbatches=config.num_microbatches * config.num_batches,
                data_parallel=config.data_parallel,
                parts=schedule.num_parts,
                seq_dim=schedule.seq_dim,
                field="eval_batch",
            )
    except UserError as exc:
        raise UsageError(str(exc)) from None
    finally:
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
    if model.optimizer is not None and config.lr is not None:
        raise UsageError(
            f"--lr sets the default optimizer's learning rate, but --model {config.model} brings "
            "its own optimizer: set the rate there, or drop --lr"
        )
    if model.lr_scheduler is not None and (config.lr_schedule != "constant" or config.warmup):
        raise UsageError(
            f"--lr-schedule and --warmup schedule the learning rate, but --model {config.model} "
            "brings its own lr_scheduler: schedule it there, or drop them"
        )
    tied = tuple(tied_groups(model.segments))  # within one replica; compile ties the copies
    program = compile(  # a bad program is one line, exit 2
        schedule,
        data_parallel=config.data_parallel,
        zero=config.zero,
        tied=tied,
        grad_norm=config.grad_norm,
        recompute=config.recompute,
    )
    _check_segment_calls(config, model.segments, program)
    return model, tied


def _check_segment_calls(config: Config, segments, program) -> None:
    """`--recompute-layers` and `--compile` checked against the model's segments and the
    program, as every rank's engine checks them: one line (exit 2), not one from every rank."""
    from schedcc.backends.runtime.segment_calls import (
        SegmentCall,
        check_compile,
        check_one_value,
    )

    flags = "--recompute-layers" if config.recompute_layers else "--compile"
    try:
        check_one_value(program, config.recompute_layers, check_compile(config.compile, program))
        if config.recompute_layers:
            held = segments.items() if isinstance(segments, dict) else enumerate(segments)
            for k, segment in held:
                SegmentCall(segment, segment=k, recompute_layers=config.recompute_layers)
    except ScheduleConfigError as exc:
        raise UsageError(f"{flags} with --model {config.model}: {exc}") from None


def _config(args, under_torchrun: bool) -> tuple[Config, object]:
    """The run's `Config` and its schedule, every flag checked (`UsageError`)."""
    if not 0 < args.timeout < math.inf:
        raise UsageError(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    if args.lr is not None and not 0 < args.lr < math.inf:
        raise UsageError(f"--lr must be a positive number, got {args.lr:g}")
    if not 0 <= args.warmup <= args.steps:
        raise UsageError(f"--warmup must be 0 to --steps ({args.steps}) steps, got {args.warmup}")
    if args.schedule == "search":
        shared.fill_shape(args, None)
        args.schedule, args.num_chunks = _searched(args, under_torchrun)
    else:
        shared.fill_shape(args, args.schedule)
        for flag, given in (
            ("--costs-from", args.costs_from is not None),
            ("--other-cut", bool(args.other_cut)),
            ("--search-memory-limit", args.search_memory_limit is not None),
            ("--search-offload", args.search_offload),
        ):
            if given:
                raise UsageError(f"{flag} goes with --schedule search (the order to search for)")
    cls = get_schedule(args.schedule)
    p, dp = args.num_stages, args.dp
    if args.tp not in (1, 2, 4):
        raise UsageError(
            f"--tp {args.tp}: the built-in models split their 4 attention heads and their "
            "linear layers over 1, 2 or 4 tensor-parallel ranks"
        )
    if under_torchrun:
        world = int(os.environ["WORLD_SIZE"]) // args.tp
        if dp is None:
            if world % p:
                raise UsageError(
                    f"torchrun started {world} rank(s), not a multiple of -p {p}: start p * dp "
                    "ranks, or change -p"
                )
            dp = world // p
        elif p * dp != world:
            raise UsageError(
                f"-p {p} --dp {dp} needs {p * dp} ranks but torchrun started {world}: make "
                "--nnodes * --nproc-per-node equal p * dp"
            )
    dp = dp or 1
    batches_per_run = DELAYED_BATCHES_PER_RUN if cls.weight_delay else 1
    batches_per_run = min(batches_per_run, args.steps)
    schedule = build_schedule(
        cls,
        p,
        args.num_microbatches,
        num_chunks=args.num_chunks,
        num_batches=batches_per_run,
        num_parts=args.parts,
    )
    shared.check_size(p, args.num_microbatches, schedule.num_chunks, batches_per_run)
    _check_parts(schedule, args.model)
    grad_norm = _grad_norm(args, schedule, dp)  # a bad program fails here, exit 2
    if args.trace:
        shared.check_output_file("--trace", args.trace, example="run.json")
    _check_metrics(args.metrics)
    steps = -(-args.steps // batches_per_run) * batches_per_run
    _check_checkpoint_args(args, batches_per_run)
    if args.eval_every and args.eval_every % batches_per_run:
        raise UsageError(
            f"--eval-every {args.eval_every}: evaluations run between program runs, which cover "
            f"{batches_per_run} steps each for this schedule; use a multiple of {batches_per_run}"
        )
    config = Config(
        schedule=args.schedule,
        num_stages=p,
        num_microbatches=args.num_microbatches,
        num_chunks=schedule.num_chunks,
        num_batches=batches_per_run,
        data_parallel=dp,
        zero=args.zero,
        steps=steps,
        model=args.model,
        microbatch_size=args.microbatch_size,
        lr=args.lr,
        seed=args.seed,
        trace=args.trace,
        check=args.check,
        timeout=args.timeout,
        progress=not args.no_progress,
        p2p=args.p2p,
        max_grad_norm=args.max_grad_norm,
        precision=args.precision,
        grad_norm=grad_norm,
        tp=args.tp,
        checkpoint=args.checkpoint,
        every=args.every or 0,
        resume=args.resume,
        recompute=args.recompute,
        recompute_layers=args.recompute_layers,
        compile=args.compile,
        eval_every=args.eval_every or 0,
        eval_batches=args.eval_batches,
        rank_order=args.rank_order,
        lr_schedule=args.lr_schedule,
        warmup=args.warmup,
        metrics=args.metrics,
        num_parts=args.parts,
    )
    return config, schedule


def _searched(args, under_torchrun: bool) -> tuple[str, int]:
    """`--schedule search`: the order `schedcc.search` finds for the costs measured in
    `--costs-from` (milliseconds), timed as the engine runs it (eagerly: sends that never
    wait), written to a file the ranks load; its simulated step is printed, to set against the
    measured one in the summary."""
    if under_torchrun:
        raise UsageError(
            "--schedule search runs on the processes schedcc run starts; under torchrun, search "
            "first (schedcc search -p P -m M --costs-from TRACE --out found.py) and pass "
            "--schedule found.py:Found"
        )
    if not 0 < args.search_time < math.inf:
        raise UsageError(
            f"--search-time must be a positive number of seconds, got {args.search_time:g}"
        )
    limit = args.search_memory_limit
    if args.search_offload and limit is None:
        raise UsageError("--search-offload goes with --search-memory-limit N (what to fit)")
    from schedcc.backends.run.report import other_bytes
    from schedcc.cli.tune import finer_line, updates_line
    from schedcc.costs import measured_backward, measured_updates
    from schedcc.draw.chrome import read_chrome_trace
    from schedcc.search import search

    chunks = (1, 2) if args.num_chunks is None else (args.num_chunks,)
    if args.costs_from is None:
        if args.other_cut:
            raise UsageError("--other-cut goes with --costs-from TRACE (the run it prices)")
        cuts = _one_model(args, sorted({1, *chunks}), min(chunks))
        chunks = tuple(v for v in chunks if v in cuts)
        args.costs_from, args.other_cut = _first_runs(args, cuts)
    elif (traced := measured_updates(args.costs_from).cut) is not None:
        reference = max(traced // args.num_stages, 1)
        chunks = tuple(v for v in chunks if v in _one_model(args, chunks, reference))
        if not chunks:
            raise UsageError(
                f"--model {args.model} cut at -v {args.num_chunks} is another model than the "
                f"one {args.costs_from} measured (cut at v = {reference}): trace a run at that -v"
            )
    updates = measured_updates(args.costs_from)  # the first run's ties and norm
    if not updates.cut_free and args.num_chunks is None:  # its ties name segments of its cut
        chunks = (max(updates.cut // args.num_stages, 1),)
    memory = None
    if isinstance(limit, str):  # bytes: as the first run measured them, for orders of its cut
        memory = memory_flags.trace_memory(args.costs_from, args.num_stages, chunks)
        recorded = read_chrome_trace(args.costs_from)[1]["memory"]
        mismatch = other_bytes(args.costs_from, recorded, args)
        if mismatch is not None:
            raise ScheduleConfigError(mismatch)
    costs = trace_costs(args, args.num_stages)
    result = search(
        args.num_stages,
        args.num_microbatches,
        num_chunks=chunks,
        costs=costs,
        memory=memory,
        memory_limit=limit,
        split_backward=measured_backward(args.costs_from),
        recompute=limit is not None,
        offload=args.search_offload,
        data_parallel=args.dp or 1,
        zero=args.zero,
        tied=updates.tied,
        grad_norm=updates.grad_norm,
        time_limit=args.search_time,
        eager=True,  # as the engine runs on every transport
    )
    path = Path(tempfile.mkdtemp(prefix="schedcc-search-")) / "found.py"
    path.write_text(result.to_python())
    print(
        f"search: simulated step {result.makespan:.2f} ms, eagerly as the engine runs (lower "
        f"bound {result.bound:.2f} ms) "
        f"under the costs measured in {args.costs_from}"
        + "".join(f" and {other}" for other in args.other_cut)
        + _within(limit)
        + f", from {result.source}; the order is "
        f"{path}:Found"
    )
    found = result.schedule
    for line in (
        finer_line(costs, args.num_stages, [found.num_chunks // type(found).num_replicas]),
        updates_line(updates.tied, updates.grad_norm),
    ):
        if line is not None:
            print(line)
    return f"{path}:Found", result.schedule.num_chunks


#: The steps of each first run `--schedule search` trains without `--costs-from`.
FIRST_RUN_STEPS = 12
#: The flags of a run a first run does not take: it trains a built-in, traced, and keeps nothing.
_FIRST_RUN_LEAVES = {
    "costs_from": None, "other_cut": [], "search_memory_limit": None, "search_offload": False,
    "metrics": None, "checkpoint": None, "every": None, "resume": False, "warmup": 0,
    "eval_every": None,
}  # fmt: skip


def _one_model(args, cuts, reference: int) -> list[int]:
    """Those of `cuts` (chunks a stage) at which `--model` is the model it is at `reference`,
    as far as its parameters tell (the built-in GPT grows with its cut: a block a segment, 4 at
    least); a line for each left out, since costs measured at one are not another's."""
    import torch

    from schedcc.backends.run import models
    from schedcc.errors import UserError

    def size(v: int) -> int:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # no thread pool started before the ranks are forked
        try:
            built = models.build(args.model, args.num_stages * v, seed=args.seed)
        except UserError as exc:
            raise UsageError(str(exc)) from None
        finally:
            torch.set_num_threads(threads)
        segments = built.segments.values() if isinstance(built.segments, dict) else built.segments
        unique = {id(p): p for segment in segments for p in segment.parameters()}
        return sum(p.numel() for p in unique.values())

    sizes = {v: size(v) for v in sorted({*cuts, reference})}
    kept = [v for v in cuts if sizes[v] == sizes[reference]]
    for v in sorted(set(cuts) - set(kept)):
        print(
            f"search: orders at v = {v} left out: --model {args.model} cut in "
            f"{args.num_stages * v} segments has {sizes[v]:,} parameters, at v = {reference} "
            f"(the costs' cut) {sizes[reference]:,}"
        )
    return kept


def _first_runs(args, cuts) -> tuple[Path, list[Path]]:
    """`--schedule search` without `--costs-from`: a traced first run at each of `cuts`
    (chunks a stage), finest first: interleaved 1F1B at v > 1 and 1F1B, `FIRST_RUN_STEPS` steps
    each, one after another. The finest one's trace gives the costs, the others each compute's
    per-call part (`--other-cut`, [Note: a compute's per-call time] in `schedcc.costs`);
    returns their paths."""
    folder = Path(tempfile.mkdtemp(prefix="schedcc-first-runs-"))
    traces = []
    for v in sorted(cuts, reverse=True):
        name = "1f1b" if v == 1 else "interleaved-1f1b"
        trace = folder / f"{name}-v{v}.json"
        print(f"search: a first run, {name} at v = {v}, {FIRST_RUN_STEPS} steps, traced to {trace}")
        first = argparse.Namespace(**vars(args))
        vars(first).update(_FIRST_RUN_LEAVES)
        first.schedule, first.num_chunks, first.steps = name, v, FIRST_RUN_STEPS
        first.trace = str(trace)
        code = run(first)
        if code:
            raise UsageError(f"--schedule search: the first run of {name} at v = {v} failed")
        traces.append(trace)
    return traces[0], traces[1:]


def _within(limit: float | str | None) -> str:
    if limit is None:
        return ""
    if isinstance(limit, str):
        return f", within {limit} of activations a stage"
    return f", within {limit:g} microbatches a stage"


def _check_parts(schedule, model: str) -> None:
    """A schedule of sequence parts needs segments that take a carry ([Note: sequence parts]
    in `schedcc.rules.parts`): a built-in model whose segments take none (`mlp`: its samples
    have no sequence) is refused before any rank starts (it would fail splitting the batch, or
    on the first forward)."""
    from schedcc.backends.run.models import BUILT_IN, takes_parts

    if schedule.num_parts > 1 and model in BUILT_IN and not takes_parts(BUILT_IN[model]):
        parted = sorted(name for name, make in BUILT_IN.items() if takes_parts(make))
        raise UsageError(
            f"{schedule.name or type(schedule).__name__} splits each microbatch into "
            f"{schedule.num_parts} sequence parts, which needs segments that take the carry of "
            f"the part before (forward(x, carry) -> (y, carry)); the built-in --model {model} "
            f"has no sequence to split: use --model {', '.join(parted)}, or "
            "give --model my_model.py:make with such segments"
        )


def _grad_norm(args, schedule, dp: int) -> bool:
    """Compile the program to check it; whether it carries `GradNorm` (clipping, fp16, and
    skipping non-finite steps need it; a schedule that cannot host it runs without, unless one
    of those was asked for)."""
    if args.max_grad_norm is not None and not 0 < args.max_grad_norm < math.inf:
        raise UsageError(f"--max-grad-norm must be a positive number, got {args.max_grad_norm:g}")
    if args.check and args.precision != "fp32":
        raise UsageError("--check compares float64 training; it cannot run with --precision")
    recompute = args.recompute
    try:
        compile(schedule, data_parallel=dp, zero=args.zero, recompute=recompute, grad_norm=True)
    except ScheduleConfigError:
        if args.max_grad_norm is not None or args.precision == "fp16":
            raise
        compile(schedule, data_parallel=dp, zero=args.zero, recompute=recompute)
        return False
    return True


def _check_checkpoint_args(args, batches_per_run: int) -> None:
    if (args.every or args.resume) and not args.checkpoint:
        raise UsageError("--every and --resume need --checkpoint DIR")
    if args.every and args.every % batches_per_run:
        raise UsageError(
            f"--every {args.every}: checkpoints are taken between program runs, which cover "
            f"{batches_per_run} steps each for this schedule; use a multiple of {batches_per_run}"
        )
    if args.resume and args.check:
        raise UsageError("--check compares a whole run from step 0; it cannot follow --resume")
    if args.checkpoint:
        shared.check_writable_directory("--checkpoint", args.checkpoint)


def _check_metrics(metrics: str | None) -> None:
    """`--metrics` can be written: a JSONL file as `--trace`'s, or `tb:DIR` with the
    `tensorboard` package installed and DIR a directory this process can make or write in."""
    if metrics is None:
        return
    from schedcc.backends.metrics import TENSORBOARD_PREFIX, spec_problem  # imports no torch

    problem = spec_problem(metrics)
    if problem is not None:
        raise UsageError(f"--metrics {problem}")
    if metrics.startswith(TENSORBOARD_PREFIX):
        shared.check_writable_directory("--metrics", metrics[len(TENSORBOARD_PREFIX) :])
        return
    shared.check_output_file("--metrics", metrics, example="metrics.jsonl")
