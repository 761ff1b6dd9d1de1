"""GPU check (run on a CUDA machine): exactness, host syncs per step, overhead, NCCL.

1. Every built-in schedule trains a float64 MLP for two steps on the local backend on CUDA and on
   the CPU from the same weights; the largest parameter difference is printed (and must be tiny).
2. Host syncs per step: the local engine on CUDA (1f1b, p = 4, m = 8), counted both by
   `torch.cuda.set_sync_debug_mode` (warnings) and by the engines' own counter ([Note: host
   syncs] in `backends/runtime/syncs.py`), steady steps only, with the loss read (one each) and
   with `read_loss=False` (none each).
3. Overhead on one GPU: a ~110M GPT (12 blocks, 768 wide, vocab 32768, 512 tokens) in 4
   segments, 1f1b m = 8 on the local engine, against plain training of the same model with 8
   microbatches of gradient accumulation, fp32 and bf16 (target: schedcc / plain <= 1.05).
4. Overlapped pairs on one GPU: dualpipe-v (p = 2, m = 8) on the same GPT in bf16, each
   pair's halves on two CUDA streams (the default) against a handler that runs them in order
   (`engine.register_handler(OverlappedBackward, ...)`): seconds per step each, and their ratio.
5. With 2 or more GPUs: the NCCL path (`p2p="nccl"`) over one rank per GPU, float64, against the
   local engine on the CPU, with its host syncs per step, the loss read and not; then `schedcc
   run` with NCCL, one process per GPU, with `--check`, and a float32 tiny-GPT run for its
   summary (with one GPU, `schedcc run -p 1` only: NCCL allows one rank per GPU).

Each part runs even when one before it failed (its traceback is printed and the check FAILs).
`--smoke` runs the same code on the CPU with a tiny GPT, to check the script itself here.

    python benchmarks/gpu_check.py [--quick] [--smoke] [--only exact syncs gpt pairs nccl]
"""

from __future__ import annotations

import argparse
import copy
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from datetime import timedelta

import torch
import torch.nn.functional as F
from _stamp import stamp

import schedcc
from schedcc.backends.local import Engine
from schedcc.backends.reference import Chain
from schedcc.backends.run import models
from schedcc.backends.run.gpt import GPT, GPTConfig, gpt_segments, mean_token_loss
from schedcc.backends.run.launch import spawn
from schedcc.backends.runtime.syncs import HostSyncs
from schedcc.backends.runtime.tied import tied_groups

SHAPES = {
    "gpipe": (2, 4, 1, 1),
    "1f1b": (2, 4, 1, 1),
    "interleaved-1f1b": (2, 4, 2, 1),
    "2bw": (2, 4, 1, 2),
    "zb-h1": (2, 4, 1, 1),
    "zb-v": (2, 4, 2, 1),
    "zb-h2": (2, 4, 1, 1),
    "looped-bfs": (2, 4, 2, 1),
    "interleaved-zb": (2, 4, 2, 1),
    "dualpipe-v": (2, 4, 2, 1),
    "v-half": (2, 4, 2, 1),
    "v-min": (2, 4, 2, 1),
    "dualpipe": (2, 4, 2, 1),
}

DEVICE = "cuda"  # `--smoke`: "cpu"
GPT_CONFIG = GPTConfig(vocab=32768, max_len=512, d_model=768, num_heads=12, num_blocks=12)
SMOKE_CONFIG = GPTConfig(vocab=64, max_len=16, d_model=32, num_heads=2, num_blocks=4)


def _train(program, segments, batches, device):
    # one deepcopy of the list keeps a segment listed twice (dualpipe's replicas) one module
    segments = [s.to(device) for s in copy.deepcopy(segments)]
    engine = Engine(program, segments, F.mse_loss, lambda ps: torch.optim.Adam(ps, lr=1e-2))
    losses = list(engine.train([(x.to(device), y.to(device)) for x, y in batches]))
    return losses, [p.detach().cpu() for s in segments for p in s.parameters()]


