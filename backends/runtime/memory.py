"""How many bytes of activations a forward saves for its backward, for `StageRuntime`.

[Note: activation bytes are measured once] Saved-tensor hooks count the bytes a forward saves for
its backward (views count their own bytes, a tensor saved twice counts once, parameters do not
count). A Python hook on every saved tensor costs time, so the count is taken on the first forward
of each signature (chunk, input shape/dtype/strides/requires_grad, the target's for the loss, the
module's training flag, grad mode) and reused for later forwards with the same signature: exact
for any module whose saved tensors depend on shapes, not on values (a data-dependent module, e.g.
a router that drops tokens, gets the first microbatch's count).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from schedcc.backends.runtime.optimizers import build_optimizer
from schedcc.backends.runtime.values import flatten
from schedcc.errors import call_user, name_of
from schedcc.memory_model import MemoryModel

__all__ = ["SavedBytes", "measure_memory", "signature"]


class SavedBytes:
    """Runs forwards and says how many activation bytes each saved (see the note above).

    The counts are kept per signature for the runtime's whole life, across runs.
    """

    def __init__(self) -> None:
        self._by_signature: dict[Hashable, int] = {}

    def run(
        self,
        signature: Hashable,
        params: Iterable[torch.Tensor],
        forward: Callable[[], torch.Tensor],
        *,
        saving: tuple[Callable, Callable] | None = None,
    ) -> tuple[torch.Tensor, int]:
        """`forward()`'s result and the bytes it saved, not counting the tensors in `params`;
        `saving`: the `(pack, unpack)` hooks the saved tensors go through (an offloaded
        forward's, `backends.runtime.offload`)."""
        num_bytes = self._by_signature.get(signature)
        if num_bytes is not None:
            if saving is None:
                return forward(), num_bytes
            with torch.autograd.graph.saved_tensors_hooks(*saving):
                return forward(), num_bytes
        keep, unpack = saving if saving is not None else (_same, _same)
        skip = {t.untyped_storage().data_ptr() for t in params}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            # A view counts its own bytes (a microbatch is a view of the whole batch); a tensor
            # saved twice counts once; parameters are weights, not activations.
            if t.untyped_storage().data_ptr() not in skip:
                seen[t.data_ptr()] = max(seen.get(t.data_ptr(), 0), t.numel() * t.element_size())
            return keep(t)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = forward()
        num_bytes = self._by_signature[signature] = sum(seen.values())
        return out, num_bytes


def _same(t: Any) -> Any:
    return t


def signature(chunk: int, value: Any, target: Any, *, training: bool) -> Hashable:
    """What the saved tensors of a forward of `chunk` on `value` depend on (the note above);
    `target`: the loss's target on the last segment, None elsewhere."""
    target_layout = None if target is None else _layout(target)
    return (chunk, _layout(value), target_layout, training, torch.is_grad_enabled())


def _layout(value: Any) -> Hashable:
    """A value's structure and its tensors' shapes, dtypes, strides and grad flags."""
    if isinstance(value, torch.Tensor):
        return (value.shape, value.dtype, value.stride(), value.requires_grad)
    tensors, spec = flatten(value)
    return (spec, tuple((t.shape, t.dtype, t.stride(), t.requires_grad) for t in tensors))


def measure_memory(
    segments: Sequence[nn.Module],
    inputs: Any,
    targets: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer] | None = None,
    *,
    num_parts: int = 1,
    seq_dim: int = 1,
    recompute_layers: int | None = None,
) -> MemoryModel:
    """The `schedcc.MemoryModel` of `segments` for microbatches like `inputs`/`targets`.

    Runs one microbatch through the segments in model order, counting what each forward saves
    for its backward as the engines do (the last segment's with `loss_fn`), the bytes of each
    segment's input, parameters, and, given `optimizer`, the state it builds in one step (on
    copies: the caller's segments are not changed). Give it one microbatch (the batch split in
    m): activation bytes scale with the microbatch size. With `num_parts > 1` the microbatch is
    cut into that many sequence parts along `seq_dim`, run part after part with their carries
    as the engines run them, and `part_activations` holds what each part's forward saves
    ([Note: sequence parts] in `schedcc.rules.parts`). `recompute_layers`: as the engines',
    each segment keeping only every N-th layer boundary (`backends.runtime.segment_calls`). The
    model's `cut` is `len(segments)`: `tune` and `search` take its sizes for programs of that
    cut ([Note: a measured cut] in `schedcc.memory_model`).

    >>> import torch
    >>> model = measure_memory([torch.nn.Linear(4, 4)], torch.ones(2, 4), torch.ones(2, 4),
    ...                        torch.nn.functional.mse_loss, lambda p: torch.optim.Adam(p))
    >>> model.parameters, model.inputs, model.optimizer
    ((80.0,), (32.0,), (160.0,))
    """
    from schedcc.backends.runtime.boundary import activation, detached, receive
    from schedcc.backends.runtime.losses import call_loss
    from schedcc.backends.runtime.recompute import input_bytes
    from schedcc.backends.runtime.segment_calls import SegmentCall, check_recompute_layers

    if num_parts > 1:
        return _measure_parts(segments, inputs, targets, loss_fn, optimizer, num_parts, seq_dim)
    value: Any = detached(inputs)
    acts, ins, params, state = [], [], [], []
    last = len(segments) - 1
    for k, module in enumerate(segments):
        ins.append(input_bytes(value))
        counted = list(module.parameters())
        every = check_recompute_layers(recompute_layers)
        apply = SegmentCall(module, segment=k, recompute_layers=every)

        def forward(module=module, value=value, k=k, apply=apply):
            name = f"the forward of segment {k} ({name_of(module)})"
            out = call_user(name, lambda: apply(value))
            return call_loss(loss_fn, out, targets) if k == last else out

        out, num_bytes = SavedBytes().run(("measure", k), counted, forward)
        acts.append(num_bytes)
        params.append(sum(p.numel() * p.element_size() for p in counted))
        state.append(_optimizer_bytes(counted, optimizer) if optimizer is not None else 0)
        if k < last:
            value = receive(activation(out, segment=k)[0])[0]
    return MemoryModel(
        activations=acts, parameters=params, optimizer=state, inputs=ins, cut=len(segments)
    )


