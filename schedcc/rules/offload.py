"""The rule on `Offload` and `Reload`: activations on the host are not touched until reloaded.

[Note: offloading] `O i.c` on a stage moves the activations that the forward `F i.c` saved for
its backward to host memory, on the stage's copy lane (a side stream under CUDA), and `L i.c`
brings them back. Between the two the graph exists but its saved tensors are not on the device,
so no backward piece of `i` on chunk `c` (`B`, `I`, `W`, `+B`) may run there, and no send of its
activation (`SA i.c`: the device keeps that output until it leaves, so it is offloaded after).
An `O` needs activations to move: it comes after `F i.c`, before its backward began, not for a
forward its stage recomputes (that one saves nothing), and not while they are already on the
host; an `L` needs an `O` before it. Device bytes (the validator's, the simulator's and the
engines' `activation_bytes`) drop at the `O` and come back at the `L`; host bytes are counted
apart (`schedcc.semantics.activations.host_bytes`). Copies take no stage time: the simulators put
them on one copy lane per stage, in program order, and a backward piece waits for its `L`.
"""

from __future__ import annotations

from collections.abc import Iterator

from schedcc.errors import OffloadError
from schedcc.ir import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    Offload,
    Reload,
    SendActivation,
)
from schedcc.rules import Context, Problem
from schedcc.semantics import recomputed

__all__ = ["check_offload"]

_BACKWARD = (Backward, BackwardInput, BackwardWeight)  # `+B` is a Backward


def check_offload(ctx: Context) -> Iterator[Problem]:
    """Every `Offload(i, c)` has activations on the device to move and every `Reload(i, c)`
    activations on the host; nothing reads them while they are on the host."""
    if Offload not in ctx.kinds and Reload not in ctx.kinds:
        return
    for s, ops in enumerate(ctx.stages):
        kept_input = recomputed(ops)
        forwarded: set[tuple[int, int]] = set()
        backwarded: set[tuple[int, int]] = set()
        on_host: set[tuple[int, int]] = set()
        for pos, op in enumerate(ops):
            kind = type(op)
            if kind not in _WATCHED and not issubclass(kind, _BACKWARD):
                continue
            key = (op.microbatch, op.chunk)
            text = _problem(op, key, forwarded, backwarded, on_host, kept_input)
            if text is not None:
                yield Problem(OffloadError, f"{ctx.where(s, pos)} {text}", s, pos)
                break  # the stage's later copies follow from this one
            if kind is Forward:
                forwarded.add(key)
            elif kind is Offload:
                on_host.add(key)
            elif kind is Reload:
                on_host.discard(key)
            elif kind is not SendActivation:
                backwarded.add(key)


_WATCHED = (Forward, Offload, Reload, SendActivation)


def _problem(op, key, forwarded, backwarded, on_host, kept_input) -> str | None:
    """What is wrong with `op` given what the stage did before it, or None."""
    i, c = key
    kind = type(op)
    reload = Reload(i, c)
    if kind is Offload:
        if key in on_host:
            return f"offloads microbatch {i} on chunk {c} a second time before its {reload}"
        if key in kept_input:
            return (
                f"offloads microbatch {i} on chunk {c}, whose forward is recomputed and keeps "
                "only its input: recompute or offload a forward, not both"
            )
        if key not in forwarded:
            return f"offloads microbatch {i} on chunk {c} before its forward {Forward(i, c)}"
        if key in backwarded:
            return (
                f"offloads microbatch {i} on chunk {c} after its backward began; move it before "
                f"{Backward(i, c)} (or {BackwardInput(i, c)})"
            )
        return None
    if kind is Reload:
        if key not in on_host:
            return (
                f"reloads microbatch {i} on chunk {c}, whose activations are not offloaded: put "
                f"{Offload(i, c)} after its forward and before this reload"
            )
        return None
    if key not in on_host:
        return None
    if kind is SendActivation:
        return (
            f"sends the activation of microbatch {i} on chunk {c} while its activations are "
            f"offloaded; put its offload {Offload(i, c)} after this send"
        )
    return (
        f"runs a backward of microbatch {i} on chunk {c} while its activations are offloaded; "
        f"put its reload {reload} before it"
    )
