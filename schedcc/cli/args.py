"""The arguments the subcommands share, spelled one way in every command.

`--schedule`, `-p/--num-stages`, `-m/--num-microbatches`, `-v/--num-chunks`, `--batches`, `--dp`,
`--zero`, `--costs`. `--microbatches` and `--chunks` are kept as hidden aliases (older
`schedcc tune` lines use them). Every count has a bound that keeps a command interactive, and a
shape's size (`p * v * m * batches`) has one too (`check_size`). A file or directory a command
writes is checked before it does its work (`check_output_file`, `check_writable_directory`).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import attrs

from schedcc.costs import CHUNK_FIELDS, FIELD_OF_CODE, CostModel, cost_fields
from schedcc.errors import ScheduleConfigError
from schedcc.registry import get_schedule

__all__ = [
    "COST_KEYS",
    "MAX_SIZE",
    "UsageError",
    "add_batches",
    "add_chunks",
    "add_costs",
    "add_microbatches",
    "add_parallel",
    "add_parts",
    "add_schedule",
    "add_segment_costs",
    "add_stages",
    "check_size",
    "int_list",
    "parse_costs",
    "parse_segment_costs",
    "positive_int",
    "with_segments",
]

#: The largest value each count may take on the command line.
MAX_STAGES = 1024
MAX_MICROBATCHES = 65536
MAX_CHUNKS = 64
MAX_BATCHES = 64
#: The largest `p * v * m * batches` (segment-microbatches) one command compiles: ~25 s.
MAX_SIZE = 2**18

#: `--costs` keys: every duration field of `CostModel` and each instruction code that reads one.
COST_KEYS = {
    **{name: name for name in cost_fields()},
    **{code: field for code, field in FIELD_OF_CODE.items() if field in cost_fields()},
}


class UsageError(Exception):
    """A bad command-line value; printed as one line, exit 2."""


def positive_int(text: str, *, limit: int | None = None, what: str = "") -> int:
    """An argparse type: an integer >= 1 (and <= `limit`, a bound named by `what`)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    if limit is not None and value > limit:
        raise argparse.ArgumentTypeError(
            f"{value} is more than schedcc handles here: at most {limit} {what}"
        )
    return value


def _bounded(limit: int, what: str):
    def parse(text: str) -> int:
        return positive_int(text, limit=limit, what=what)

    parse.__name__ = "positive integer"  # argparse names the type in some messages
    return parse


def int_list(limit: int, what: str):
    """An argparse type: a comma-separated list of integers in 1..limit, sorted, no repeats."""
    one = _bounded(limit, what)

    def parse(text: str) -> list[int]:
        values = [one(part) for part in filter(None, (s.strip() for s in text.split(",")))]
        if not values:
            raise argparse.ArgumentTypeError(f"expected a list like 8,16, got {text!r}")
        return sorted(set(values))

    parse.__name__ = "list of positive integers"
    return parse


def parse_costs(text: str) -> CostModel:
    """An argparse type: `F=1,B=2,I=1,W=1,comm=0.1` (or the long field names) to a CostModel."""
    try:
        return CostModel(**_cost_fields(text))
    except ScheduleConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_segment_costs(text: str) -> tuple[dict[str, float], ...]:
    """An argparse type: `F=1.3,B=2.6;;;F=2.5,B=5`, the costs of each segment of the model in
    order (`;` between segments, an empty one taking `--costs`), as fields for
    `CostModel(per_segment=...)`.

    >>> parse_segment_costs("F=2;;B=3")
    ({'forward': 2.0}, {}, {'backward': 3.0})
    """
    segments = tuple(_cost_fields(part) for part in text.split(";"))
    for fields in segments:
        try:
            CostModel(**fields)
        except ScheduleConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return segments


def with_segments(
    base: CostModel, segments: tuple[dict[str, float], ...] | None, num_stages: int
) -> CostModel:
    """`base` with each segment's fields over it as `per_segment`, and each stage's (its
    consecutive segments summed, less `base`'s fixed parts but one: the cut at v = 1) as
    `per_stage`: what orders at a cut finer than the segments' read ([Note: segment costs])."""
    if segments is None:
        return base
    models = [attrs.evolve(base, **fields) for fields in segments]
    stages = attrs.evolve(base, per_segment=models).placed([(s, 0) for s in range(num_stages)])
    per_stage = {
        s: attrs.evolve(base, **{f: getattr(stages.at(s), f) for f in CHUNK_FIELDS})
        for s in range(num_stages)
    }
    return attrs.evolve(base, per_segment=models, per_stage=per_stage)


