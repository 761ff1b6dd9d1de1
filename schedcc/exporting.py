"""The graph `split` cuts when it traces with `torch.export` (imports torch lazily).

[Note: cutting an exported model] With `example_inputs`, `split` first exports the model
(`torch.export.export(..., strict=False)`, every dimension of every input tensor `Dim.AUTO`, so
a dimension the code does not fix, like the batch and the sequence length, stays free) and cuts
the unlifted graph (`ExportedProgram.module()`), which reads every Parameter and buffer by its
qualified name (`get_attr`). Export runs the model's whole `forward` on fake tensors as Python,
so glue code that `torch.fx` cannot trace (a `forward(**kwargs)` behind decorators, item
assignment on a value) is no obstacle, but every operation becomes an aten call: submodules are
not called as modules, and a point's call is found by the `nn_module_stack` export records on
each node (one key per call, `...@1` for a second call). The graph is cut before the first node
of each point's call. Each segment is a `GraphModule` whose `get_attr` targets resolve against
the model itself (then the exported module, for the tensors export lifted out of the code), so
a segment holds the model's own Parameters and a tie stays one object in every segment that
reads it, under each of its names. The first segment takes the model's inputs as the model
does (export's input spec flattens them); the last rebuilds the model's output structure (a
`ModelOutput`, a dict, a tuple) from export's output spec.

Export specialises what Python decides while tracing: a branch on `self.training`, on a config
flag or on a shape is fixed, as fx fixes the glue code; `split` checks the segments against the
model on `example_inputs`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from schedcc.errors import ScheduleConfigError

if TYPE_CHECKING:
    from torch import fx, nn

__all__ = ["ExportedGraph", "export_graph", "point_starts", "segment_codegen"]


class ExportedGraph:
    """An exported model's graph, where its attributes come from, and its input/output specs."""

    def __init__(self, graph: fx.Graph, source: nn.Module, in_info: Any, out_spec: Any) -> None:
        self.graph = graph
        self.source = source  # resolves get_attr targets: the model's own, then export's
        self.in_info = in_info  # torch.fx's _PyTreeInfo of the model's inputs
        self.out_spec = out_spec  # the pytree spec of the model's output


def export_graph(model: nn.Module, example_inputs: Any) -> ExportedGraph:
    """Export `model` on `example_inputs` (called by `values.call`'s convention).

    Raises:
        ScheduleConfigError: torch.export fails; the message carries export's reason.
    """
    import torch

    args, kwargs = _arguments(example_inputs)
    dims = _free_dims(args, kwargs)
    try:
        exported = torch.export.export(model, args, kwargs, strict=False, dynamic_shapes=dims)
    except Exception as error:  # export raises many kinds, all meaning "cannot capture"
        raise ScheduleConfigError(
            f"torch.export could not capture {type(model).__name__}'s forward on example_inputs "
            f"({type(error).__name__}: {_first_line(error)})"
        ) from error
    unlifted = exported.module(check_guards=False)
    graph = unlifted.graph
    for node in list(graph.nodes):  # guard checks and dead constants are not the model's
        if node.op == "call_module" and not node.users:
            graph.erase_node(node)
    graph.eliminate_dead_code()
    info = graph._codegen.pytree_info
    return ExportedGraph(graph, _attributes(model, unlifted), info, info.out_spec)


def point_starts(graph: fx.Graph, names: list[str]) -> list[fx.Node]:
    """The first node of each point's call, in `names`' order.

    Raises:
        ScheduleConfigError: a point that runs no operation, more than once, or out of order.
    """
    calls: dict[str, list[str]] = {name: [] for name in names}
    first: dict[str, fx.Node] = {}
    for node in graph.nodes:
        for key, (path, _) in (node.meta.get("nn_module_stack") or {}).items():
            if path in calls:
                if key not in calls[path]:
                    calls[path].append(key)
                first.setdefault(path, node)
    for name, keys in calls.items():
        if len(keys) != 1:
            raise ScheduleConfigError(
                f"split point {name!r} is called {len(keys)} times by the model's forward (as "
                "torch.export saw it); a segment starts at a submodule that runs exactly once "
                "per forward and computes something"
            )
    order = {node: index for index, node in enumerate(graph.nodes)}
    in_order = sorted(names, key=lambda name: order[first[name]])
    if in_order != names:
        raise ScheduleConfigError(
            f"split points {names} are not in the order the model calls them; use {in_order}"
        )
    return [first[name] for name in names]


def segment_codegen(info: Any, placeholders: list[str], *, first: bool, last: bool) -> Any:
    """The code generator of a segment: the model's input spec on the first, its output spec
    on the last (later segments take their boundary tuple as positional arguments)."""
    import torch.utils._pytree as pytree
    from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo

    if first:
        in_info = info
    else:
        spec = pytree.tree_flatten((tuple(placeholders), {}))[1]
        in_info = _PyTreeInfo(list(placeholders), spec, None)
    return _PyTreeCodeGen(in_info._replace(out_spec=info.out_spec if last else None))


def _arguments(example_inputs: Any) -> tuple[tuple, dict]:
    """`(args, kwargs)` for a segment call on `example_inputs` (`values.call`'s convention)."""
    from collections.abc import Mapping

    if type(example_inputs) is tuple:
        return example_inputs, {}
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    return (example_inputs,), {}


def _free_dims(args: tuple, kwargs: dict) -> Any:
    """`Dim.AUTO` for every dimension of every input tensor (export keeps what code fixes)."""
    import torch
    import torch.utils._pytree as pytree
    from torch.export import Dim

    def dims(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return dict.fromkeys(range(value.dim()), Dim.AUTO)
        return None

    if kwargs:  # values.call passes a dict as keyword arguments only
        return {name: pytree.tree_map(dims, value) for name, value in kwargs.items()}
    return tuple(pytree.tree_map(dims, value) for value in args)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else ""


def _attributes(model: nn.Module, exported: nn.Module) -> nn.Module:
    """A module whose attributes are the model's, then the exported module's (its lifted
    constants): the root `fx.GraphModule` copies each segment's `get_attr` targets from."""
    from torch import nn

    class Attributes(nn.Module):
        """Looks a name up on the model, then on the exported module (its lifted constants)."""

        def __init__(self, model: nn.Module, exported: nn.Module) -> None:
            super().__init__()
            self.__dict__["_sources"] = (model, exported)
            self.train(model.training)

        def __getattr__(self, name: str) -> Any:
            for source in self.__dict__["_sources"]:
                if hasattr(source, name):
                    return getattr(source, name)
            raise AttributeError(name)

    return Attributes(model, exported)