def local_on_cuda() -> float:
    worst = 0.0
    for name, (p, m, v, per_run) in SHAPES.items():
        program = schedcc.compile(schedcc.get_schedule(name)(p, m, v, per_run))
        replicas = schedcc.get_schedule(name).num_replicas  # dualpipe: the same modules twice
        segments = models.mlp_segments(p * v // replicas, width=32, seed=0)
        segments = [s.double() for s in segments] * replicas
        data = models.TeacherData(width=32, seed=1)
        batches = [tuple(t.double() for t in data.batch(16, step)) for step in range(2 * per_run)]
        cpu_losses, cpu_params = _train(program, segments, batches, "cpu")
        gpu_losses, gpu_params = _train(program, segments, batches, DEVICE)
        diff = max((a - b).abs().max().item() for a, b in zip(cpu_params, gpu_params))
        loss_diff = max(abs(a - b) for a, b in zip(cpu_losses, gpu_losses))
        print(
            f"local backend {name:17s} CUDA vs CPU (float64): params {diff:.2e}, "
            f"losses {loss_diff:.2e}",
            flush=True,
        )
        worst = max(worst, diff, loss_diff)
    return worst


def _counted(step) -> tuple[int | None, int]:
    """Run `step()`; (syncs CUDA reported, host reads the engines counted) during it."""
    before = HostSyncs.count
    if DEVICE != "cuda":
        step()
        return None, HostSyncs.count - before
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cuda = sum("synchroniz" in str(w.message) for w in caught)
    return cuda, HostSyncs.count - before


def syncs_per_step() -> None:
    program = schedcc.compile(schedcc.get_schedule("1f1b")(4, 8))
    segments = [s.to(DEVICE) for s in models.mlp_segments(4, width=256, seed=0)]
    engine = Engine(program, segments, F.mse_loss, lambda ps: torch.optim.Adam(ps, lr=1e-3))
    data = models.TeacherData(width=256, seed=1)
    batches = [tuple(t.float().to(DEVICE) for t in data.batch(64, step)) for step in range(10)]
    for x, y in batches[:2]:
        engine.train_step(x, y)
    for read in (True, False):
        steady = batches[2:6] if read else batches[6:]
        counts = [
            _counted(lambda x=x, y=y, r=read: engine.train_step(x, y, read_loss=r))
            for x, y in steady
        ]
        print(
            f"local engine on {DEVICE}, 1f1b p=4 m=8, steady steps, read_loss={read}: syncs per "
            f"step (CUDA's count, the engine's) {counts}",
            flush=True,
        )


def _gpt(seed: int = 0) -> GPT:
    return GPT(GPT_CONFIG, seed=seed).to(DEVICE)


def _gpt_batch(rows: int, step: int):
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, GPT_CONFIG.vocab, (rows, GPT_CONFIG.max_len + 1), generator=gen)
    pad_mask = torch.zeros(rows, GPT_CONFIG.max_len, dtype=torch.bool)
    return (tokens[:, :-1].to(DEVICE), pad_mask.to(DEVICE)), tokens[:, 1:].to(DEVICE)


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _timed(step, count: int) -> float:
    _sync()
    start = time.perf_counter()
    for n in range(count):
        step(n)
    _sync()
    return (time.perf_counter() - start) / count


def _kernel_ms(step) -> float:
    """Milliseconds of GPU kernels in one `step()` (the kernels' own rows: an operator's row
    counts its kernels' time again)."""
    if DEVICE != "cuda":
        return 0.0
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        step()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    rows = prof.key_averages()
    return sum(e.self_device_time_total for e in rows if e.device_type == cuda) / 1e3


