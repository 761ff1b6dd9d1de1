"""`split`: cut any `nn.Module` into pipeline segments at named submodules (imports torch lazily).

    >>> import torch, schedcc
    >>> from schedcc.backends.run.gpt import GPT, GPTConfig
    >>> model = GPT(GPTConfig(num_blocks=4))
    >>> first, second = schedcc.split(model, ["blocks.2"])
    >>> first.tok.weight is second.head.weight  # the tie is one Parameter, in both segments
    True

[Note: splitting keeps the model's own modules] Without `example_inputs` (or with
`tracer="fx"`, or where export fails) `split` traces the model with `torch.fx`, treating every
submodule as a leaf except the ancestors of the split points, so the graph holds one
`call_module` node per block-level call and the tracer only ever reads the glue code around them
(the model's own `forward` and, for a point like `blocks.2.attn`, `blocks.2`'s). The graph is cut
before each point's call; each segment is an `fx.GraphModule` built from the original model, and
`GraphModule` installs the very module and Parameter objects the graph names (no copies). So a
segment trains the model in place, and a Parameter that two segments use, like a tied embedding
and LM head, is one object in both: a tie the engines can see by identity.

With `example_inputs` it exports the model instead, and cuts the exported graph the same way
([Note: cutting an exported model] in `schedcc.exporting`): the segments' `get_attr`s resolve
against the model, so they too hold its own Parameters. torch.distributed.pipelining's
`pipeline(model, mb_args, split_spec=...)` exports as well, but (tried on this project's GPT,
torch 2.13) its last stage's tied `head.weight` is a separate tensor from the first stage's
`tok.weight` (the copies drift unless their gradients are synchronised by hand), the example's
sequence length is baked into `view` shapes (a shorter batch fails), and its first stage takes
its inputs in another order than the model's `forward`. Here the ties are the model's objects,
every input dimension is exported free (`Dim.AUTO`), and the first segment flattens its
arguments by export's own input spec, so none of that happens.

A boundary value is the tuple of every value computed before a cut and used after it, in the
order the model computes them (for a GPT: the hidden state, the padding mask and the position
ids; in an exported graph also the integer sizes the code read from a shape); a value that skips
a segment passes through it. Parameters and buffers the glue code reads
(`get_attr`) never cross: each segment that reads one holds it. The first segment has the
model's `forward` signature; the last returns what the model returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from schedcc import exporting
from schedcc.errors import ScheduleConfigError

if TYPE_CHECKING:
    from torch import fx, nn

__all__ = ["even_points", "split", "tied_groups"]


def split(
    model: nn.Module,
    points: Sequence[str],
    *,
    example_inputs: Any = None,
    tracer: str = "auto",
) -> list[nn.Module]:
    """Cut `model` before each named submodule's call into `len(points) + 1` segments.

    Segments follow the calling convention of `schedcc.backends.runtime.values.call`: the first
    takes the model's inputs (a tuple as positional, a dict or other Mapping as keyword
    arguments), each later one takes the tuple its predecessor returns, the last returns the
    model's output (a Hugging Face `ModelOutput` too). They hold the model's own Parameters (no
    copies): shared Parameters stay shared, and `tied_groups(segments)` is the `tied=` to
    compile with.

    Args:
        model: any module whose `forward` calls each point exactly once, in the given order;
            or a `torch.export.ExportedProgram` of one, cut as it is (its module holds the
            exported model's own Parameters, so one export serves several cuts).
        points: qualified submodule names, e.g. `["blocks.2", "blocks.4"]` for three segments.
        example_inputs: a batch's inputs (a microbatch's, or a whole batch's). With them, the
            model is traced with `torch.export` (any Python in its `forward`, every input
            dimension left free unless the code fixes it); and the chained segments must compute
            exactly what the model computes on them, or `split` refuses.
        tracer: `"auto"` (export when `example_inputs` are given, falling back to torch.fx),
            `"export"` or `"fx"` (submodules called as they are, eagerly: any shapes and
            ranks, no inputs needed, but the glue code around the points must be traceable).

    Raises:
        ScheduleConfigError: a point that is not a submodule, not called exactly once, out of
            call order or inside another point; a model neither tracer can capture (the message
            carries both reasons), or that fails on `example_inputs`; segments that differ
            from the model on `example_inputs`.

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh(), torch.nn.Linear(2, 1))
    >>> [type(s).__name__ for s in split(model, ["1", "2"])]
    ['Segment0', 'Segment1', 'Segment2']
    >>> x = torch.ones(3, 2)
    >>> first, second = split(model, ["2"], example_inputs=x)  # torch.export
    >>> torch.equal(second(*first(x)), model(x))
    True
    >>> second.get_parameter("2.weight") is model[2].weight
    True
    """
    from torch.export import ExportedProgram

    if tracer not in ("auto", "export", "fx"):
        raise ScheduleConfigError(f"tracer must be 'auto', 'export' or 'fx', got {tracer!r}")
    if isinstance(model, ExportedProgram):
        if tracer == "fx":
            raise ScheduleConfigError("an ExportedProgram is cut as exported: not with tracer='fx'")
        return _split_program(model, points, example_inputs)
    names = _check_points(model, points)
    if tracer == "export" and example_inputs is None:
        raise ScheduleConfigError("tracer='export' needs example_inputs: a batch's inputs")
    why_not_export = "pass example_inputs= (a batch's inputs) to trace with torch.export"
    if example_inputs is not None and tracer != "fx":
        try:
            program = exporting.export(model, example_inputs)
            segments = _split_exported(exporting.exported_graph(program, model), names)
            _check_equal(model, segments, example_inputs)
            return segments
        except ScheduleConfigError as error:
            if tracer == "export":
                raise
            why_not_export = f"torch.export failed too: {error}"
    segments = _split_traced(model, names, why_not_export)
    if example_inputs is not None:
        _check_equal(model, segments, example_inputs)
    return segments


def tied_groups(segments: Sequence[nn.Module]) -> list[tuple[int, ...]]:
    """The `tied=` that covers every Parameter object `segments` (a model's, in order) share:
    groups of segment indices, merged where they overlap; `[]` when nothing is shared.

    >>> from schedcc.backends.run.gpt import GPT, GPTConfig
    >>> tied_groups(split(GPT(GPTConfig(num_blocks=4)), ["blocks.1", "blocks.3"]))
    [(0, 2)]
    """
    from schedcc.backends.runtime.tied import tied_groups as groups

    return groups(segments)


def _split_program(program: Any, points: Sequence[str], example_inputs: Any) -> list[nn.Module]:
    """`split` of an `ExportedProgram`: its graph cut as it is, its own module's attributes."""
    exported = exporting.exported_graph(program)  # its source: the program's own module
    source = exported.source
    known = exporting.module_names(exported.graph) | {n for n, _ in source.named_modules()}
    names = _check_names(points, known, "the exported program")
    segments = _split_exported(exported, names)
    if example_inputs is not None:
        _check_equal(source, segments, example_inputs)
    return segments


def _split_exported(exported: exporting.ExportedGraph, names: list[str]) -> list[nn.Module]:
    """`split` over torch.export ([Note: cutting an exported model] in `schedcc.exporting`)."""
    cuts = exporting.point_starts(exported.graph, names)
    return _cut(exported.graph, cuts, exported.source, exported)


def _split_traced(model: nn.Module, names: list[str], why_not_export: str) -> list[nn.Module]:
    """`split` over torch.fx ([Note: splitting keeps the model's own modules])."""
    graph = _trace(model, names, why_not_export)
    return _cut(graph, _cut_nodes(graph, names), model, None)


def _cut(
    graph: fx.Graph, cuts: list, source: nn.Module, exported: exporting.ExportedGraph | None
) -> list[nn.Module]:
    """The segments of `graph` cut before each of `cuts`, their attributes from `source`; an
    exported graph's segments also follow their device and flatten the model's inputs (the
    first) and rebuild its output (the last) by export's specs."""
    from torch import fx

    segment_of = _assign(graph, cuts)
    boundaries = _boundaries(graph, segment_of, len(cuts) + 1)
    segments = []
    for k in range(len(cuts) + 1):
        part = _segment_graph(graph, segment_of, boundaries, k)
        if exported is not None:
            exporting.follow_device(part)
            placeholders = [node.name for node in part.nodes if node.op == "placeholder"]
            part._codegen = exporting.segment_codegen(
                exported.in_info, placeholders, first=k == 0, last=k == len(cuts)
            )
        segments.append(fx.GraphModule(source, part, f"Segment{k}"))
    return segments


def even_points(model: nn.Module, num_segments: int, *, container: str | None = None) -> list[str]:
    """Split points that spread the entries of a module list evenly over `num_segments`.

    `container` names an `nn.ModuleList` or `nn.Sequential` inside `model`; by default the one
    with the most entries. Larger segments come first, as in `partition(..., "uniform")`.

    Raises:
        ScheduleConfigError: no such container, or fewer entries than segments.

    >>> from schedcc.backends.run.gpt import GPT, GPTConfig
    >>> even_points(GPT(GPTConfig(num_blocks=6)), 4)
    ['blocks.2', 'blocks.4', 'blocks.5']
    """
    from torch import nn

    lists = {
        name: module
        for name, module in model.named_modules()
        if name and isinstance(module, (nn.ModuleList, nn.Sequential))
    }
    if container is None and lists:
        container = max(lists, key=lambda name: len(lists[name]))
    if container not in lists:
        raise ScheduleConfigError(
            f"{type(model).__name__} has no ModuleList or Sequential named {container!r} to cut; "
            f"it has: {', '.join(lists) or 'none'}; pass split points by hand"
        )
    size = len(lists[container])
    if isinstance(num_segments, bool) or not isinstance(num_segments, int):
        raise ScheduleConfigError(f"the number of segments must be an int, got {num_segments!r}")
    if not 1 <= num_segments <= size:
        raise ScheduleConfigError(
            f"cannot cut the {size} entries of {container} into {num_segments} segments: use "
            "fewer stages or chunks, or a deeper model"
        )
    base, extra = divmod(size, num_segments)
    starts, start = [], 0
    for k in range(num_segments - 1):
        start += base + (1 if k < extra else 0)
        starts.append(f"{container}.{start}")
    return starts


def _check_points(model: nn.Module, points: Sequence[str]) -> list[str]:
    names = dict(model.named_modules(remove_duplicate=False))
    children = ", ".join(n for n, _ in model.named_children())
    return _check_names(points, names, f"{type(model).__name__} (its children: {children})")


def _check_names(points: Sequence[str], known: Any, what: str) -> list[str]:
    """`points` as a list, each a known submodule name, none twice, none inside another."""
    if isinstance(points, str) or not all(isinstance(p, str) for p in points):
        raise ScheduleConfigError(
            f"split points must be a list of submodule names, e.g. ['blocks.2'], got {points!r}"
        )
    names = list(points)
    for name in names:
        if name not in known or not name:
            raise ScheduleConfigError(
                f"{name!r} is not a submodule of {what}; name a submodule by its qualified "
                "name, e.g. 'blocks.2'"
            )
    if len(set(names)) != len(names):
        raise ScheduleConfigError(f"split points {names} name a submodule twice")
    for name in names:
        for other in names:
            if other.startswith(name + "."):
                raise ScheduleConfigError(
                    f"split point {other!r} lies inside split point {name!r}: a segment starts "
                    "at a whole call, so cut at one of them"
                )
    return names


def _trace(model: nn.Module, names: list[str], why_not_export: str) -> fx.Graph:
    """The fx graph of `model` with every submodule a leaf except the points' ancestors."""
    from torch import fx

    ancestors = {".".join(n.split(".")[:i]) for n in names for i in range(n.count(".") + 1)}

    class _Tracer(fx.Tracer):
        def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
            return qualified_name not in ancestors

    try:
        return _Tracer().trace(model)
    except Exception as error:  # fx raises TraceError, TypeError, RuntimeError, NameError...
        raise ScheduleConfigError(
            f"schedcc.split could not trace {type(model).__name__}'s forward around the split "
            f"points with torch.fx ({type(error).__name__}: {error}). Submodules are called as "
            "they are, so move Python control flow on tensor values into a submodule, or cut "
            f"at other points; {why_not_export}"
        ) from error


def _cut_nodes(graph: fx.Graph, names: list[str]) -> list[fx.Node]:
    calls: dict[str, list[fx.Node]] = {name: [] for name in names}
    for node in graph.nodes:
        if node.op == "call_module" and node.target in calls:
            calls[node.target].append(node)
    for name, nodes in calls.items():
        if len(nodes) != 1:
            raise ScheduleConfigError(
                f"split point {name!r} is called {len(nodes)} times by the model's forward; a "
                "segment starts at a submodule that runs exactly once per forward"
            )
    cuts = [calls[name][0] for name in names]
    order = {node: index for index, node in enumerate(graph.nodes)}
    in_order = sorted(names, key=lambda name: order[calls[name][0]])
    if in_order != names:
        raise ScheduleConfigError(
            f"split points {names} are not in the order the model calls them; use {in_order}"
        )
    return cuts


def _assign(graph: fx.Graph, cuts: list[fx.Node]) -> dict[fx.Node, int]:
    """The segment of every node (get_attr nodes have none: every segment reads its own)."""
    starts = set(cuts)
    segment_of, k = {}, 0
    for node in graph.nodes:
        if node in starts:
            k += 1
        if node.op != "get_attr":
            segment_of[node] = k
    return segment_of


def _boundaries(graph: fx.Graph, segment_of: dict, num_segments: int) -> list[list[fx.Node]]:
    """`boundaries[k]`: the values segment `k` receives (`k >= 1`), in computation order."""
    boundaries: list[list[fx.Node]] = [[] for _ in range(num_segments)]
    for node in graph.nodes:
        if node not in segment_of:
            continue
        last_use = max((segment_of[user] for user in node.users), default=0)
        for k in range(segment_of[node] + 1, last_use + 1):
            boundaries[k].append(node)
    return boundaries


def _segment_graph(graph: fx.Graph, segment_of: dict, boundaries: list, k: int) -> fx.Graph:
    from torch import fx

    part = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}

    def lookup(node: fx.Node) -> fx.Node:
        if node not in env:  # only a parameter or buffer read: each segment holds its own
            env[node] = part.get_attr(node.target)
        return env[node]

    for node in boundaries[k]:
        env[node] = part.placeholder(node.name)
    last = k == len(boundaries) - 1
    for node in graph.nodes:
        if node.op == "output":
            if last:
                part.output(fx.map_arg(node.args[0], lookup))
        elif segment_of.get(node) == k:
            env[node] = part.node_copy(node, lookup)
            if isinstance(env[node].type, str):  # a postponed annotation: unpicklable code
                env[node].type = None
    if not last:
        part.output(tuple(env[node] for node in boundaries[k + 1]))
    part.lint()
    return part


def _check_equal(model: nn.Module, segments: list[nn.Module], example_inputs: Any) -> None:
    """Refuse segments whose chained output differs from the model's on `example_inputs`."""
    import torch

    from schedcc.backends.runtime.values import call, flatten

    with torch.no_grad():
        with torch.random.fork_rng():
            expected = call(model, example_inputs)
        with torch.random.fork_rng():
            value = example_inputs
            for segment in segments:
                value = call(segment, value)
    (want, want_spec), (got, got_spec) = flatten(expected), flatten(value)
    same = want_spec == got_spec and all(
        a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        for a, b in zip(want, got, strict=True)
    )
    if not same:
        raise ScheduleConfigError(
            f"the segments of {type(model).__name__} do not compute what the model computes on "
            "example_inputs: the forward code around the split points was traced once, so a "
            "Python branch on the inputs (or on self.training) is fixed; move it into a submodule"
        )
