"""Step time of schedcc's distributed backend against torch.distributed.pipelining (a benchmark).

Two models, each split evenly over 2 stages (2 chunks each for interleaved), SGD, one thread per
process, gloo on 127.0.0.1:

- `mlp`: 8 x [Linear(512, 512) + ReLU], batch 64, MSE;
- `gpt`: the GPT of `backends/run/gpt.py` (4 blocks, 128 wide, 4 heads, vocab 256), batch 16 of
  32 tokens with padding, the mean token loss. The boundary value is the tuple
  `(x, pad_mask, pos_ids)` (a float, a bool and an int64 tensor), and the LM head is tied to
  the token embedding: schedcc compiles with `tied=` (a `ReduceTied` per step); torch, which
  has no tied parameters across stages, sums the two copies' gradients with an all-reduce
  before its optimizer step, as Megatron-LM does.

A step is timed barrier to barrier on every rank and the slowest rank counts; each row takes turns
in rounds: schedcc, schedcc with gloo point-to-point (`p2p="gloo"`: what the same executor does
without its same-host transport), schedcc with broadcast pairs (`p2p="broadcast"`), schedcc on
its NCCL code path with NCCL's blocking semantics emulated over gloo (`p2p="nccl"`: a thread per
link and an acknowledgement per send, so it measures the protocol's cost on a CPU, not NCCL's
speed), DeepSpeed's pipeline engine where it is installed (`pip install deepspeed`; MLP 1f1b
rows, its one schedule), schedcc in
bfloat16 (`mixed_precision`, with the bytes each step sends), torch, the floor (one step per turn
by default, so all see the same machine load; the order rotates from round to round, since
whichever runner follows the floor measures 8-10% slower), and reports the median over all timed
steps. The *floor* is every rank running only its own segments' forward and backward for all
microbatches plus its optimizer step, at the same time, with no pipeline communication;
`floor / (1 - bubble)` (the analytic bubble of the schedule) is what a perfect executor would
take. Overhead is the gap to that, per instruction of the busiest stage. The CPU column (each
rank's own CPU time for the step, slowest rank) is robust to a loaded machine: it shows what each
executor costs apart from waiting (but schedcc's receives check
for their data for up to 2 ms before they sleep, and that checking counts as CPU).

Each rank is bound to its own core and keeps the memory it frees for reuse, as `schedcc run`'s
ranks do (`--no-bind`: left free; `--default-malloc`: glibc's default trimming; see [Note: keeping
freed memory] in `backends/run/launch.py`).

    python benchmarks/step_time.py [--rounds 30] [--steps-per-round 1] [--warmup 5]
        [--models mlp gpt] [--schedules gpipe 1f1b interleaved-1f1b] [--microbatches 4 8]
        [--no-bind] [--default-malloc]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed, when installed, on this CPU

import argparse
import importlib.util
import itertools
import logging
import statistics
import time
from datetime import timedelta

import torch
import torch._dynamo  # torch.optim imports it (seconds): import once, before forking ranks
import torch.distributed as dist
import torch.nn.functional as F
from _stamp import stamp
from torch import nn
from torch.distributed import pipelining as tpp

import schedcc
from schedcc.backends.distributed.engine import Engine
from schedcc.backends.run import gpt
from schedcc.backends.run.launch import keep_freed_memory, spawn
from schedcc.backends.runtime.tied import find_ties, tied_groups
from schedcc.backends.runtime.values import call, flatten, grad_tensors, split
from schedcc.costs import CostModel
from schedcc.simulate import simulate

NUM_STAGES = 2

#: (schedcc schedule, torch schedule class, chunks per stage)
ROWS = [
    ("gpipe", tpp.ScheduleGPipe, 1),
    ("1f1b", tpp.Schedule1F1B, 1),
    ("interleaved-1f1b", tpp.ScheduleInterleaved1F1B, 2),
]
MICROBATCHES = (4, 8)
#: DeepSpeed's pipeline engine is a peer column where it is installed (its TrainSchedule is 1F1B;
#: the tied GPT would need its TiedLayerSpec, so only the MLP's 1f1b rows run it).
DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


class MLP:
    """8 x [Linear(512, 512) + ReLU], batch 64, MSE: one tensor crosses each boundary."""

    name, loss_fn = "mlp", staticmethod(F.mse_loss)
    width, layers, batch = 512, 8, 64

    def segments(self, num_segments: int) -> list[nn.Module]:
        torch.manual_seed(0)
        width = self.width
        layers = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(self.layers)]
        per = self.layers // num_segments
        return [nn.Sequential(*layers[k * per : (k + 1) * per]) for k in range(num_segments)]

    def data(self):
        torch.manual_seed(1)
        return torch.randn(self.batch, self.width), torch.randn(self.batch, self.width)


class TiedGPT:
    """The GPT with its head tied to the token embedding; `(x, pad_mask, pos_ids)` crosses."""

    name, loss_fn = "gpt", staticmethod(gpt.mean_token_loss)
    config = gpt.GPTConfig(vocab=256, max_len=32, d_model=128, num_heads=4, num_blocks=4)
    batch = 16

    def segments(self, num_segments: int) -> list[nn.Module]:
        return gpt.gpt_segments(gpt.GPT(self.config, seed=0), num_segments)

    def data(self):
        # one length for the whole run (torch's stages learn their shapes once), rows padded
        data = gpt.PaddedBigramData(self.config.vocab, self.config.max_len, min_len=24, seed=1)
        step = next(s for s in range(100) if data.batch(1, s)[0][0].shape[1] == data.max_len)
        return data.batch(self.batch, step)


MODELS = {model.name: model for model in (MLP(), TiedGPT())}


def _sgd(params):
    return torch.optim.SGD(params, lr=1e-3)


def _timed(step) -> tuple[float, float]:
    """Wall seconds barrier to barrier, and this process's CPU seconds for the step alone."""
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    step()
    cpu = time.process_time() - cpu
    dist.barrier()
    return time.perf_counter() - start, cpu


