"""How `StageRuntime` applies a segment: as it is, recomputing every N layers, or compiled.

[Note: recomputing every N layers] `Engine(..., recompute_layers=N)` is DeepSpeed's
`activation_checkpoint_interval=N`: a segment that is an `nn.Sequential` (what
`schedcc.partition` builds) runs as groups of N consecutive layers, each through
`torch.utils.checkpoint.checkpoint(use_reentrant=False)`. A forward then keeps only each
group's input (the boundaries every N layers, which the runtime's saved-tensor hooks count as
activations: `backends.runtime.memory`); autograd replays a group, on the RNG state it started
from, when a backward first reaches it, and frees the replayed activations as it goes. The
program does not change (the instructions, the proofs and the simulated times are the same);
only the activation bytes a forward leaves behind, and the time a backward takes, do. A split
backward (`BackwardInput` then `BackwardWeight`) is two autograd passes, so each group is
replayed twice, once for each. A group runs on the tensors the forward ran on (stashed weights
under weight delay, private copies of tied parameters), captured when the forward ran, so the
replay computes with the same weights whatever the live parameters have become. It composes
with `compile(recompute=...)`: the `Recompute` rebuilds the segment's graph group by group.

[Note: compiled segments] `Engine(..., compile=True)` runs each layer of an `nn.Sequential`
segment (as DeepSpeed's `PipelineModule.compile()`), or a whole segment of another kind, through
`torch.compile` (inductor; `compile="aot_eager"` or any backend name for another), on the
segment's own parameters, or through `torch.func.functional_call` on other tensors (stashed
weights, tied copies). Per layer, because dynamo keys a compiled graph on the code it traces and
guards it on the module's structure: layers of one structure share one graph (compiled once),
where whole segments or groups, whose layers' names differ, would each compile their own and,
past dynamo's recompile limit (8), run eagerly. The caller's modules are not changed. A program
with split backwards is refused: a compiled unit's backward is one autograd node, so
`BackwardInput` cannot leave its weight half to `BackwardWeight` (it would run whole in both
passes), and torch refuses a second pass over a compiled backward that frees its saved tensors
as it goes (donated buffers), which a compiled graph shared with another module of the same
structure may do. Inductor may fuse and reorder floating-point operations, so a compiled run
equals eager within float rounding, not bit for bit (docs/training.md says how close).

[Note: a compute's own time] A compute's time on a stage is the segment's own work (the user's
forward and loss, autograd's backward over them) and the runtime's around it (taking the input,
holding the graph, handing the output on, its bookkeeping). Cutting a stage finer divides the
first among the chunks, not the second: on the CPU the runtime's part is 0.05-0.2 ms a compute,
up to 9% of a tiny-gpt stage's forward at p = 2. So `StageRuntime.segment_clock` adds up the
seconds spent in the segment's own work, and the distributed engine records what each compute
took of it beside its span (which it ends once the sends of what the compute made are posted,
the stage's time too); a trace carries it (`"segment_us"`) and `CostModel.from_trace` reads the
rest as the compute's fixed time ([Note: a compute's fixed time] in `schedcc.costs`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from schedcc.backends.runtime.values import call
from schedcc.errors import ScheduleConfigError
from schedcc.ir import BackwardInput

if TYPE_CHECKING:
    from schedcc.program import Program

__all__ = [
    "SegmentCall",
    "SegmentClock",
    "check_compile",
    "check_one_value",
    "check_recompute_layers",
]


class SegmentClock:
    """The seconds a stage spent in its segments' own work, added up: a `with` block each
    ([Note: a compute's own time]). Blocks do not nest.

    >>> clock = SegmentClock()
    >>> with clock:
    ...     pass
    >>> clock.seconds >= 0.0
    True
    """

    __slots__ = ("_start", "seconds")

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.seconds += time.perf_counter() - self._start


def check_recompute_layers(every: object) -> int | None:
    """`recompute_layers` checked: None (off) or a positive int.

    Raises:
        ScheduleConfigError: anything else.
    """
    if every is None:
        return None
    if type(every) is not int or every < 1:
        raise ScheduleConfigError(
            f"recompute_layers must be None or a positive number of layers, got {every!r}: "
            "e.g. recompute_layers=2 keeps every 2nd layer boundary of each segment"
        )
    return every


def check_one_value(program: Program, every: int | None, backend: str | None) -> None:
    """Layered recomputation (`every`) and a compiled segment (`backend`) apply a segment to
    one value: a program of sequence parts, whose segments also take a carry, is refused.

    Raises:
        ScheduleConfigError: either with sequence parts.
    """
    schedule = program.schedule
    if schedule.num_parts > 1 and (every or backend):
        raise ScheduleConfigError(
            f"recompute_layers= and compile= apply a segment to one value; {schedule!r} "
            "runs sequence parts, whose segments take (x, carry): leave both off"
        )


def check_compile(backend: object, program: Program) -> str | None:
    """`compile` checked for `program`: False (off), True (inductor) or a `torch.compile`
    backend's name; the backend's name, or None for off.

    Raises:
        ScheduleConfigError: not a bool or a known backend's name, or a program with split
            backwards ([Note: compiled segments]).
    """
    if backend is False or backend is None:
        return None
    split = next((op for ops in program.stages for op in ops if type(op) is BackwardInput), None)
    if split is not None:
        raise ScheduleConfigError(
            f"compile: the program splits its backwards ({split}), but a compiled segment's "
            "backward is one autograd node that cannot leave its weight half for later: "
            "compile a schedule without split backwards (e.g. 1f1b, interleaved-1f1b), or "
            "run eager (compile=False)"
        )
    if backend is True:
        return "inductor"
    if not isinstance(backend, str) or backend not in torch._dynamo.list_backends(exclude_tags=()):
        usual = sorted({*torch._dynamo.list_backends(), "aot_eager", "eager"})
        raise ScheduleConfigError(
            f"compile must be True (inductor), False or a torch.compile backend's name (e.g. "
            f"{', '.join(usual)}), got {backend!r}"
        )
    return backend


class SegmentCall:
    """Applies one segment to a boundary value, as [Note: recomputing every N layers] and
    [Note: compiled segments] say.

    Args:
        module: the segment.
        segment: its index, for messages.
        recompute_layers: None, or the number of layers in each recomputed group.
        compile: None, or the `torch.compile` backend to run each unit through.

    Raises:
        ScheduleConfigError: `recompute_layers` for a segment that is not an `nn.Sequential`
            of at least one layer.

    >>> layers = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(3)))
    >>> [list(unit._modules) for unit in SegmentCall(layers, segment=0, recompute_layers=2)._units]
    [['0', '1'], ['2']]
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        segment: int,
        recompute_layers: int | None = None,
        compile: str | None = None,
    ) -> None:
        self._layered = recompute_layers is not None
        units = _groups(module, segment, recompute_layers) if self._layered else [module]
        self._units: list[nn.Module] = units
        #: what runs each unit: the unit, or compiled ([Note: compiled segments])
        self._run = [_compiled(unit, compile) if compile else unit for unit in units]
        #: per unit, the names of its parameters (with duplicates) and the segment's name of each
        canonical = {id(p): name for name, p in module.named_parameters()}
        self._names = [
            [(name, canonical[id(p)]) for name, p in run.named_parameters(remove_duplicate=False)]
            for run in self._run
        ]

    def __call__(self, value: Any, params: Mapping[str, torch.Tensor] | None = None) -> Any:
        """The segment applied to `value` (a tuple as positional arguments, a dict as keyword
        arguments: `backends.runtime.values.call`), on its own parameters or, given `params`
        (the segment's parameter names to tensors), on those."""
        runs = [self._bound(u, params) for u in range(len(self._run))]
        if not self._layered or not torch.is_grad_enabled():
            out = call(runs[0], value)
            for run in runs[1:]:
                out = run(out)
            return out
        out = checkpoint(call, runs[0], value, use_reentrant=False)
        for run in runs[1:]:
            out = checkpoint(run, out, use_reentrant=False)
        return out

    def _bound(self, u: int, params: Mapping[str, torch.Tensor] | None) -> Callable[..., Any]:
        """Unit u, on its own parameters or on `params` (captured: a replay uses them too)."""
        run = self._run[u]
        if params is None:
            return run
        tensors = {name: params[key] for name, key in self._names[u]}

        def functional(*args: Any, **kwargs: Any) -> Any:
            return torch.func.functional_call(run, tensors, args, kwargs)

        return functional


