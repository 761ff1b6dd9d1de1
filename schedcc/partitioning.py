"""`partition`: cut a model into contiguous segments for a pipeline (imports torch lazily).

>>> import torch, schedcc
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
>>> [len(segment) for segment in schedcc.partition(model, 2)]
[1, 2]
"""

from __future__ import annotations

import itertools
import re
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from schedcc.errors import PartitionError, ScheduleConfigError

if TYPE_CHECKING:
    from torch import nn

__all__ = ["PartitionError", "partition", "segment_bounds"]


def partition(
    model: nn.Sequential | Sequence[nn.Module],
    n: int,
    method: str | Sequence[int] = "parameters",
) -> list[nn.Sequential]:
    """Cut `model` into `n` contiguous `nn.Sequential` segments, in model order.

    The segments hold the model's own layers (no copies), so training the segments trains the
    model, under the model's own names: a segment's layers keep their indices in the model
    (`"2.weight"` is layer 2's weight in whichever segment holds it), so a segment's state dict
    is part of the model's, and checkpoints load across cuts by name.

    Args:
        model: an `nn.Sequential` or a list of layers.
        n: the number of segments, `p * v` for a pipeline.
        method: `"parameters"` balances parameter counts (ties broken toward equal layer counts),
            `"uniform"` balances layer counts, `"type:REGEX"` balances the counts of the layers
            whose class name `REGEX` matches (`re.search`, ignoring case, as DeepSpeed's
            `partition_method`: `"type:Block"`, `"type:(Block|Layer)"`), the other layers riding
            with their neighbours (ties broken toward equal layer counts), or a list of the
            `n - 1` layer indices where segments 1..n-1 start.

    Raises:
        PartitionError: `model` is another kind of module (the message names the
            `schedcc.split(model, [...])` call to use instead), `n` is not positive or exceeds
            the number of layers, the boundaries are not `n - 1` increasing indices inside the
            model, the method is unknown, or a `"type:REGEX"` is not a regular expression or
            matches fewer layers than there are segments.

    >>> import torch
    >>> layers = [torch.nn.Linear(4, 4) for _ in range(5)]
    >>> [len(s) for s in partition(layers, 3, "uniform")]
    [2, 2, 1]
    >>> [len(s) for s in partition(layers, 2, [1])]
    [1, 4]
    >>> blocks = [torch.nn.Embedding(4, 4), *layers, torch.nn.Linear(4, 2)]
    >>> [len(s) for s in partition(blocks, 2, "type:linear")]
    [4, 3]
    """
    from torch import nn

    if isinstance(model, nn.Sequential):
        names = [name for name, _ in model.named_children()]
        layers = list(model.children())
    elif isinstance(model, nn.Module) and not isinstance(model, nn.ModuleList):
        raise PartitionError(_not_sequential(model, n))
    else:
        try:
            layers = list(model)
        except TypeError:
            raise PartitionError(
                "partition cuts an nn.Sequential or a list of layers; got an object of type "
                f"{type(model).__name__}"
            ) from None
        names = [str(i) for i in range(len(layers))]
    for index, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise PartitionError(
                f"layer {index} is a {type(layer).__name__}, not a torch.nn.Module"
            )
    if isinstance(method, str) and method.startswith("type:"):
        sizes, method = _type_weights(layers, method, n), "parameters"
    else:
        sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    bounds = segment_bounds(sizes, n, method)
    return [
        nn.Sequential(OrderedDict((names[i], layers[i]) for i in range(lo, hi)))
        for lo, hi in itertools.pairwise(bounds)
    ]


def _type_weights(layers: Sequence[nn.Module], method: str, n: Any) -> list[int]:
    """1 for each layer whose class name the method's `type:REGEX` matches, else 0.

    [Note: partitioning by layer type] The weights are balanced as parameter counts are
    (`_balanced`): each segment gets as equal a share of the matching layers as a contiguous cut
    allows, and a layer that does not match (an embedding, a final norm, a head) weighs nothing,
    so it rides with its neighbours in whichever segment keeps the layer counts most equal.
    """
    pattern = method[len("type:") :]
    try:
        regex = re.compile(pattern, re.IGNORECASE)
    except re.error as exc:
        raise PartitionError(
            f"partition method {method!r}: {pattern!r} is not a regular expression ({exc}); "
            "write e.g. 'type:Block' or 'type:(Block|Layer)'"
        ) from None
    weights = [int(regex.search(type(layer).__name__) is not None) for layer in layers]
    if not any(weights) or (isinstance(n, int) and sum(weights) < n):
        classes = sorted({type(layer).__name__ for layer in layers})
        raise PartitionError(
            f"partition method {method!r} matches {sum(weights)} layer(s), fewer than the {n} "
            f"segments, each of which needs one; the layers' classes are {', '.join(classes)}: "
            "match one of them, or use 'parameters' or 'uniform'"
        )
    return weights