class _Schedcc:
    """schedcc's engine; `options` go to it (`p2p`, `mixed_precision`). `sent` counts the bytes
    of the tensors this rank sends to other stages."""

    def __init__(self, model, name: str, m: int, v: int, data, **options):
        segments = model.segments(NUM_STAGES * v)
        schedule = schedcc.get_schedule(name)(NUM_STAGES, m, v)
        program = schedcc.compile(schedule, tied=tied_groups(segments))
        self.engine = Engine(program, segments, model.loss_fn, _sgd, reduce_loss=False, **options)
        self.x, self.y = data
        self.instructions = max(len(ops) for ops in program.stages)
        self.sent = 0
        runtime = self.engine.runtime
        outgoing = runtime.outgoing

        def counted(op):
            message = outgoing(op)
            self.sent += sum(t.numel() * t.element_size() for t in message.tensors)
            return message

        runtime.outgoing = counted

    def step(self) -> None:
        self.engine.train_step(self.x, self.y)


class _Torch:
    def __init__(self, model, cls, m: int, v: int, data, rank: int):
        segments = model.segments(NUM_STAGES * v)
        mine = [rank + NUM_STAGES * c for c in range(v)]  # looped placement, as schedcc's
        self.stages = [
            tpp.PipelineStage(segments[k], k, NUM_STAGES * v, torch.device("cpu")) for k in mine
        ]
        stage = self.stages if v > 1 else self.stages[0]
        self.schedule = cls(stage, m, loss_fn=model.loss_fn)
        params = {id(p): p for k in mine for p in segments[k].parameters()}
        self.optimizer = _sgd(params.values())
        # a tie's copies live on both ranks (segments 0 and p*v - 1): its gradients are summed
        self.tied = [p for p, _ in find_ties(dict(enumerate(segments))) if id(p) in params]
        inputs, self.y = data
        self.x = inputs if isinstance(inputs, tuple) else (inputs,)
        self.rank = rank

    def step(self) -> None:
        if self.rank == 0:
            self.schedule.step(*self.x)
        else:
            self.schedule.step(target=self.y, losses=[])
        for param in self.tied:
            dist.all_reduce(param.grad)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class _DeepSpeed:
    """DeepSpeed's `PipelineEngine` on the same segments (one per stage), its own 1F1B
    `TrainSchedule`, fp32, no clipping, gloo; `train_batch` over the step's microbatches."""

    def __init__(self, model, m: int, data):
        import deepspeed
        from deepspeed.pipe import PipelineModule

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        deepspeed.init_distributed(dist_backend="gloo")  # the group already made
        module = PipelineModule(
            layers=model.segments(NUM_STAGES),
            num_stages=NUM_STAGES,
            loss_fn=model.loss_fn,
            partition_method="uniform",
        )
        config = {
            "train_micro_batch_size_per_gpu": model.batch // m,
            "gradient_accumulation_steps": m,
            "gradient_clipping": 0.0,
            "steps_per_print": 2**31,
        }
        self.engine, *_ = deepspeed.initialize(
            model=module, optimizer=_sgd(module.parameters()), config=config
        )
        x, y = data
        self.microbatches = itertools.cycle(
            list(zip(x.split(model.batch // m), y.split(model.batch // m)))
        )

    def step(self) -> None:
        self.engine.train_batch(data_iter=self.microbatches)


class _Floor:
    """Only this rank's own segments, forward + backward for every microbatch, then its step.

    Each segment's inputs are what the model computes for it (the chain run once, untimed); a
    segment other than the last backpropagates ones from its floating outputs."""

    def __init__(self, model, m: int, v: int, data, rank: int):
        segments = model.segments(NUM_STAGES * v)
        mine = [rank + NUM_STAGES * c for c in range(v)]
        self.mine = [segments[k] for k in mine]
        params = {id(p): p for s in self.mine for p in s.parameters()}
        self.optimizer = _sgd(params.values())
        inputs, targets = data
        self.inputs: list[list] = [[] for _ in mine]  # by chunk, by microbatch
        with torch.no_grad():
            for value in split(inputs, m):
                for k, segment in enumerate(segments):
                    if k in mine:
                        self.inputs[mine.index(k)].append(value)
                    value = call(segment, value)
        self.ys = split(targets, m)
        self.loss_fn, self.m = model.loss_fn, m
        self.last = rank == NUM_STAGES - 1
        #: Per step: (forward seconds per chunk, backward seconds per chunk, optimizer seconds).
        self.spent: list[tuple[list[float], list[float], float]] = []

    def step(self) -> None:
        clock = time.perf_counter
        forward, backward = [0.0] * len(self.mine), [0.0] * len(self.mine)
        for i, y in enumerate(self.ys):
            for c, segment in enumerate(self.mine):
                start = clock()
                out = call(segment, _fresh(self.inputs[c][i]))
                if self.last and c == len(self.mine) - 1:
                    outs, grads = [self.loss_fn(out, y) / self.m], None
                else:
                    outs = grad_tensors(flatten(out)[0])
                    grads = [torch.ones_like(t) for t in outs]
                middle = clock()
                torch.autograd.backward(outs, grads)
                forward[c] += middle - start
                backward[c] += clock() - middle
        start = clock()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.spent.append((forward, backward, clock() - start))

    def costs(self, m: int) -> tuple[list[tuple[float, float]], float]:
        """This rank's median seconds per forward and backward, by chunk, and per step."""
        per_chunk = [
            (
                statistics.median(f[c] for f, _, _ in self.spent) / m,
                statistics.median(b[c] for _, b, _ in self.spent) / m,
            )
            for c in range(len(self.mine))
        ]
        return per_chunk, statistics.median(t for _, _, t in self.spent)


def _fresh(value):
    """A segment's input as a stage receives it: floating tensors detached, requiring grad."""
    if isinstance(value, tuple):
        return tuple(_fresh(v) for v in value)
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().requires_grad_(True)
    return value


def _cost_model(stages: list[tuple[list[tuple[float, float]], float]]) -> CostModel:
    """Every stage's measured costs, no communication: what the simulator runs the schedule on."""
    per_stage = {
        s: CostModel(
            step=step,
            per_chunk={c: CostModel(forward=f, backward=b) for c, (f, b) in enumerate(chunks)},
        )
        for s, (chunks, step) in enumerate(stages)
    }
    return CostModel(per_stage=per_stage)


def _slowest(times: list[float]) -> list[float]:
    tensor = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def _row(rank: int, model, name: str, cls, v: int, m: int, opts) -> dict:
    data = model.data()
    ours = _Schedcc(model, name, m, v, data)
    runners = {
        "schedcc": ours,
        "gloo": _Schedcc(model, name, m, v, data, p2p="gloo"),
        "broadcast": _Schedcc(model, name, m, v, data, p2p="broadcast"),
        "nccl": _Schedcc(model, name, m, v, data, p2p="nccl"),
        "bf16": _Schedcc(model, name, m, v, data, mixed_precision=torch.bfloat16),
        "torch": _Torch(model, cls, m, v, data, rank),
        "floor": _Floor(model, m, v, data, rank),
    }
    if DEEPSPEED and name == "1f1b" and model.name == "mlp":
        runners["deepspeed"] = _DeepSpeed(model, m, data)
    for runner in runners.values():
        for _ in range(opts.warmup):
            _timed(runner.step)
    runners["floor"].spent.clear()
    times: dict[str, list[tuple[float, float]]] = {label: [] for label in runners}
    labels = list(runners)
    for turn in range(opts.rounds):
        # the order rotates each round: the runner after the floor measured 8-10% slower, so no
        # runner may always be the one that follows it
        k = turn % len(labels)
        for label in labels[k:] + labels[:k]:
            times[label] += [_timed(runners[label].step) for _ in range(opts.steps_per_round)]
    medians = {
        label: statistics.median(_slowest([wall for wall, _ in values]))
        for label, values in times.items()
    }
    cpu = {
        label: statistics.median(_slowest([seconds for _, seconds in values]))
        for label, values in times.items()
    }
    bubble = (NUM_STAGES - 1) / (v * m + NUM_STAGES - 1)
    ideal = medians["floor"] / (1 - bubble)
    stage_costs: list = [None] * NUM_STAGES
    dist.all_gather_object(stage_costs, runners["floor"].costs(m))
    # the schedule's own stretch over the busiest stage's work, from the floor's measured costs
    # with free communication: floor / (1 - bubble) where the bubble is the schedule's, not the
    # formula's (they differ where the order idles more than the formula assumes)
    # (eager: sends that never wait, as the engine runs over gloo; see [Note: eager simulation])
    makespan = simulate(ours.engine.program, _cost_model(stage_costs), eager=True).makespan
    work = max(m * sum(f + b for f, b in chunks) + step for chunks, step in stage_costs)
    simulated = medians["floor"] * makespan / work
    steps = opts.warmup + opts.rounds * opts.steps_per_round
    sent = {label: runners[label].sent / steps for label in ("schedcc", "bf16")}
    return {
        "row": f"{model.name} {name} m={m}" + (f" v={v}" if v > 1 else ""),
        "sent": sent,
        **medians,
        "bubble": bubble,
        "ideal": ideal,
        "simulated": simulated,
        "overhead_us": (medians["schedcc"] - ideal) / ours.instructions * 1e6,
        "cpu": cpu,
        "deepspeed": medians.get("deepspeed"),
    }


def _worker(rank: int, world_size: int, opts) -> int:
    torch.set_num_threads(1)
    if not opts.default_malloc:
        keep_freed_memory()  # every runner's: they share the process
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))  # DeepSpeed
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(60))
    rows = [
        _row(rank, MODELS[model], name, cls, v, m, opts)
        for model in opts.models
        for name, cls, v in ROWS
        if name in opts.schedules
        for m in opts.microbatches
    ]
    if rank == 0:
        _print(rows)
    dist.barrier()
    return 0


