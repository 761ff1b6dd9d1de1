"""The shape pass of the distributed backend: point-to-point tensors with their metadata.

[Note: shapes are learnt once] A receive needs a buffer of the right shape and dtype. On the first
run, before any instruction, a *shape pass* pushes microbatch 0 forward through the segments in
model order without autograd (and without touching the RNG), each stage sending the next a small
metadata tensor and the activation itself; every stage then knows the shape of every activation
it receives, and of every gradient (the gradient of an activation has its shape). Nothing but the
tensors themselves is sent afterwards; a send whose shape differs from the learnt one raises.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from schedcc.semantics import Layout

__all__ = ["Shapes", "learn_shapes", "recv_tensor", "send_tensor"]

#: What a receive needs, keyed by ("A", segment): the activation's shape and dtype.
Shapes = dict[tuple[str, int], tuple[tuple[int, ...], torch.dtype]]

_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_MAX_DIMS = 8


def learn_shapes(
    layout: Layout,
    stage: int,
    modules: Sequence[Callable[[torch.Tensor], torch.Tensor]],
    first_inputs: Sequence[torch.Tensor] | None,
    *,
    peer: Mapping[int, int],
    pp_group,
    device: torch.device,
) -> Shapes:
    """Run the shape pass on `stage` (collective over the pipeline process group
    `pp_group`); the shapes it receives or sends.

    `modules` are the stage's segments by chunk, `peer[s]` the global rank of stage `s`.
    """
    shapes: Shapes = {}
    dist.barrier(group=pp_group)
    devices = [device] if device.type == "cuda" else []
    held: torch.Tensor | None = None
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        for k in range(layout.last):
            producer, consumer = layout.stage_of[k], layout.stage_of[k + 1]
            if producer == stage:
                if k == 0:
                    if not first_inputs:
                        raise ValueError(f"stage {stage} holds segment 0 but got no inputs")
                    held = first_inputs[0]
                held = modules[layout.chunk_of[k]](held)
                if consumer != stage:
                    send_tensor(held, stage, peer[consumer], pp_group, device)
            elif consumer == stage:
                held = recv_tensor(peer[producer], pp_group, device)
            if stage in (producer, consumer):
                shapes["A", k] = (tuple(held.shape), held.dtype)
    dist.barrier(group=pp_group)
    return shapes


def send_tensor(
    tensor: torch.Tensor, stage: int, peer: int, pp_group, device: torch.device
) -> None:
    """Send `tensor` from `stage` to the global rank `peer`: its metadata, then its data."""
    if tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPES:
        raise ValueError(
            f"stage {stage} sends a {tensor.dim()}-d {tensor.dtype} activation; the "
            f"distributed backend moves tensors of up to {_MAX_DIMS} dims of {_DTYPES}"
        )
    meta = [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
    meta += [0] * (2 + _MAX_DIMS - len(meta))
    dist.send(torch.tensor(meta, dtype=torch.int64, device=device), peer, pp_group)
    dist.send(tensor.contiguous(), peer, pp_group)


def recv_tensor(peer: int, pp_group, device: torch.device) -> torch.Tensor:
    """Receive what `send_tensor` sent from the global rank `peer`."""
    meta = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=device)
    dist.recv(meta, peer, pp_group)
    code, ndim, *dims = meta.tolist()
    tensor = torch.empty(dims[:ndim], dtype=_DTYPES[code], device=device)
    dist.recv(tensor, peer, pp_group)
    return tensor
