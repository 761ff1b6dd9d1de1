"""GPU check (run on a CUDA machine): the local backend on CUDA against CPU, then `schedcc run`.

1. Every built-in schedule trains a float64 MLP for two steps on the local backend on CUDA and on
   the CPU from the same weights; the largest parameter difference is printed (and must be tiny).
2. `schedcc run` with NCCL, one process per visible GPU (p = the number of GPUs), with `--check`
   (float64, compared with non-pipelined training), then a float32 tiny-GPT run for its summary.

    python benchmarks/gpu_check.py
"""

from __future__ import annotations

import copy
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F
from _stamp import stamp

import schedcc
from schedcc.backends.local import Engine
from schedcc.backends.run import models

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


def _train(program, segments, batches, device):
    segments = [copy.deepcopy(s).to(device) for s in segments]
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
        gpu_losses, gpu_params = _train(program, segments, batches, "cuda")
        diff = max((a - b).abs().max().item() for a, b in zip(cpu_params, gpu_params))
        loss_diff = max(abs(a - b) for a, b in zip(cpu_losses, gpu_losses))
        print(
            f"local backend {name:17s} CUDA vs CPU (float64): params {diff:.2e}, "
            f"losses {loss_diff:.2e}",
            flush=True,
        )
        worst = max(worst, diff, loss_diff)
    return worst


def nccl_run() -> int:
    gpus = torch.cuda.device_count()
    common = [sys.executable, "-m", "schedcc", "run", "--no-progress", "-p", str(gpus)]
    codes = []
    for extra in (["--model", "mlp", "--steps", "4", "--check"], ["--steps", "20"]):
        print("$", " ".join(["schedcc run", "-p", str(gpus), *extra]), flush=True)
        # from a scratch directory, so `-m schedcc` finds the installed package, not ./schedcc
        with tempfile.TemporaryDirectory() as scratch:
            codes.append(subprocess.run(common + extra, timeout=300, cwd=scratch).returncode)
    return max(codes)


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    print(stamp("gpu_check"))
    print(
        f"torch {torch.__version__}, {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}",
        flush=True,
    )
    worst = local_on_cuda()
    code = nccl_run()
    ok = worst < 1e-10 and code == 0
    print(
        f"worst CUDA-vs-CPU difference {worst:.2e}; schedcc run exit {code}: "
        f"{'PASS' if ok else 'FAIL'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
