"""How a backward's gradients reach `.grad` for `StageRuntime`: accumulated across microbatches.

[Note: autograd accumulates] `backward_into_grads` lets autograd do what `accumulate` does in
Python: a leaf without `.grad` takes the gradient, one with `.grad` adds it in place; so the result
is bitwise the same, without the clone and the per-parameter Python loop. A segment's input is a
fresh leaf per microbatch (or, on the first segment, a batch detached on load), so its `.grad` is
exactly its input gradient; the other leaves a chunk's forward reaches are its parameters. A full
backward names no leaves (with `inputs=` autograd takes longer per backward, and a backward is
most of a stage's time). Only `BackwardWeight` names them (the parameters), since its input's
gradient was already taken. `accumulate` is for gradients taken with `torch.autograd.grad` of
stashed weights (weight delay), which belong to the live parameters.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

__all__ = ["accumulate", "backward_into_grads"]


def backward_into_grads(
    output: torch.Tensor | tuple[torch.Tensor, ...],
    grad_out: torch.Tensor | tuple | None,
    leaves: list[torch.Tensor] | None = None,
) -> None:
    """Accumulate d output / d leaf into each leaf's `.grad`: every leaf the graph reaches that
    needs a gradient (as `loss.backward()`), or only `leaves`. `output` may be a tuple of
    tensors that each need a gradient, with a tuple of `grad_out`."""
    if leaves is None:
        if isinstance(output, tuple) or output.requires_grad:
            torch.autograd.backward(output, grad_out)
        return
    wrt = [t for t in leaves if t.requires_grad]
    if wrt:
        torch.autograd.backward(output, grad_out, inputs=wrt)


def accumulate(params: Iterable[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    """Add `grads` into the `.grad` of `params`, in order (None: no gradient for that one)."""
    for p, g in zip(params, grads):
        if g is None:
            continue
        if p.grad is None:
            p.grad = g.detach().clone()
        else:
            p.grad.add_(g)
