"""How a backward's gradients reach `.grad` for `StageRuntime`: accumulated across microbatches.

[Note: autograd accumulates] `backward_into_grads` lets autograd do what `accumulate` does in
Python: a leaf without `.grad` takes the gradient, one with `.grad` adds it in place; so the result
is bitwise the same, without the clone and the per-parameter Python loop. A segment's input is a
fresh leaf per microbatch (or, on the first segment, a batch detached on load), so its `.grad` is
exactly its input gradient; the other leaves a chunk's forward reaches are its parameters. A full
backward names no leaves (with `inputs=` autograd takes longer per backward, and a backward is
most of a stage's time). Only `BackwardWeight` names them (the parameters), since its input's
gradient was already taken. `accumulate` is for gradients taken with `torch.autograd.grad` of
stashed weights (weight delay), which belong to the live parameters. `full_backward` and
`weight_backward` choose between the two for a forward's `Graph`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from schedcc.backends.runtime.boundary import grad_roots, joined

if TYPE_CHECKING:
    from schedcc.backends.runtime.graphs import Graph

__all__ = ["accumulate", "backward_into_grads", "full_backward", "weight_backward"]


def full_backward(
    graph: Graph, grads: Sequence[torch.Tensor | None], live: Iterable[torch.Tensor] | None
) -> list[torch.Tensor | None]:
    """A whole backward of `graph` from its roots' gradients `grads`: the gradients of its
    input's leaves, returned, and its parameters' accumulated into `.grad` (by autograd; for a
    forward on stashed weights, into `live`, the live parameters they are a version of)."""
    leaves = graph.leaves
    if live is not None:
        got = grad_roots(graph.roots, grads, leaves + graph.params)
        accumulate(live, got[len(leaves) :])
        return got[: len(leaves)]
    joint = joined(graph.roots, grads)
    if joint is not None:
        backward_into_grads(*joint)
    return [leaf.grad for leaf in leaves]


def weight_backward(graph: Graph, live: Iterable[torch.Tensor] | None) -> None:
    """The weight half of a split backward, from the roots' gradients its `BackwardInput` kept
    (`graph.grads`): the parameters' gradients into `.grad` (or `live`'s, as `full_backward`)."""
    if live is not None:
        accumulate(live, grad_roots(graph.roots, graph.grads, graph.params))
        return
    joint = joined(graph.roots, graph.grads)
    if joint is not None:
        backward_into_grads(*joint, graph.params)


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