def _compiled(unit: nn.Module, backend: str) -> nn.Module:
    """`unit` through `torch.compile`: each layer of an `nn.Sequential` (so that layers of one
    structure share one compiled graph), else the whole module."""
    if not _is_sequential(unit):
        return torch.compile(unit, backend=backend)
    compiled = OrderedDict(
        (name, torch.compile(layer, backend=backend)) for name, layer in unit.named_children()
    )
    return nn.Sequential(compiled)


def _is_sequential(module: nn.Module) -> bool:
    """Whether `module` runs its layers in order, each on the last one's output."""
    return isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward


def _groups(module: nn.Module, segment: int, every: int) -> list[nn.Module]:
    """`module`'s layers in groups of `every` (the last may be shorter), as `nn.Sequential`s
    that share the layers and keep their names."""
    sequential = _is_sequential(module)
    if not sequential or len(module) == 0:
        what = "an empty nn.Sequential" if sequential else f"a {type(module).__name__}"
        raise ScheduleConfigError(
            f"recompute_layers: segment {segment} is {what}, not an nn.Sequential of layers, so "
            "it has no layers to group: cut the model with schedcc.partition (nn.Sequential "
            "segments), or recompute whole segments with schedcc.compile(..., recompute=...)"
        )
    return [module[j : j + every] for j in range(0, len(module), every)]
