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
model on `example_inputs`. Devices are the exception: `follow_device` makes each segment create
its tensors on the device it is moved to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from schedcc.errors import ScheduleConfigError, call_user, first_line

if TYPE_CHECKING:
    from torch import fx, nn

__all__ = [
    "ExportedGraph",
    "export",
    "exported_graph",
    "follow_device",
    "module_names",
    "point_starts",
    "segment_codegen",
    "unlifted_module",
]


@attrs.frozen
class ExportedGraph:
    """An exported model's graph, where its attributes come from, and its input spec."""

    graph: fx.Graph
    #: resolves the graph's get_attr targets: the model's own objects, then export's constants
    source: nn.Module
    #: torch.fx's `_PyTreeInfo` of the model's inputs (and, as `out_spec`, its output)
    in_info: Any


def export(model: nn.Module, example_inputs: Any) -> Any:
    """`model` exported on `example_inputs` (passed as `values.call` passes them): non-strict,
    every input dimension `Dim.AUTO`.

    Raises:
        ScheduleConfigError: the model's forward fails on `example_inputs`, or torch.export
            does; the message carries the reason.
    """
    import torch

    args, kwargs = _arguments(example_inputs)
    _register_dataclasses(model, args, kwargs)
    try:  # Dim.AUTO is torch >= 2.6: an older torch falls back to fx too
        dims = _free_dims(args, kwargs)
        return torch.export.export(model, args, kwargs, strict=False, dynamic_shapes=dims)
    except Exception as error:  # export raises many kinds, all meaning "cannot capture"
        raise ScheduleConfigError(
            f"torch.export could not capture {type(model).__name__}'s forward on example_inputs "
            f"({first_line(error)})"
        ) from error


def _register_dataclasses(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Register with torch's pytree every dataclass class in the model's output that is not
    yet a pytree node (Hugging Face registers its `ModelOutput`s itself), so export can
    flatten it: the model runs once, without gradients, on the example."""
    import dataclasses

    import torch
    import torch.utils._pytree as pytree

    with torch.no_grad(), torch.random.fork_rng():
        output = call_user(
            f"{type(model).__name__}'s forward on example_inputs",
            lambda: model(*args, **kwargs),
            error=ScheduleConfigError,
            hint="example_inputs are a batch's inputs, as the engines pass them to the model",
        )
    pending = [output]
    while pending:
        value = pending.pop()
        if isinstance(value, (tuple, list)):
            pending.extend(value)
        elif isinstance(value, dict):
            pending.extend(value.values())
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            if type(value) not in pytree.SUPPORTED_NODES:
                torch.export.register_dataclass(type(value))
            pending.extend(getattr(value, field.name) for field in dataclasses.fields(value))


def exported_graph(program: Any, model: nn.Module | None = None) -> ExportedGraph:
    """The graph of an `ExportedProgram` to cut, its attributes looked up on `model` first.

    Without `model`, they come from `program.module()`, which holds the exported model's own
    Parameters and buffers (torch.export keeps the objects it was given).
    """
    unlifted = unlifted_module(program)
    graph = unlifted.graph
    for node in list(graph.nodes):  # guard checks are not the model's
        if node.op == "call_module" and not node.users:
            graph.erase_node(node)
    graph.eliminate_dead_code()
    _name_by_use(graph, unlifted if model is None else model)
    info = graph._codegen.pytree_info
    source = unlifted if model is None else _attributes(model, unlifted)
    return ExportedGraph(graph, source, info)


def _name_by_use(graph: fx.Graph, model: nn.Module) -> None:
    """Read a tensor of several names (a tie) under the name the module using it gives it.

    Export reads a tied Parameter under one of its names everywhere (GPT-2's embedding lookup
    reads `lm_head.weight`); each use here gets its own `get_attr` of the name nearest the
    module in whose call it is used (`transformer.wte.weight` for the lookup), so a segment
    names what it holds as the model's module does. The object is the same either way.
    """
    import itertools

    names: dict[int, list[str]] = {}
    for name, tensor in itertools.chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
    ):
        names.setdefault(id(tensor), []).append(name)
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        aliases = names.get(id(_resolve(model, node.target)), [])
        if len(aliases) < 2:
            continue
        for user in list(node.users):
            stack = list((user.meta.get("nn_module_stack") or {}).values())
            where = stack[-1][0] + "." if stack else ""
            best = max(aliases, key=lambda name: (_common_prefix(name, where), name == node.target))
            if best != node.target:
                with graph.inserting_before(user):
                    alias = graph.get_attr(best)
                alias.meta = dict(node.meta)
                user.replace_input_with(node, alias)
        if not node.users:
            graph.erase_node(node)


def _resolve(model: nn.Module, target: str) -> Any:
    value: Any = model
    for part in target.split("."):
        value = getattr(value, part, None)
    return value


def _common_prefix(name: str, where: str) -> int:
    """How many leading dotted parts `name` shares with the module path `where`."""
    count = 0
    for a, b in zip(name.split("."), where.split(".")):
        if a != b:
            break
        count += 1
    return count


def unlifted_module(program: Any) -> nn.Module:
    """`program.module()`, without the guard check torch >= 2.9 adds to its graph."""
    try:
        return program.module(check_guards=False)
    except TypeError:  # an older torch: no guards to leave out
        return program.module()


def module_names(graph: fx.Graph) -> set[str]:
    """Every submodule whose call the exported graph records (a split point must be one)."""
    return {
        path
        for node in graph.nodes
        for path, _ in (node.meta.get("nn_module_stack") or {}).values()
        if path
    }


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


def follow_device(part: fx.Graph) -> None:
    """Make the tensors a segment's code creates follow the segment's device.

    An exported graph spells out the device (and dtype) of every tensor its `forward` makes or
    moves, as it was while tracing (`arange(..., device=cpu)`, `to(x, cpu, torch.bool)`), and
    asserts the metadata of some inputs. Here each device argument reads the device of a tensor
    the segment holds at run time instead, so a segment moved with `.to(device)` (a rank's GPU)
    makes its tensors there, and the asserts, which would refuse that move, are dropped. Dtypes
    stay as traced: export in the dtype you train in.
    """
    import torch

    assert_metadata = getattr(torch.ops.aten, "_assert_tensor_metadata", None)
    held = next((node.target for node in part.nodes if node.op == "get_attr"), None)
    for node in list(part.nodes):
        if node.op != "call_function":
            continue
        if assert_metadata is not None and node.target is assert_metadata.default:
            part.erase_node(node)
        elif held is not None and any(
            isinstance(a, torch.device) for a in (*node.args, *node.kwargs.values())
        ):
            with part.inserting_before(node):
                device = part.call_function(getattr, (part.get_attr(held), "device"))
            node.args = tuple(device if isinstance(a, torch.device) else a for a in node.args)
            node.kwargs = {
                k: device if isinstance(a, torch.device) else a for k, a in node.kwargs.items()
            }


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
    import dataclasses
    from collections.abc import Mapping

    if type(example_inputs) is tuple:
        return example_inputs, {}
    if isinstance(example_inputs, Mapping) and not dataclasses.is_dataclass(example_inputs):
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
