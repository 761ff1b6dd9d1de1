"""Megatron-style tensor-parallel layers, the kind of user model the distributed engine runs
with `groups=` a mesh of dims ("dp", "pp", "tp") or `Groups(pp=, dp=, tp=)` (DeepSpeed's "mpu"
contract).

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
after. `ParallelMLP` is the two in a row, an activation between, as Megatron's MLP is;
`ParallelBlock` splits a transformer block's attention by heads; `shard_layers` turns a stack
of layers into these (`schedcc run --tp`).

On every rank, with `tp_group` the ranks of its stage:

    >>> block = ParallelMLP.from_dense(dense_first, dense_second, tp_group)  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "ColumnParallelLinear",
    "ParallelBlock",
    "ParallelGPTBlock",
    "ParallelMLP",
    "RowParallelLinear",
    "shard_layers",
]

#: The elementwise activations `shard_layers` finds between two linear layers.
_ELEMENTWISE = (nn.Tanh, nn.GELU, nn.ReLU)


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


def _place(group, rank: int | None, size: int | None) -> tuple[int, int]:
    """This rank's index and the group's size (given, for a shard made without a group)."""
    if rank is not None and size is not None:
        return rank, size
    return dist.get_rank(group), dist.get_world_size(group)


def _shard(tensor: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
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
    def from_dense(cls, linear: nn.Linear, group, *, rank=None, size=None) -> ColumnParallelLinear:
        """This rank's shard of a full `nn.Linear` (`rank`/`size` in place of a group's)."""
        rank, size = _place(group, rank, size)
        bias = None if linear.bias is None else _shard(linear.bias, 0, rank, size)
        return cls(_shard(linear.weight, 0, rank, size), bias, group)

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
    def from_dense(cls, linear: nn.Linear, group, *, rank=None, size=None) -> RowParallelLinear:
        """This rank's shard of a full `nn.Linear` (the whole bias)."""
        rank, size = _place(group, rank, size)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(_shard(linear.weight, 1, rank, size), bias, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _ReduceFromGroup.apply(nn.functional.linear(x, self.weight), self.group)
        return out if self.bias is None else out + self.bias


class ParallelMLP(nn.Module):
    """`row(activation(column(x)))`: Megatron's MLP over the tensor-parallel group."""

    def __init__(
        self,
        column: ColumnParallelLinear,
        row: RowParallelLinear,
        activation: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.column, self.row = column, row
        self.activation = activation if activation is not None else nn.Tanh()

    @classmethod
    def from_dense(
        cls, first: nn.Linear, second: nn.Linear, group, activation=None, *, rank=None, size=None
    ) -> ParallelMLP:
        """This rank's shard of `second(activation(first(x)))` (default activation: tanh)."""
        return cls(
            ColumnParallelLinear.from_dense(first, group, rank=rank, size=size),
            RowParallelLinear.from_dense(second, group, rank=rank, size=size),
            copy.deepcopy(activation),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.row(self.activation(self.column(x)))


class ParallelBlock(nn.Module):
    """A pre-norm transformer block (`backends.run.models.Block`'s math) over the tensor-parallel
    group: attention by blocks of heads (q, k and v column-parallel by head, the output
    projection row-parallel) and a `ParallelMLP`; the layer norms replicated."""

    def __init__(self, block: nn.Module, group, *, rank=None, size=None) -> None:
        super().__init__()
        rank, size = _place(group, rank, size)
        if block.num_heads % size:
            raise ValueError(f"{block.num_heads} attention heads do not split {size} ways")
        self.group = group
        self.num_heads = block.num_heads // size
        self.norm1, self.norm2 = copy.deepcopy(block.norm1), copy.deepcopy(block.norm2)
        width = block.qkv.in_features
        q, k, v = (t.detach() for t in block.qkv.weight.split(width, dim=0))
        bq, bk, bv = (t.detach() for t in block.qkv.bias.split(width, dim=0))
        weight = torch.cat([_shard(t, 0, rank, size) for t in (q, k, v)])
        bias = torch.cat([_shard(t, 0, rank, size) for t in (bq, bk, bv)])
        self.qkv = ColumnParallelLinear(weight, bias, group)
        self.proj = RowParallelLinear.from_dense(block.proj, group, rank=rank, size=size)
        first, activation, second = block.mlp
        self.mlp = ParallelMLP.from_dense(first, second, group, activation, rank=rank, size=size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        local = q.shape[-1]
        shape = (batch, seq, self.num_heads, local // self.num_heads)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(shape[-1])
        mask = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        attn = scores.masked_fill(mask, float("-inf")).softmax(dim=-1) @ v
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, local))
        return x + self.mlp(self.norm2(x))


class ParallelGPTBlock(ParallelBlock):
    """`backends.run.gpt.Block` (rotary positions, a padding mask, dropout) over the
    tensor-parallel group, split as `ParallelBlock` is."""

    def __init__(self, block: nn.Module, group, *, rank=None, size=None) -> None:
        super().__init__(block, group, rank=rank, size=size)
        self.drop = copy.deepcopy(block.drop)

    def forward(self, x: torch.Tensor, pad_mask: torch.Tensor, pos_ids: torch.Tensor):
        return self.forward_part(x, pad_mask, pos_ids, None)[0]

    def forward_part(self, x, pad_mask: torch.Tensor, pos_ids: torch.Tensor, past):
        """`Block.forward_part` over the group: the carry holds this rank's heads' keys and
        values."""
        from schedcc.backends.run.gpt import attend_part

        batch, seq, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        local = q.shape[-1]
        shape = (batch, seq, self.num_heads, local // self.num_heads)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))
        attn, seen = attend_part(q, k, v, pad_mask, pos_ids, self.drop, past)
        x = x + self.drop(self.proj(attn.transpose(1, 2).reshape(batch, seq, local)))
        return x + self.drop(self.mlp(self.norm2(x))), seen


def _is_gpt_segment(module: nn.Module) -> bool:
    """A `backends.run.gpt.GPTSegment`: its blocks take `(x, pad_mask, pos_ids)`."""
    from schedcc.backends.run.gpt import Block

    blocks = getattr(module, "blocks", None)
    return isinstance(blocks, nn.ModuleList) and any(isinstance(b, Block) for b in blocks)


def _shard_gpt_segment(segment: nn.Module, group, rank, size) -> nn.Module:
    """`segment` with each block a `ParallelGPTBlock`; its embeddings, norm and head are the
    same modules (replicated), so a tied embedding and head stay one Parameter."""
    out = copy.copy(segment)
    out._modules = dict(segment._modules)  # the original keeps its dense blocks
    out.blocks = nn.ModuleList(
        ParallelGPTBlock(block, group, rank=rank, size=size) for block in segment.blocks
    )
    return out


def _is_block(module: nn.Module) -> bool:
    """A pre-norm attention block as `backends.run.models.Block` is made."""
    names = ("norm1", "qkv", "proj", "norm2", "mlp", "num_heads")
    return all(hasattr(module, name) for name in names) and len(getattr(module, "mlp", ())) == 3


def shard_layers(module: nn.Module, group, *, rank=None, size=None) -> nn.Module:
    """This rank's tensor-parallel version of a stack of layers (a `backends.run.gpt.GPTSegment`:
    its blocks as `ParallelGPTBlock`s, the rest shared): `module`'s leaf layers in order
    (through nested `nn.Sequential`s), each run `Linear, activation, Linear` (tanh, GELU or ReLU)
    as a `ParallelMLP`, each attention block (`backends.run.models.Block`) as a `ParallelBlock`,
    anything else a replicated copy. `rank` and `size` stand in for the
    group's to make a shard without one (to compare with the trained shards).

    Raises:
        ValueError: a paired linear layer's features do not split `size` ways.
    """
    if _is_gpt_segment(module):
        return _shard_gpt_segment(module, group, rank, size)
    leaves = list(_leaves(module))
    out: list[nn.Module] = []
    i = 0
    while i < len(leaves):
        run = leaves[i : i + 3]
        if (
            len(run) == 3
            and isinstance(run[0], nn.Linear)
            and isinstance(run[1], _ELEMENTWISE)
            and isinstance(run[2], nn.Linear)
        ):
            first, activation, second = run
            out.append(
                ParallelMLP.from_dense(first, second, group, activation, rank=rank, size=size)
            )
            i += 3
        elif _is_block(leaves[i]):
            out.append(ParallelBlock(leaves[i], group, rank=rank, size=size))
            i += 1
        else:
            out.append(copy.deepcopy(leaves[i]))
            i += 1
    return nn.Sequential(*out)


def _leaves(module: nn.Module):
    if isinstance(module, nn.Sequential):
        for child in module:
            yield from _leaves(child)
    else:
        yield module