def _print(rows: list[dict]) -> None:
    header = (
        "| schedule | schedcc ms | torch ms | torch/schedcc | floor ms | analytic bubble | "
        "floor/(1-bubble) ms | schedcc/ideal | simulated ms | schedcc/simulated | "
        "overhead us/instr | schedcc gloo-p2p ms | "
        "CPU ms schedcc/gloo-p2p/torch/floor | broadcast-p2p ms | nccl-emulated ms | "
        "nccl-emulated/ideal | bf16 ms | deepspeed ms | deepspeed/schedcc | "
        "KiB sent per step, rank 0: fp32 / bf16 |"
    )
    print(stamp("step_time"))
    print(header)
    print("|" + "---|" * header.count(" | ") + "---|")
    for r in rows:
        print(
            f"| {r['row']} | {r['schedcc'] * 1e3:.2f} | {r['torch'] * 1e3:.2f} | "
            f"{r['torch'] / r['schedcc']:.2f} | {r['floor'] * 1e3:.2f} | {r['bubble']:.1%} | "
            f"{r['ideal'] * 1e3:.2f} | {r['schedcc'] / r['ideal']:.2f} | "
            f"{r['simulated'] * 1e3:.2f} | {r['schedcc'] / r['simulated']:.2f} | "
            f"{r['overhead_us']:.0f} | {r['gloo'] * 1e3:.2f} | {r['cpu']['schedcc'] * 1e3:.1f} / "
            f"{r['cpu']['gloo'] * 1e3:.1f} / {r['cpu']['torch'] * 1e3:.1f} / "
            f"{r['cpu']['floor'] * 1e3:.1f} | {r['broadcast'] * 1e3:.2f} | "
            f"{r['nccl'] * 1e3:.2f} | {r['nccl'] / r['ideal']:.2f} | "
            f"{r['bf16'] * 1e3:.2f} | {_deepspeed(r)} | {r['sent']['schedcc'] / 1024:.0f} / "
            f"{r['sent']['bf16'] / 1024:.0f} |",
            flush=True,
        )


