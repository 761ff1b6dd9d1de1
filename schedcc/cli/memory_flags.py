"""The memory flags of `schedcc show`, `tune` and `search`: `--recompute`, `--memory`,
`--memory-limit` (a count of microbatches, or bytes such as 12GiB with `--memory` or the bytes a
`--costs-from` run trace records)."""

from __future__ import annotations

import argparse
import math

import attrs

from schedcc.costs import CostModel
from schedcc.errors import ScheduleConfigError
from schedcc.memory_model import MemoryModel
from schedcc.sizes import format_size, parse_size

__all__ = [
    "add_memory",
    "bytes_line",
    "check_limit",
    "cut_line",
    "memory_limit",
    "memory_of",
    "parse_memory",
    "trace_memory",
    "with_memory",
]

_KEYS = ("activations", "parameters", "optimizer", "inputs", "gradients")
_SHORT = {"act": "activations", "params": "parameters", "opt": "optimizer", "grads": "gradients"}


def parse_memory(text: str) -> MemoryModel:
    """An argparse type: `activations=64MiB,parameters=1GiB,optimizer=2GiB` to a MemoryModel
    (`act`, `params`, `opt`, `grads` are short for those keys)."""
    fields: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        name = _SHORT.get(key.strip(), key.strip())
        if not sep or name not in _KEYS:
            raise argparse.ArgumentTypeError(
                f"bad memory size {item!r}: expected KEY=SIZE with KEY one of "
                f"{', '.join(_KEYS)} (e.g. activations=64MiB,parameters=1GiB)"
            )
        try:
            fields[name] = parse_size(value)
        except ScheduleConfigError as exc:
            raise argparse.ArgumentTypeError(f"bad memory size {item!r}: {exc}") from None
    return MemoryModel(**fields)


def memory_limit(text: str) -> float | str:
    """An argparse type: a positive number (microbatches), or a size with a unit (bytes)."""
    try:
        value = float(text)
    except ValueError:
        try:
            if parse_size(text) > 0:
                return text.strip()
        except ScheduleConfigError:
            pass
        raise argparse.ArgumentTypeError(
            f"expected a number of microbatches or a size such as 12GiB, got {text!r}"
        ) from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def add_memory(parser, *, limit: bool = False, recompute_help: str) -> None:
    """`--recompute`, `--memory K=SIZE,...` and, for `tune`, `--memory-limit N|SIZE`."""
    parser.add_argument("--recompute", action="store_true", help=recompute_help)
    parser.add_argument(
        "--memory",
        type=parse_memory,
        default=None,
        metavar="K=SIZE,...",
        help="bytes per stage's segment for peak-byte estimates, e.g. "
        "activations=64MiB,parameters=1GiB,optimizer=2GiB (one microbatch's activations; "
        "gradients default to the parameters' size)",
    )
    if limit:
        parser.add_argument(
            "--memory-limit",
            type=memory_limit,
            default=None,
            metavar="N|SIZE",
            help="drop programs holding more than N microbatches of one stage's activations, "
            "or, with --memory, more than SIZE bytes on a stage (e.g. 12GiB); without --memory, "
            "SIZE counts the activation bytes a --costs-from run trace records",
        )


def with_memory(costs: CostModel | None, memory: MemoryModel | None) -> CostModel | None:
    """`costs` carrying `memory` (None: unchanged)."""
    if memory is None:
        return costs
    return attrs.evolve(costs or CostModel(), memory=memory)


def memory_of(args) -> MemoryModel | None:
    """The bytes to count `--memory-limit` with: `--memory`, or, for a size without it, those
    the `--costs-from` trace records ([Note: a trace's bytes]); a size needs one of them."""
    limit, memory, trace = args.memory_limit, args.memory, args.costs_from
    if memory is None and isinstance(limit, str) and trace is not None:
        return trace_memory(trace, args.num_stages, args.num_chunks)
    check_limit(limit, memory)
    return memory


def trace_memory(trace: str, num_stages: int, num_chunks) -> MemoryModel:
    """The bytes a run's trace records, for a byte limit on orders that cut the model as that
    run did ([Note: a measured cut]); `num_chunks`: the chunks per stage asked for (a list, or
    None for each schedule's own), one of which must cut the model so (DualPipe's two chunks
    at v = 2 are each a replica's whole share, a cut in p)."""
    memory = MemoryModel.from_trace(trace)
    cut = memory.cut
    assert cut is not None
    if cut % num_stages:
        raise ScheduleConfigError(
            f"{trace} measured bytes on a model cut in {cut} segments, which {num_stages} "
            f"stages do not share evenly: take the trace of a first run with -p {num_stages}"
        )
    asked = (1, 2) if num_chunks is None else tuple(num_chunks)
    if not any(cut in (num_stages * v, num_stages * v // 2) for v in asked if v):
        v = cut // num_stages
        raise ScheduleConfigError(
            f"{trace} measured bytes on a model cut in {cut} segments, v = {v} on {num_stages} "
            f"stages, and the bytes hold for that cut: add -v {v}, or take the trace of a first "
            f"run at -v {', '.join(map(str, asked))}"
        )
    return memory


def cut_line(memory: MemoryModel | None, num_stages: int) -> str | None:
    """`bytes measured on a cut in 4 segments: orders at v = 2 ...`, where measured bytes hold
    for some chunk counts only ([Note: a measured cut]); None for bytes given by hand."""
    if memory is None or memory.cut is None:
        return None
    v, left = divmod(memory.cut, num_stages)
    if left:
        return None
    which = "orders at v = 1 and DualPipe's replicas" if v == 1 else f"orders at v = {v}"
    return f"bytes measured on a cut in {memory.cut} segments: {which} (others skipped)"


def check_limit(limit: float | str | None, memory: MemoryModel | None) -> None:
    """A size limit needs `--memory`; a plain number with `--memory` is bytes."""
    if isinstance(limit, str) and memory is None:
        raise ScheduleConfigError(
            f"--memory-limit {limit} is in bytes: give --memory activations=...,parameters=... "
            "to count bytes with, or --costs-from a schedcc run trace, which records them (or "
            "a plain number of microbatches)"
        )


def bytes_line(per_stage) -> str:
    """`peak bytes per stage [1.00 MiB, ...]`."""
    return "peak bytes per stage [" + ", ".join(format_size(b) for b in per_stage) + "]"
