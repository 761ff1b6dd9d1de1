"""On the distributed backend a checkpoint is refused on every rank together: when one rank's
shard does not fit, no rank loads anything, every rank raises `CheckpointError` naming the
rank and the problem, and training goes on exactly as if the load had not been tried (2 gloo
processes on 127.0.0.1)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

# Each rank trains a step and saves `before`; rank 0 then writes `bad`, a copy whose stage-1
# shard holds an Adam moment of the wrong shape. Every rank tries `bad` (refused everywhere,
# nothing changed), trains a step, then loads `before` and trains the same step again: the
# same loss and the same parameters prove the refused load left the engine as it was.
_WORKER = textwrap.dedent(
    """
    import json, shutil, sys
    from datetime import timedelta
    from pathlib import Path
    import torch
    import torch.distributed as dist
    import schedcc
    from schedcc.backends.checkpoint import files as ckpt
    from schedcc.backends.distributed.engine import Engine
    from schedcc.backends.run.launch import spawn
    from schedcc.errors import CheckpointError

    ROOT = Path(sys.argv[1])

    def snapshot(engine):
        state = engine.runtime.optimizer.state_dict()["state"]
        return (
            [t.detach().clone() for m in engine.modules for t in m.state_dict().values()],
            {k: {n: v.clone() for n, v in e.items()} for k, e in state.items()},
            torch.get_rng_state(),
            engine.steps,
        )

    def same(a, b):
        params = all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True))
        optim = a[1].keys() == b[1].keys() and all(
            a[1][k].keys() == b[1][k].keys() and all(torch.equal(a[1][k][n], b[1][k][n])
            for n in a[1][k]) for k in a[1]
        )
        return params and optim and torch.equal(a[2], b[2]) and a[3] == b[3]

    def spoil(directory):
        name = ckpt.shard_name(1, 0)
        state = torch.load(directory / name, weights_only=True)
        entry = state["optimizer"]["state"][0]
        entry["exp_avg"] = entry["exp_avg"].reshape(-1)
        torch.save(state, directory / name)
        manifest = json.loads((directory / ckpt.MANIFEST).read_text())
        manifest["files"][name] = {
            "size": (directory / name).stat().st_size,
            "sha256": ckpt._sha256(directory / name),
        }
        (directory / ckpt.MANIFEST).write_text(json.dumps(manifest))

    def worker(rank, world):
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
        torch.manual_seed(0)
        segments = [torch.nn.Linear(6, 6, dtype=torch.float64) for _ in range(2)]
        program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 2))
        engine = Engine(
            program,
            segments,
            torch.nn.functional.mse_loss,
            lambda params: torch.optim.Adam(params, lr=0.01),
            timeout=60,
        )
        gen = torch.Generator().manual_seed(1)
        batches = [
            tuple(torch.randn(4, 6, generator=gen, dtype=torch.float64) for _ in range(2))
            for _ in range(2)
        ]
        engine.train_step(*batches[0])
        engine.save(ROOT / "before")
        if rank == 0:
            shutil.copytree(ROOT / "before", ROOT / "bad")
            spoil(ROOT / "bad")
        dist.barrier()
        kept = snapshot(engine)
        try:
            engine.load(ROOT / "bad")
        except CheckpointError as exc:
            print(f"rank {rank} refused: {exc}", flush=True)
        else:
            print(f"rank {rank} loaded the bad checkpoint", flush=True)
        print(f"rank {rank} unchanged: {same(kept, snapshot(engine))}", flush=True)
        loss = engine.train_step(*batches[1])
        after = snapshot(engine)
        engine.load(ROOT / "before")
        again = engine.train_step(*batches[1])
        print(f"rank {rank} trains on alike: {loss == again and same(after, snapshot(engine))}")
        return 0

    if __name__ == "__main__":
        sys.exit(spawn(worker, 2, grace=30.0))
    """
)


def test_one_ranks_bad_shard_is_refused_on_every_rank_and_nothing_changes(tmp_path):
    """Stage 1's shard does not fit (an optimizer moment of another shape); rank 0's does.
    Both ranks raise `CheckpointError` naming rank 1's problem, neither changes its
    parameters, optimizer state, RNG state or step count, and training goes on exactly."""
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # the ranks too, whatever happened
    assert proc.returncode == 0, err
    for rank in (0, 1):
        assert (
            f"rank {rank} refused: rank 1 (stage 1): stage1-dp0.pt: optimizer state 'exp_avg' of "
            "parameter 0 has shape (36,), the parameter (6, 6)"
        ) in out, out
        assert f"rank {rank} unchanged: True" in out, out
        assert f"rank {rank} trains on alike: True" in out, out
