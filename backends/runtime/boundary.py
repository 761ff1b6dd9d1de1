"""What crosses a segment boundary, for `StageRuntime`: messages, received leaves, gradients.

A `Message` is a boundary value as every backend moves it: its tensors (flat, detached,
contiguous), its spec and its meta (`backends.runtime.values`). The activation a forward sends is
the message of its output value; the meta marks the tensors whose gradient comes back (floating
point and requiring grad, `values.grad_tensors`' rule). The receiver makes every received tensor
a fresh leaf, grad-requiring exactly where the meta says, and rebuilds the value with `unflatten`;
so both sides of a boundary agree on which gradients travel back, in which order.

A gradient message's value is `(grads,)`, the input gradient of each grad-requiring leaf in order
(zeros where the segment did not use it), or `(grads, count)` when it carries its batch's count
([Note: the count divides at the step] in `backends.runtime.losses`).

    >>> import torch
    >>> x = torch.ones(2, requires_grad=True)
    >>> message = activation(((x * 2), torch.zeros(2, dtype=torch.long)), segment=0)[0]
    >>> [m.requires_grad for m in message.meta]
    [True, False]
    >>> value, leaves = receive(message)
    >>> len(leaves), value[0].requires_grad, value[1].requires_grad
    (1, True, False)
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from schedcc.backends.runtime.values import (
    Spec,
    TensorMeta,
    flatten,
    tensor_meta,
    unflatten,
)

__all__ = [
    "Message",
    "activation",
    "joined",
    "detached",
    "grad_roots",
    "gradients",
    "read_gradients",
    "receive",
]


#: The spec of a value that is one tensor.
_TENSOR = flatten(torch.empty(0))[1]


@functools.cache
def _gradient_spec(count: int, carries: bool) -> Spec:
    """The spec of a gradient message: `(grads,)`, or `(grads, count)` when it `carries`."""
    grads = tuple(torch.empty(0) for _ in range(count))
    return flatten((grads, torch.empty(0)) if carries else (grads,))[1]


class Message(NamedTuple):
    """A boundary value ready to move: flat tensors, spec, meta (see the module docstring)."""

    tensors: list[torch.Tensor]
    spec: Spec
    meta: tuple[TensorMeta, ...]

    def value(self) -> Any:
        """The value, its tensors as they are (no leaves made)."""
        return unflatten(self.tensors, self.spec)

    def clone(self) -> Message:
        """A copy whose tensors own their memory (what a network would deliver)."""
        return Message([t.clone() for t in self.tensors], self.spec, self.meta)


def activation(output: Any, *, segment: int) -> tuple[Message, list[torch.Tensor]]:
    """The message of segment `segment`'s `output`, and the output tensors a gradient comes back
    for (the graph's roots), in order.

    Raises:
        ScheduleConfigError: the output holds something that cannot cross a stage (named by its
            path).
    """
    if type(output) is torch.Tensor:  # the common case, without the walk
        takes = output.requires_grad and output.is_floating_point()
        meta = (TensorMeta(output.dtype, tuple(output.shape), takes),)
        message = Message([output.detach().contiguous()], _TENSOR, meta)
        return message, ([output] if takes else [])
    tensors, spec = flatten(output, name=f"the output of segment {segment}")
    meta = tensor_meta(tensors)
    roots = [t for t, m in zip(tensors, meta) if m.requires_grad]
    return Message([t.detach().contiguous() for t in tensors], spec, meta), roots


def receive(message: Message) -> tuple[Any, list[torch.Tensor]]:
    """The value a segment is called on, and its grad-requiring leaves in order.

    The message's tensors become the leaves (detached aliases: the sender's are not touched).
    """
    if message.spec == _TENSOR:  # the common case, without the walk
        leaf = message.tensors[0].detach().requires_grad_(message.meta[0].requires_grad)
        return leaf, ([leaf] if leaf.requires_grad else [])
    leaves = [
        t.detach().requires_grad_(m.requires_grad) for t, m in zip(message.tensors, message.meta)
    ]
    return unflatten(leaves, message.spec), [t for t in leaves if t.requires_grad]


def detached(value: Any) -> Any:
    """`value` with every tensor detached (a batch's inputs: a backward stops there)."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    tensors, spec = flatten(value, name="inputs")
    return unflatten([t.detach() for t in tensors], spec)


def gradients(
    leaves: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    count: torch.Tensor | None = None,
) -> Message:
    """The gradient message for `leaves` (zeros where a gradient is None), with `count`."""
    tensors = [
        torch.zeros_like(leaf) if g is None else g.detach().contiguous()
        for leaf, g in zip(leaves, grads)
    ]
    if count is not None:
        tensors.append(count.reshape(()))
    return Message(tensors, _gradient_spec(len(leaves), count is not None), tensor_meta(tensors))


def read_gradients(
    message: Message, roots: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], torch.Tensor | None] | str:
    """`(grads for roots, count or None)` from a gradient message, or what disagrees (a text)."""
    tensors, count = message.tensors, len(roots)
    if message.spec == _gradient_spec(count, False):
        grads, carried = tensors, None
    elif message.spec == _gradient_spec(count, True):
        grads, carried = tensors[:count], tensors[count]
    else:
        value = message.value()
        if type(value) is not tuple or len(value) not in (1, 2) or type(value[0]) is not tuple:
            return "it is not a gradient message"
        return (
            f"it holds {len(value[0])} gradient(s) but the output sent {count} tensor(s) that "
            "take one"
        )
    for n, (g, root) in enumerate(zip(grads, roots)):
        if g.shape != root.shape or g.dtype != root.dtype:
            return (
                f"gradient {n} is {g.dtype} {tuple(g.shape)} but the output's tensor is "
                f"{root.dtype} {tuple(root.shape)}"
            )
    return list(grads), carried


def _live(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> tuple:
    """The roots that reach a graph, and their gradients (None: the loss, implicitly 1)."""
    if len(roots) == 1:
        return ((roots[0],), (grads[0],)) if roots[0].requires_grad else ((), ())
    pairs = [(r, g) for r, g in zip(roots, grads) if r.requires_grad]
    return tuple(r for r, _ in pairs), tuple(g for _, g in pairs)


def joined(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> tuple | None:
    """The roots that reach a graph and their gradients as `torch.autograd.backward` takes them:
    one tensor and its gradient (None: the loss), or tuples of them; None if no root does."""
    live, live_grads = _live(roots, grads)
    if not live:
        return None
    if len(live) == 1:
        return live[0], live_grads[0]
    return live, live_grads


def grad_roots(
    roots: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    wrt: Sequence[torch.Tensor],
    *,
    retain_graph: bool = False,
) -> list[torch.Tensor | None]:
    """The gradient of `roots` with respect to each of `wrt` (None where it is not reached)."""
    live, live_grads = _live(roots, grads)
    need = [n for n, t in enumerate(wrt) if t.requires_grad]
    out: list[torch.Tensor | None] = [None] * len(wrt)
    if live and need:
        got = torch.autograd.grad(
            live,
            [wrt[n] for n in need],
            live_grads,
            retain_graph=retain_graph,
            allow_unused=True,
        )
        for n, g in zip(need, got):
            out[n] = g
    return out
