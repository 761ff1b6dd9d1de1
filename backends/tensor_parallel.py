"""Megatron-style tensor-parallel layers, the kind of user model the distributed engine runs
with `mesh=` dims ("dp", "pp", "tp") or `tp_group=` (DeepSpeed's "mpu" contract).

[Note: the user's tensor parallelism] schedcc does not split a layer itself: each stage of the
pipeline is a tensor-parallel group of ranks, every rank of it holding its shard of the stage's
segments and running the same program, with the group's collectives inside the layers' own
forward and backward. Point-to-point joins the ranks of the same tensor-parallel index on
neighbouring stages (each (dp, tp) pair has its own pipeline group); gradients are reduced over
the data-parallel group of the same (stage, tp); the gradient norm sums a parameter marked
`tensor_model_parallel = True` (Megatron's attribute: a shard) over the tensor-parallel ranks and
counts any other (replicated) once; checkpoints write one file per (stage, dp, tp).

`ColumnParallelLinear` keeps a block of rows of the full weight (output features) and returns its
block of the output; `RowParallelLinear` keeps a block of columns (input features), takes the
matching block of the input and all-reduces the partial products, adding its replicated bias
after. `ParallelMLP` is the two in a row, with `tanh` between, as Megatron's MLP is.

On every rank, with `tp_group` the ranks of its stage:

    >>> block = ParallelMLP.from_dense(dense_first, dense_second, tp_group)  # doctest: +SKIP
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ColumnParallelLinear", "ParallelMLP", "RowParallelLinear"]


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; the gradient summed over the tensor-parallel group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """Sum over the tensor-parallel group forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _shard(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if tensor.shape[dim] % size:
        raise ValueError(f"dimension {dim} of size {tensor.shape[dim]} does not split {size} ways")
    return tensor.detach().chunk(size, dim=dim)[rank].clone()


class ColumnParallelLinear(nn.Module):
    """`y[:, block] = x @ weight[block].T + bias[block]`: this rank's block of output features."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group) -> None:
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(weight)
        self.weight.tensor_model_parallel = True
        self.bias = None if bias is None else nn.Parameter(bias)
        if self.bias is not None:
            self.bias.tensor_model_parallel = True

    @classmethod
    def from_dense(cls, linear: nn.Linear, group) -> ColumnParallelLinear:
        """This rank's shard of a full `nn.Linear`."""
        bias = None if linear.bias is None else _shard(linear.bias, 0, group)
        return cls(_shard(linear.weight, 0, group), bias, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(_CopyToGroup.apply(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """`y = sum over ranks of x[:, block] @ weight[:, block].T, + bias` (the bias replicated)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group) -> None:
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(weight)
        self.weight.tensor_model_parallel = True
        self.bias = None if bias is None else nn.Parameter(bias)

    @classmethod
    def from_dense(cls, linear: nn.Linear, group) -> RowParallelLinear:
        """This rank's shard of a full `nn.Linear` (the whole bias)."""
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(_shard(linear.weight, 1, group), bias, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _ReduceFromGroup.apply(nn.functional.linear(x, self.weight), self.group)
        return out if self.bias is None else out + self.bias


class ParallelMLP(nn.Module):
    """`row(tanh(column(x)))`: Megatron's MLP over the tensor-parallel group."""

    def __init__(self, column: ColumnParallelLinear, row: RowParallelLinear) -> None:
        super().__init__()
        self.column, self.row = column, row

    @classmethod
    def from_dense(cls, first: nn.Linear, second: nn.Linear, group) -> ParallelMLP:
        """This rank's shard of `second(tanh(first(x)))`."""
        return cls(
            ColumnParallelLinear.from_dense(first, group),
            RowParallelLinear.from_dense(second, group),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.row(torch.tanh(self.column(x)))