def _measure_parts(segments, inputs, targets, loss_fn, optimizer, num_parts: int, seq_dim: int):
    """`measure_memory` over the `num_parts` sequence parts of one microbatch: each segment's
    activations are its first part's, `part_activations` every part's."""
    from schedcc.backends.batches import split_pair
    from schedcc.backends.runtime.boundary import activation, detached, receive
    from schedcc.backends.runtime.carries import Carries, call_part
    from schedcc.backends.runtime.losses import call_loss
    from schedcc.backends.runtime.recompute import input_bytes

    xs, ys = split_pair(
        inputs, targets, num_parts, where="measure_memory", parts=num_parts, seq_dim=seq_dim
    )
    carries, last = Carries(stage=0, num_parts=num_parts), len(segments) - 1
    parts: list[list[int]] = [[] for _ in segments]
    ins: list[int] = []
    for j, (value, target) in enumerate(zip(xs, ys)):
        value = detached(value)
        for k, module in enumerate(segments):
            if j == 0:
                ins.append(input_bytes(value))
            carry = carries.take(j, k)[0]

            def forward(module=module, value=value, k=k, j=j, carry=carry, target=target):
                where = f"the forward of segment {k} ({name_of(module)})"
                out, carried = call_user(
                    where, functools.partial(call_part, module, value, carry, where=where)
                )
                carries.hand_on(j, k, k, carried)
                return call_loss(loss_fn, out, target) if k == last else out

            out, num_bytes = SavedBytes().run(("measure", k, j), module.parameters(), forward)
            parts[k].append(num_bytes)
            if k < last:
                value = receive(activation(out, segment=k)[0])[0]
    counted = [list(module.parameters()) for module in segments]
    return MemoryModel(
        activations=[row[0] for row in parts],
        parameters=[sum(p.numel() * p.element_size() for p in ps) for ps in counted],
        optimizer=[_optimizer_bytes(ps, optimizer) if optimizer else 0 for ps in counted],
        inputs=ins,
        part_activations=parts,
        cut=len(segments),
    )


def _optimizer_bytes(params: list[torch.Tensor], optimizer) -> int:
    """The bytes of the state `optimizer` keeps for `params` after one step (on copies)."""
    copies = [p.detach().clone().requires_grad_(p.requires_grad) for p in params]
    trained = [p for p in copies if p.requires_grad]
    if not trained:
        return 0
    for p in trained:
        p.grad = torch.zeros_like(p)
    opt = build_optimizer(optimizer, trained)
    opt.step()
    return sum(
        t.numel() * t.element_size()
        for per_param in opt.state.values()
        for t in per_param.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )
