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


def _worker(rank: int, world_size: int, directory: str) -> int:
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, P, TP), mesh_dim_names=("dp", "pp", "tp"))
    gen = torch.Generator().manual_seed(0)
    dense = [_Dense(gen) for _ in range(P)]
    plain = copy.deepcopy(dense)
    tp_group = mesh.get_group("tp")
    mine = [ParallelMLP.from_dense(d.first, d.second, tp_group) for d in dense]
    program = schedcc.compile(schedcc.get_schedule("1f1b")(P, 4), grad_norm=True)
    engine = Engine(program, mine, _mse, _adam, mesh=mesh, timeout=60, max_grad_norm=0.5)
    data = [(torch.randn(8, WIDTH, generator=gen), torch.randn(8, WIDTH, generator=gen))]
    data += [(torch.randn(8, WIDTH, generator=gen), torch.randn(8, WIDTH, generator=gen))]
    losses, norms = [], []
    for batch in data:
        losses.extend(engine.train([batch]))
        norms.append(engine.last_grad_norm)
    want_norms: list[float] = []
    want = train_reference(plain, _mse, _adam, data, max_grad_norm=0.5, grad_norms=want_norms)
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
    for got, expected in checks:
        assert torch.allclose(got, expected, atol=1e-9, rtol=0)
    engine.save(directory)
    assert os.path.exists(os.path.join(directory, f"stage{stage}-dp0-tp{t}.pt"))
    before = [p.detach().clone() for p in block.parameters()]
    with torch.no_grad():
        for p in block.parameters():
            p.zero_()
    engine.load(directory)
    assert all(torch.equal(a, p) for a, p in zip(before, block.parameters()))
    dist.barrier()
    return 0


def test_pipeline_of_tensor_parallel_stages_equals_dense_training():
    """gloo, 4 processes, mesh (dp=1, pp=2, tp=2), the user's column/row-parallel MLP per stage,
    clipped by the global norm: losses, norms and every shard equal dense non-pipelined
    training to 1e-9, and a checkpoint writes and restores one file per (stage, dp, tp)."""
    with tempfile.TemporaryDirectory() as directory:
        assert spawn(_worker, P * TP, (directory,), grace=60, threads=1) == 0