def _cost_fields(text: str) -> dict[str, float]:
    """`F=1,B=2` to `{"forward": 1.0, "backward": 2.0}` (an `ArgumentTypeError` if malformed)."""
    fields: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        name = COST_KEYS.get(key.strip())
        if not sep or name is None:
            raise argparse.ArgumentTypeError(
                f"bad cost {item!r}: expected KEY=NUMBER with KEY one of "
                f"{', '.join(COST_KEYS)} (e.g. F=1,B=2,comm=0.1)"
            )
        try:
            fields[name] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"bad cost {item!r}: {value!r} is not a number"
            ) from None
    return fields


def add_schedule(parser, *, default: str | None = None, required=False, many=False) -> None:
    """`--schedule NAME` (repeatable with `many`)."""
    text = "a registered name (see `schedcc list`), module:Class or path/to/file.py:Class"
    if many:
        parser.add_argument(
            "--schedule", action="append", default=[], metavar="NAME", help=f"{text}; repeatable"
        )
        return
    parser.add_argument("--schedule", default=default, required=required, metavar="NAME", help=text)


def add_stages(
    parser, *, default: int | None = None, required: bool = False, found: int | None = None
) -> None:
    """`-p/--num-stages P` (`found`: the default unless the schedule is a found order, whose
    own shape `fill_shape` takes)."""
    if found is not None:
        parser.set_defaults(found_stages=found)
    parser.add_argument(
        "-p",
        "--num-stages",
        type=_bounded(MAX_STAGES, "stages"),
        default=default,
        required=required,
        metavar="P",
        help="pipeline stages" + _found_default(found),
    )


def fill_shape(args, schedule: str | None) -> None:
    """`-p` and `-m` left out (None): a found order's own (`FoundOrder.shape`, the one shape it
    runs at), else the `found=` defaults `add_stages` and `add_microbatches` were given."""
    from schedcc.search import FoundOrder

    cls = None if schedule is None else get_schedule(schedule)
    own = cls.shape[:2] if isinstance(cls, type) and issubclass(cls, FoundOrder) else None
    if args.num_stages is None:
        args.num_stages = args.found_stages if own is None else own[0]
    if args.num_microbatches is None:
        args.num_microbatches = args.found_microbatches if own is None else own[1]


def add_microbatches(parser, *, default=None, many: bool = False, found: int | None = None):
    """`-m/--num-microbatches M` (with `many`: `M,...`, a list to try; `found` as in
    `add_stages`)."""
    kind = (int_list if many else _bounded)(MAX_MICROBATCHES, "microbatches")
    metavar = "M,..." if many else "M"
    text = "microbatch counts to try" if many else "microbatches per batch"
    text += _default(default) + _found_default(found)
    if found is not None:
        parser.set_defaults(found_microbatches=found)
    parser.add_argument(
        "-m", "--num-microbatches", type=kind, default=default, metavar=metavar, help=text
    )
    _alias(parser, "--microbatches", "num_microbatches", kind)


def add_chunks(parser, *, default=None, many: bool = False) -> None:
    """`-v/--num-chunks V` (with `many`: `V,...`); None means the schedule's own."""
    kind = (int_list if many else _bounded)(MAX_CHUNKS, "chunks per stage")
    metavar = "V,..." if many else "V"
    text = (
        "chunks per stage to try (default: the first two of each schedule's chunks)"
        if many
        else "chunks (virtual stages) per stage (default: the schedule's own, 1 for most)"
    )
    parser.add_argument(
        "-v", "--num-chunks", type=kind, default=default, metavar=metavar, help=text
    )
    _alias(parser, "--chunks", "num_chunks", kind)


def add_batches(parser, *, default: int | None = None) -> None:
    """`--batches N`: optimizer steps one program covers."""
    parser.add_argument(
        "--batches",
        type=_bounded(MAX_BATCHES, "batches"),
        default=default,
        metavar="N",
        help="batches (optimizer steps) in one program",
    )


def add_parts(parser) -> None:
    """`-k/--parts K`: sequence parts per microbatch (`num_parts`; None: the schedule's own)."""
    parser.add_argument(
        "-k",
        "--parts",
        type=positive_int,
        default=None,
        metavar="K",
        help="sequence parts per microbatch, m counting the parts (default: the schedule's own, "
        "1 for most, 2 for seq1f1b)",
    )