def _deepspeed(row: dict) -> str:
    """The DeepSpeed columns: its ms and its time over schedcc's, or dashes where not run."""
    if row["deepspeed"] is None:
        return "- | -"
    return f"{row['deepspeed'] * 1e3:.2f} | {row['deepspeed'] / row['schedcc']:.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="turns per runner per row")
    parser.add_argument("--steps-per-round", type=int, default=1, help="timed steps per turn")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per runner")
    parser.add_argument(
        "--models",
        nargs="+",
        choices=list(MODELS),
        default=list(MODELS),
        help="models to run (default: all)",
    )
    parser.add_argument(
        "--schedules",
        nargs="+",
        choices=[name for name, _, _ in ROWS],
        default=[name for name, _, _ in ROWS],
        help="rows to run (default: all)",
    )
    parser.add_argument(
        "--microbatches",
        nargs="+",
        type=int,
        default=list(MICROBATCHES),
        help="microbatch counts per schedule (default: %(default)s)",
    )
    parser.add_argument(
        "--no-bind", action="store_true", help="leave ranks unbound (default: a core each)"
    )
    parser.add_argument(
        "--default-malloc",
        action="store_true",
        help="leave glibc's allocator trimming freed memory (default: kept, as schedcc run does)",
    )
    opts = parser.parse_args()
    return spawn(_worker, NUM_STAGES, (opts,), grace=120, threads=1, bind_cores=not opts.no_bind)


if __name__ == "__main__":
    raise SystemExit(main())