def gpt_overhead(dtype: torch.dtype, steps: int, rows: int = 32) -> float:
    """schedcc's local engine over plain gradient accumulation (the loss read each step), a
    batch of `rows` sequences in 8 microbatches; and the host syncs of an unread step (the
    GPT's tied head included)."""
    m = 8
    model = _gpt()
    segments = gpt_segments(model, 4)
    program = schedcc.compile(schedcc.get_schedule("1f1b")(4, m), tied=tied_groups(segments))
    mixed = None if dtype == torch.float32 else dtype
    adam = lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True)  # noqa: E731
    engine = Engine(program, segments, mean_token_loss, adam, mixed_precision=mixed)
    batches = [_gpt_batch(rows, step) for step in range(steps + 2)]
    engine.train_step(*batches[0])
    ours = _timed(lambda n, e=engine: e.train_step(*batches[1 + n % steps]), steps)
    unread = _timed(
        lambda n, e=engine: e.train_step(*batches[1 + n % steps], read_loss=False), steps
    )
    our_kernels = _kernel_ms(lambda e=engine: e.train_step(*batches[1], read_loss=False))
    syncs = _counted(lambda e=engine: e.train_step(*batches[1], read_loss=False))
    del engine, segments, model  # free the GPU for the plain copy
    plain = Chain(gpt_segments(_gpt(), 4))
    optimizer = adam(plain.parameters())

    def accumulate(n: int) -> None:
        (tokens, pad_mask), targets = batches[1 + n % steps]
        for mb in range(m):
            part = slice(mb * rows // m, (mb + 1) * rows // m)
            with torch.autocast(DEVICE, dtype=dtype, enabled=mixed is not None):
                out = plain((tokens[part], pad_mask[part]))
            (mean_token_loss(out.float(), targets[part]) / m).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    accumulate(0)
    theirs = _timed(accumulate, steps)
    their_kernels = _kernel_ms(lambda: accumulate(0))
    name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    print(
        f"GPT {sum(p.numel() for p in plain.parameters()) / 1e6:.0f}M, 4 segments, 1f1b m={m}, "
        f"{name}, microbatches of {rows // m} x {GPT_CONFIG.max_len} tokens, one {DEVICE} device: "
        f"schedcc {ours * 1e3:.1f} ms (read_loss=False {unread * 1e3:.1f} ms; kernels "
        f"{our_kernels:.1f} ms), plain accumulation {theirs * 1e3:.1f} ms (kernels "
        f"{their_kernels:.1f} ms), schedcc/plain {ours / theirs:.3f} ({unread / theirs:.3f} "
        f"unread); syncs in an unread step (CUDA's, the engine's) {syncs}",
        flush=True,
    )
    return ours / theirs


def _nccl_rank(rank: int, world_size: int) -> int:
    from schedcc.backends.distributed import Engine as DistributedEngine

    torch.cuda.set_device(rank)
    torch.distributed.init_process_group(
        "nccl", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    worst = 0.0
    for name, (_, m, v, per_run) in SHAPES.items():
        schedule = schedcc.get_schedule(name)(world_size, m, v, per_run)
        program = schedcc.compile(schedule)
        replicas = type(schedule).num_replicas
        parts = models.mlp_segments(world_size * v // replicas, width=32, seed=0)
        parts = [s.double() for s in parts]
        data = models.TeacherData(width=32, seed=1)
        batches = [tuple(t.double() for t in data.batch(16, step)) for step in range(6 * per_run)]
        oracle = Engine(program, copy.deepcopy(parts) * replicas, F.mse_loss, _adam)
        expected = list(oracle.train(batches))
        segments = [s.cuda() for s in copy.deepcopy(parts)] * replicas
        engine = DistributedEngine(program, segments, F.mse_loss, _adam, timeout=60)
        cuda_batches = [(x.cuda(), y.cuda()) for x, y in batches]
        losses = list(engine.train(cuda_batches[: 2 * per_run]))
        read, unread = cuda_batches[2 * per_run : 4 * per_run], cuda_batches[4 * per_run :]
        steady = _counted(lambda e=engine, got=losses, b=read: got.extend(e.train(b)))
        tensors: list = []
        quiet = _counted(
            lambda e=engine, got=tensors, b=unread: got.extend(e.train(b, read_loss=False))
        )
        losses += [t.item() for t in tensors]
        diff = max(abs(a - b) for a, b in zip(losses, expected))
        worst = max(worst, diff)
        if rank == 0:
            print(
                f"NCCL path {name:17s} p={world_size} ({engine.point_to_point}): losses vs CPU "
                f"{diff:.2e}; steady syncs (CUDA's, the engine's) over {2 * per_run} steps "
                f"{steady}, with read_loss=False {quiet}",
                flush=True,
            )
    return 0 if worst < 1e-10 else 1


def _adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def nccl_path() -> int:
    gpus = torch.cuda.device_count()
    if gpus < 2:
        print("NCCL path over ranks: not run (one GPU; NCCL needs a GPU per rank)")
        return 0
    return spawn(_nccl_rank, gpus, grace=60, method="spawn")


def nccl_run() -> int:
    """`schedcc run` under NCCL, one process per GPU (p = 1 with one GPU: no point-to-point)."""
    gpus = torch.cuda.device_count()
    common = [sys.executable, "-m", "schedcc", "run", "--no-progress", "-p", str(gpus)]
    # from a scratch directory, so `-m schedcc` finds the installed package, not ./schedcc
    codes = []
    for extra in (["--model", "mlp", "--steps", "4", "--check"], ["--steps", "20"]):
        print("$", " ".join(["schedcc run", "-p", str(gpus), *extra]), flush=True)
        with tempfile.TemporaryDirectory() as scratch:
            run = subprocess.run(common + extra, timeout=150, cwd=scratch)
        codes.append(run.returncode)
    return max(codes)


def pair_overlap(steps: int, rows: int = 256) -> float:
    """dualpipe-v's step time with its pairs on two streams over in order (< 1: overlap pays),
    microbatches of `rows / 8` sequences (large enough that the GPU, not the host, bounds it)."""
    m = 8
    batch = _gpt_batch(rows, 0)
    times = {}
    for name in ("two streams", "in order"):
        segments = gpt_segments(_gpt(), 4)
        schedule = schedcc.get_schedule("dualpipe-v")(2, m, 2)
        program = schedcc.compile(schedule, tied=tied_groups(segments))
        adam = lambda ps: torch.optim.AdamW(ps, lr=1e-4)  # noqa: E731
        mixed = torch.bfloat16 if DEVICE == "cuda" else None
        engine = Engine(program, segments, mean_token_loss, adam, mixed_precision=mixed)
        if name == "in order":
            engine.register_handler(
                schedcc.OverlappedBackward, lambda pair: (pair.run_forward(), pair.run_backward())
            )
        engine.train_step(*batch)
        times[name] = _timed(lambda n, e=engine: e.train_step(*batch), steps)
        del engine, segments
    ratio = times["two streams"] / times["in order"]
    print(
        f"dualpipe-v p=2 m={m}, GPT, microbatches of {rows // m}, one {DEVICE} device: pairs on "
        f"two streams {times['two streams'] * 1e3:.1f} ms, in order "
        f"{times['in order'] * 1e3:.1f} ms, ratio {ratio:.3f}",
        flush=True,
    )
    return ratio


def _part(name: str, check, failed: list[str]):
    """`check()`, or None (with its traceback printed) when it raises: the parts after it run."""
    try:
        return check()
    except Exception:  # a benchmark reports every part it can
        traceback.print_exc()
        print(f"{name}: FAILED (above)", flush=True)
        failed.append(name)
        return None


def main() -> int:
    global DEVICE, GPT_CONFIG
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer timed GPT steps")
    parser.add_argument("--smoke", action="store_true", help="on the CPU, a tiny GPT, no NCCL")
    parts = ("exact", "syncs", "gpt", "pairs", "nccl")
    parser.add_argument("--only", nargs="+", choices=parts, default=parts, help="these parts")
    opts = parser.parse_args()
    if opts.smoke:
        DEVICE, GPT_CONFIG = "cpu", SMOKE_CONFIG
    elif not torch.cuda.is_available():
        print("no CUDA device: nothing to check (--smoke runs the script on the CPU)")
        return 2
    print(stamp("gpu_check"))
    where = (
        "the CPU"
        if opts.smoke
        else (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
    )
    print(f"torch {torch.__version__}, {where}", flush=True)
    steps = 1 if opts.smoke else 3 if opts.quick else 6
    failed: list[str] = []
    worst = overlap = None
    ratios: list = [None] * 4
    codes: list = []
    if "exact" in opts.only:
        worst = _part("CUDA against CPU", local_on_cuda, failed)
    if "syncs" in opts.only:
        _part("host syncs", syncs_per_step, failed)
    if "gpt" in opts.only:
        ratios = [
            _part(f"GPT {dtype}", lambda d=dtype, r=rows: gpt_overhead(d, steps, r), failed)
            for rows in (32, 256)
            for dtype in (torch.float32, torch.bfloat16)
        ]
    if "pairs" in opts.only:
        overlap = _part("overlapped pairs", lambda: pair_overlap(steps), failed)
    if "nccl" in opts.only and not opts.smoke:
        codes = [_part(f.__name__, f, failed) for f in (nccl_path, nccl_run)]
    if worst is not None and worst >= 1e-10:
        failed.append(f"CUDA against CPU differs by {worst:.2e}")
    failed += [f"exit {code}" for code in codes if code]

    def shown(x, form=".3f"):
        return "-" if x is None else format(x, form)

    print(
        f"worst CUDA-vs-CPU difference {shown(worst, '.2e')}; GPT schedcc/plain, microbatches "
        f"of 4 and 32 sequences: fp32 {shown(ratios[0])} and {shown(ratios[2])}, bf16 "
        f"{shown(ratios[1])} and {shown(ratios[3])} (target <= 1.05); pairs on two streams / "
        f"in order {shown(overlap)}; {'FAIL: ' + ', '.join(failed) if failed else 'PASS'}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