def add_parallel(parser, *, dp_default: int | None = 1, zero_choices=(0, 1, 2, 3)) -> None:
    """`--dp N` and `--zero Z`."""
    parser.add_argument(
        "--dp",
        type=_bounded(MAX_STAGES, "data-parallel replicas"),
        default=dp_default,
        metavar="N",
        help="data-parallel replicas (adds gradient reductions)",
    )
    parser.add_argument("--zero", type=int, choices=zero_choices, default=0, help="ZeRO stage")


def add_costs(parser, *, default: CostModel | None, help: str) -> None:
    """`--costs K=V,...`: the `CostModel` (`args.costs`) and the fields it names
    (`args.costs_named`), which alone fill what a trace lacks (`--costs-from`)."""
    parser.set_defaults(costs_named=frozenset())
    parser.add_argument("--costs", action=_Costs, default=default, metavar="K=V,...", help=help)


class _Costs(argparse.Action):
    """`--costs`: `parse_costs`, and the names of the fields it gives as `costs_named`."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        try:
            model = parse_costs(values)
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentError(self, str(exc)) from None
        setattr(namespace, self.dest, model)
        namespace.costs_named = frozenset(_cost_fields(values))


def add_segment_costs(parser) -> None:
    """`--segment-costs K=V,...;...` (`parse_segment_costs`; [Note: segment costs])."""
    parser.add_argument(
        "--segment-costs",
        type=parse_segment_costs,
        default=None,
        metavar="K=V,...;...",
        help="each segment's own compute costs, in model order, e.g. ';;;F=2.5,B=5' for a "
        "heavy last of 4 (an empty one: --costs); each is its own in any placement",
    )


def add_eager(parser, *, what: str = "time it") -> None:
    """`--eager`: time with sends that never wait ([Note: eager simulation])."""
    parser.add_argument(
        "--eager",
        action="store_true",
        help=f"{what} with sends that never wait, as the distributed engine runs on every "
        "transport (default: every exchange a rendezvous, the model the validator proves)",
    )


def _found_default(value: int | None) -> str:
    return "" if value is None else f" (default {value}, or a found order's own)"


def _default(value) -> str:
    """` (default 1,2)` for a help text, or "" when there is no default."""
    if value is None:
        return ""
    return f" (default {','.join(map(str, value)) if isinstance(value, list) else value})"


def _alias(parser, flag: str, dest: str, kind) -> None:
    """A hidden second spelling of a flag (not in --help, no default of its own)."""
    parser.add_argument(
        flag, dest=dest, type=kind, default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )


def check_size(num_stages: int, num_microbatches: int, num_chunks: int, num_batches=1) -> None:
    """Raise `UsageError` if the shape has more than `MAX_SIZE` segment-microbatches."""
    size = num_stages * num_chunks * num_microbatches * num_batches
    if size > MAX_SIZE:
        raise UsageError(
            f"p={num_stages}, m={num_microbatches}, v={num_chunks}, batches={num_batches} is "
            f"{size:,} segment-microbatches; the command line compiles at most {MAX_SIZE:,} "
            "(p * v * m * batches): use smaller values"
        )


def check_output_file(flag: str, path: str | os.PathLike, *, example: str) -> None:
    """`path` names a file this process can write: not a directory, in a directory that exists
    and that it can write in; checked before the command does its work, not after (`example`:
    a file name the message suggests).

    Raises:
        UsageError: naming `flag` and what to change.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        name = os.path.join(path, example)
        raise UsageError(f"{flag} {path} is a directory; give a file name, e.g. {name}")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise UsageError(f"{flag}: directory {directory} does not exist")
    check_writable_directory(flag, directory, may_create=False)


def check_writable_directory(flag: str, path: str, *, may_create: bool = True) -> None:
    """`path` is a directory this process can write in, or one it can create (`may_create`).

    Checked by writing a file there (as the command will), before it does its work.

    Raises:
        UsageError: naming `flag` and what to change.
    """
    target = os.path.abspath(path)
    existing = target
    while may_create and not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UsageError(f"{flag} {path}: {existing} exists and is not a directory")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise UsageError(
            f"{flag} {path}: cannot write in {existing} ({exc.strerror or exc}); pick a "
            "directory you can write to"
        ) from None