def _not_sequential(model: nn.Module, n: Any) -> str:
    """Why a module that is not a Sequential cannot be partitioned, and the `split` to use."""
    from schedcc.splitting import even_points

    try:
        points = repr(even_points(model, n))
    except ScheduleConfigError:
        points = "[the names of the submodules where segments 1, 2, ... start]"
    return (
        f"partition cuts an nn.Sequential (or a list of layers) in order, but a "
        f"{type(model).__name__} is an nn.Module whose forward decides how its submodules are "
        f"called; cut it at named submodules with schedcc.split(model, {points}, "
        "example_inputs=inputs) instead (inputs: a batch's inputs, as the model takes them)"
    )


def segment_bounds(sizes: Sequence[int], n: int, method: str | Sequence[int] = "parameters"):
    """The `n + 1` layer indices where the segments start (and the last ends), from layer sizes.

    >>> segment_bounds([10, 0, 10, 0], 2)
    [0, 2, 4]
    """
    num_layers = len(sizes)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise PartitionError(f"the number of segments must be a positive integer, got {n!r}")
    if n > num_layers:
        raise PartitionError(
            f"cannot cut {num_layers} layer(s) into {n} segments: every segment needs at least "
            "one layer; use fewer stages or chunks, or split the model into more layers"
        )
    if isinstance(method, str):
        if method == "uniform":
            return _uniform(num_layers, n)
        if method == "parameters":
            return _balanced(sizes, n)
        raise PartitionError(
            f"unknown partition method {method!r}: use 'parameters', 'uniform', "
            f"'type:REGEX' (a layer class name pattern) or a list of {n - 1} boundaries"
        )
    return _explicit(list(method), num_layers, n)


def _uniform(num_layers: int, n: int) -> list[int]:
    base, extra = divmod(num_layers, n)
    bounds = [0]
    for k in range(n):
        bounds.append(bounds[-1] + base + (1 if k < extra else 0))
    return bounds


def _balanced(sizes: Sequence[int], n: int) -> list[int]:
    """Minimise the largest (parameters, layers) of a segment over contiguous cuts (exact DP)."""
    num_layers = len(sizes)
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)

    def cost(lo: int, hi: int) -> tuple[int, int]:
        return prefix[hi] - prefix[lo], hi - lo

    inf = (float("inf"), float("inf"))
    # best[j][i]: the best worst-segment cost of cutting layers[:i] into j segments.
    best: list[list[Any]] = [[inf] * (num_layers + 1) for _ in range(n + 1)]
    cut = [[0] * (num_layers + 1) for _ in range(n + 1)]
    best[0][0] = (0, 0)
    for j in range(1, n + 1):
        for i in range(j, num_layers - (n - j) + 1):
            for lo in range(j - 1, i):
                if best[j - 1][lo] == inf:
                    continue
                candidate = max(best[j - 1][lo], cost(lo, i))
                if candidate < best[j][i]:
                    best[j][i], cut[j][i] = candidate, lo
    bounds = [num_layers]
    for j in range(n, 0, -1):
        bounds.append(cut[j][bounds[-1]])
    return bounds[::-1]


def _explicit(starts: list[Any], num_layers: int, n: int) -> list[int]:
    if len(starts) != n - 1 or not all(
        isinstance(b, int) and not isinstance(b, bool) for b in starts
    ):
        raise PartitionError(
            f"boundaries {starts!r}: give {n - 1} integer layer indices where segments 1..{n - 1} "
            "start"
        )
    bounds = [0, *starts, num_layers]
    if any(lo >= hi for lo, hi in itertools.pairwise(bounds)):
        raise PartitionError(
            f"boundaries {starts!r} must increase strictly within 1..{num_layers - 1} so that "
            "every segment gets at least one layer"
        )
    return bounds
