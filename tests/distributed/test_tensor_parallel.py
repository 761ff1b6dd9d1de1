"""The user's tensor parallelism on the distributed engine: a ("dp", "pp", "tp") mesh, each
stage a tensor-parallel group running Megatron-style column/row-parallel layers, equal to
non-pipelined, non-parallel training."""

from __future__ import annotations

import copy
import os
import tempfile
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

import schedcc
from schedcc.backends.distributed.engine import Engine
from schedcc.backends.reference import train_reference
from schedcc.backends.run.launch import spawn
from schedcc.backends.tensor_parallel import ParallelMLP

WIDTH, HIDDEN, P, TP = 4, 8, 2, 2


class _Dense(nn.Module):
    """The non-parallel block: `second(tanh(first(x)))`."""

    def __init__(self, gen: torch.Generator) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


def _adam(params):
    return torch.optim.Adam(params, lr=0.05)


def _mse(output, target):
    return torch.nn.functional.mse_loss(output, target)


def _worker(rank: int, world_size: int, directory: str, dp: int, p: int, zero: int) -> int:
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dp, p, TP), mesh_dim_names=("dp", "pp", "tp"))
    gen = torch.Generator().manual_seed(0)
    dense = [_Dense(gen) for _ in range(p)]
    plain = copy.deepcopy(dense)
    tp_group = mesh.get_group("tp")
    mine = [ParallelMLP.from_dense(d.first, d.second, tp_group) for d in dense]
    schedule = schedcc.get_schedule("1f1b")(p, 4)
    program = schedcc.compile(schedule, data_parallel=dp, zero=zero, grad_norm=True)
    engine = Engine(program, mine, _mse, _adam, groups=mesh, timeout=60, max_grad_norm=0.5)
    rows = 8 * dp  # the global batch; each data-parallel rank trains its own 8 rows
    data = [
        (torch.randn(rows, WIDTH, generator=gen), torch.randn(rows, WIDTH, generator=gen))
        for _ in range(2)
    ]
    d = mesh.get_local_rank("dp")
    losses, norms = [], []
    for x, y in data:
        losses.extend(engine.train([(x[8 * d : 8 * d + 8], y[8 * d : 8 * d + 8])]))
        norms.append(engine.last_grad_norm)
    want_norms: list[float] = []
    want = train_reference(plain, _mse, _adam, data, max_grad_norm=0.5, grad_norms=want_norms)
    assert norms == pytest.approx(want_norms, abs=1e-9, rel=1e-9), (norms, want_norms)
    assert losses == pytest.approx(want, abs=1e-9, rel=0)
    assert norms == pytest.approx(want_norms, abs=1e-9, rel=1e-9)
    assert min(want_norms) > 0.5  # the clipping acted
    stage, t = engine.stage, engine.tp_rank
    block, ref = mine[stage], plain[stage]
    checks = [
        (block.column.weight, ref.first.weight.chunk(TP, 0)[t]),
        (block.column.bias, ref.first.bias.chunk(TP, 0)[t]),
        (block.row.weight, ref.second.weight.chunk(TP, 1)[t]),
        (block.row.bias, ref.second.bias),
    ]
    with engine.unsharded():  # whole parameters under ZeRO-3 (a no-op below it)
        for got, expected in checks:
            assert torch.allclose(got, expected, atol=1e-9, rtol=0)
    if zero == 3:  # its checkpoints are tested in test_zero23.py
        return _barrier()
    engine.save(directory)
    assert os.path.exists(os.path.join(directory, f"stage{stage}-dp{d}-tp{t}.pt"))
    before = [p.detach().clone() for p in block.parameters()]
    with torch.no_grad():
        for p in block.parameters():
            p.zero_()
    engine.load(directory)
    assert all(torch.equal(a, p) for a, p in zip(before, block.parameters()))
    return _barrier()


def _barrier() -> int:
    dist.barrier()
    return 0


def test_pipeline_of_tensor_parallel_stages_equals_dense_training():
    """gloo, 4 processes, mesh (dp=1, pp=2, tp=2), the user's column/row-parallel MLP per stage,
    clipped by the global norm: losses, norms and every shard equal dense non-pipelined
    training to 1e-9, and a checkpoint writes and restores one file per (stage, dp, tp)."""
    with tempfile.TemporaryDirectory() as directory:
        assert spawn(_worker, P * TP, (directory, 1, P, 0), grace=60, threads=1) == 0


def test_tensor_parallel_under_zero_3_equals_dense_training():
    """gloo, 4 processes, mesh (dp=2, pp=1, tp=2) under ZeRO-3: each data-parallel rank shards
    its tensor-parallel slice, and the global norm leaves the replicated bias out of every
    tensor-parallel rank but the first by its whole size (a released parameter holds no data);
    clipped losses, norms and every slice equal dense training on the global batch to 1e-9."""
    with tempfile.TemporaryDirectory() as directory:
        assert spawn(_worker, 2 * TP, (directory, 2, 1, 3), grace=60, threads=1) == 0
