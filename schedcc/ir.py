"""The instructions a pipeline program is made of.

Each instruction is a small frozen value with a short printable form that `parse` inverts exactly:
`F3.1` is the forward of microbatch 3 on chunk 1, `F3` the same on chunk 0. Stage `s` runs its
instructions in order; the segment an instruction touches is `schedule.segment_of(s, chunk)`.

    >>> from schedcc.ir import Forward, parse
    >>> str(Forward(3, chunk=1))
    'F3.1'
    >>> parse("SG2") == SendGrad(2)
    True

How an instruction is spelled lives in one table, `INSTRUCTIONS` (class, code, printed form;
see [Note: the instruction table]). To add an instruction:

1. write its class here, an attrs `frozen=True, slots=True` subclass of `Compute`, `Comm`,
   `Copy` or `Update` with a "Roughly:" docstring and int fields only;
2. add its row to `INSTRUCTIONS`: `Spelling(Offload, "O", "{microbatch}[.{chunk}]")` spells
   `Offload(3, chunk=1)` as `O3.1`. Its `code`, `str`, `parse`, the error messages and its
   group (`COMPUTE`, `COMM`, `COPY`, `UPDATE`) follow from the row, and
   `tests/core/test_instruction_table.py` round-trips it;
3. export it (`__all__` here and in `schedcc/__init__.py`), then give it its meaning where the
   other instructions have theirs: the rendezvous model (`schedcc.semantics`), the rules
   (`schedcc.validate.RULES`), the costs (`schedcc.costs`) and one handler in each runtime's
   table (`backends/runtime/stage.py`'s `_dispatch`).
"""

from __future__ import annotations

import re
from typing import ClassVar

import attrs

__all__ = [
    "COMM",
    "COMPUTE",
    "COPY",
    "INPUT_GRADIENT",
    "RECEIVES",
    "SENDS",
    "SHARDING",
    "UPDATE",
    "WEIGHT_GRADIENT",
    "Backward",
    "BackwardInput",
    "BackwardWeight",
    "Comm",
    "Compute",
    "Copy",
    "Forward",
    "GatherParams",
    "GradNorm",
    "INSTRUCTIONS",
    "Instruction",
    "OnMicrobatch",
    "Offload",
    "OptimizerStep",
    "OverlappedBackward",
    "RecvActivation",
    "Recompute",
    "RecvGrad",
    "ReduceGrads",
    "ReduceTied",
    "Reload",
    "Reshard",
    "SendActivation",
    "SendGrad",
    "Spelling",
    "Unshard",
    "Update",
    "parse",
    "spelling",
]


#: One field of a printed form: its name, and whether it is left out when 0 (after a dot).
_FIELD = re.compile(r"\{(\w+)\}|\[\.\{(\w+)\}\]")


@attrs.frozen
class Spelling:
    """How the instructions of one class are written: `code`, then the fields `form` names.

    In `form`, `{field}` is an int field printed as is and `[.{field}]` one printed after a dot
    only when it is not 0 (a row of `INSTRUCTIONS`; see [Note: the instruction table]).

    >>> row = Spelling(Forward, "F", "{microbatch}[.{chunk}]")
    >>> row.write(Forward(3, chunk=1)), row.write(Forward(3)), row.read("F3.1")
    ('F3.1', 'F3', Forward(microbatch=3, chunk=1))
    >>> print(row.pattern.pattern)
    F([0-9]+)(?:\\.([0-9]+))?
    """

    cls: type[Instruction]
    code: str
    form: str = ""
    #: `(field, optional)` for each field of `form`, in order
    fields: tuple[tuple[str, bool], ...] = attrs.field(init=False, repr=False)
    #: what `parse` matches: the code, then the fields' digits
    pattern: re.Pattern[str] = attrs.field(init=False, repr=False)

    @fields.default
    def _fields(self) -> tuple[tuple[str, bool], ...]:
        assert _FIELD.sub("", self.form) == "", f"{self.form!r}: only {{f}} and [.{{f}}]"
        found = _FIELD.findall(self.form)
        fields = tuple((plain or dotted, bool(dotted)) for plain, dotted in found)
        names = tuple(field.name for field in attrs.fields(self.cls))
        assert tuple(name for name, _ in fields) == names, f"{self.form!r} must show {names}"
        return fields

    @pattern.default
    def _pattern(self) -> re.Pattern[str]:
        assert self.code, f"{self.cls.__name__} needs a code"
        assert not set(self.code) & set("0123456789."), f"{self.code!r}: no digit or dot"
        parts = [r"(?:\.([0-9]+))?" if optional else "([0-9]+)" for _, optional in self.fields]
        return re.compile(re.escape(self.code) + "".join(parts))

    @property
    def example(self) -> str:
        """The printed form with every field 1 (`F1.1`, `Tied1`, `Step`), for messages."""
        return self.write(self.cls(*[1] * len(self.fields)))

    def write(self, op: Instruction) -> str:
        """`op`'s printed form (what `str(op)` returns)."""
        text = self.code
        for name, optional in self.fields:
            value = getattr(op, name)
            if not optional:
                text = f"{text}{value}"
            elif value:
                text = f"{text}.{value}"
        return text

    def read(self, text: str) -> Instruction | None:
        """The instruction `text` spells, or None when it is not this row's form."""
        match = self.pattern.fullmatch(text)
        if match is None:
            return None
        return self.cls(*[int(digits) if digits else 0 for digits in match.groups()])


@attrs.frozen(slots=True)
class Instruction:
    """Base of every instruction.

    Tell kinds apart by type (`isinstance(op, Comm)`, `type(op) in WEIGHT_GRADIENT`); `code` is
    the printed name (`F`, `SA`, `Step`, ...: the class's row of `INSTRUCTIONS`) and `group`
    ("compute", "comm", "copy" or "update") is kept for display.
    """

    group: ClassVar[str] = ""
    code: ClassVar[str] = ""

    def __str__(self) -> str:
        row = _row_of(type(self))
        return repr(self) if row is None else row.write(self)  # a base class has no row


@attrs.frozen(slots=True)
class OnMicrobatch(Instruction):
    """Base of the instructions on one microbatch and chunk: every compute and comm instruction.

    >>> isinstance(Forward(3, chunk=1), OnMicrobatch)
    True
    """

    microbatch: int
    chunk: int = 0


@attrs.frozen(slots=True)
class Compute(OnMicrobatch):
    """Base of the compute instructions."""

    group: ClassVar[str] = "compute"


@attrs.frozen(slots=True)
class Comm(OnMicrobatch):
    """Base of the point-to-point instructions; `is_send` tells the direction."""

    group: ClassVar[str] = "comm"
    is_send: ClassVar[bool] = False
    carries_grad: ClassVar[bool] = False


@attrs.frozen(slots=True)
class Copy(OnMicrobatch):
    """Base of the instructions that move a forward's saved activations between the device and
    the host, on the stage's copy lane (they overlap compute, not each other)."""

    group: ClassVar[str] = "copy"


@attrs.frozen(slots=True)
class Update(Instruction):
    """Base of the data-parallel and optimizer instructions."""

    group: ClassVar[str] = "update"


@attrs.frozen(slots=True)
class Forward(Compute):
    """Roughly: `outputs[i, c] = segment[c](inputs[i, c])`, with the loss on the last segment."""


@attrs.frozen(slots=True)
class Backward(Compute):
    """Roughly: `grads[i, c] = d outputs[i, c] / d inputs, weights`, accumulated into `.grad`."""


@attrs.frozen(slots=True)
class BackwardInput(Compute):
    """Roughly: `grads[i, c] = d outputs[i, c] / d inputs`; keeps what `BackwardWeight` needs."""


@attrs.frozen(slots=True)
class BackwardWeight(Compute):
    """Roughly: `weight.grad += d outputs[i, c] / d weights`, from what `BackwardInput` kept."""


@attrs.frozen(slots=True)
class Recompute(Compute):
    """Roughly: `graph[i, c] = segment[c](inputs[i, c])` again, on the RNG state its forward used.

    Its presence declares that the forward of microbatch i on chunk c keeps only its input (it
    saves nothing for a backward); `R` rebuilds the graph, and the microbatch's activations are
    held from `R` to its last backward piece (see [Note: recomputation] in docs/design.md).
    """


@attrs.frozen(slots=True)
class OverlappedBackward(Backward):
    """Roughly: `Backward(i, c)` run overlapped with the `Forward` just before it on its stage.

    The pair is the overlapped forward/backward of DualPipe-style schedules: a stage reads
    `F3.1 +B1`, the forward of microbatch 3 on chunk 1 overlapped with the backward of
    microbatch 1 on chunk 0. It means what the two mean in order (the CPU backends run them in
    order); the compiler puts the pair's receives before the forward and its sends after the
    backward, and the simulator prices the pair as `CostModel.overlap` says (see [Note:
    overlapped pairs] in `schedcc.rules.overlap`).

    >>> str(OverlappedBackward(1)), parse("+B1.2")
    ('+B1', OverlappedBackward(microbatch=1, chunk=2))
    """


@attrs.frozen(slots=True)
class SendActivation(Comm):
    """Roughly: `send(outputs[i, c], to=stage of segment k + 1)`."""

    is_send: ClassVar[bool] = True


@attrs.frozen(slots=True)
class RecvActivation(Comm):
    """Roughly: `inputs[i, c] = recv(from=stage of segment k - 1)`."""


@attrs.frozen(slots=True)
class SendGrad(Comm):
    """Roughly: `send(d loss / d inputs[i, c], to=stage of segment k - 1)`."""

    is_send: ClassVar[bool] = True
    carries_grad: ClassVar[bool] = True


@attrs.frozen(slots=True)
class RecvGrad(Comm):
    """Roughly: `output_grads[i, c] = recv(from=stage of segment k + 1)`."""

    carries_grad: ClassVar[bool] = True


@attrs.frozen(slots=True)
class ReduceGrads(Update):
    """Roughly: `grads[c] = mean over data-parallel ranks` (reduce-scatter under ZeRO)."""

    chunk: int = 0


@attrs.frozen(slots=True)
class OptimizerStep(Update):
    """Roughly: `weights = optimizer.step(weights, grads); grads = 0; version += 1`."""


@attrs.frozen(slots=True)
class GatherParams(Update):
    """Roughly: `weights[c] = all_gather(this rank's updated shard of weights[c])` (ZeRO-1)."""

    chunk: int = 0


@attrs.frozen(slots=True)
class ReduceTied(Update):
    """Roughly: `grad[w] = sum of grad[copy] over every copy of w` for each parameter `w` that
    the segments of `Program.tied[tie]` share (a collective among their stages)."""

    tie: int = 0


@attrs.frozen(slots=True)
class GradNorm(Update):
    """Roughly: `norm = sqrt(sum over every stage and shard of |grad|^2)`; clip the gradients by
    it, or mark the step skipped when it is not finite (a collective among all stages)."""


@attrs.frozen(slots=True)
class Unshard(Update):
    """Roughly: `weights[c] = all_gather(every rank's shard of weights[c])` (ZeRO-3: the chunk's
    parameters are whole from here until its `Reshard`)."""

    chunk: int = 0


@attrs.frozen(slots=True)
class Reshard(Update):
    """Roughly: `del weights[c]` but this rank's shard (ZeRO-3: no compute on chunk c until the
    next `Unshard`)."""

    chunk: int = 0


@attrs.frozen(slots=True)
class Offload(Copy):
    """Roughly: `host[i, c] = saved_tensors(graph[i, c]).to("cpu", non_blocking=True)`, freeing
    the device copy once the side stream has it.

    The forward of microbatch i on chunk c keeps its graph, but its saved activations live in
    host memory from here until its `Reload` (see [Note: offloading] in
    `schedcc.rules.offload`). Printed `O3.1`.

    >>> str(Offload(3, chunk=1)), parse("O3.1")
    ('O3.1', Offload(microbatch=3, chunk=1))
    """


@attrs.frozen(slots=True)
class Reload(Copy):
    """Roughly: `saved_tensors(graph[i, c]) = host[i, c].to(device, non_blocking=True)`, waited
    for by the first backward piece of microbatch i on chunk c. Printed `L3.1`.

    >>> str(Reload(3)), parse("L3.1")
    ('L3', Reload(microbatch=3, chunk=1))
    """


#: [Note: the instruction table] Every instruction's spelling, one row per class: its code,
#: then the fields its printed form shows after the code. `{field}` is an int printed as is;
#: `[.{field}]` is printed after a dot, and only when it is not 0. `parse`, every `str`, the
#: error messages, the drawings and the golden files read this table and nothing else; the
#: class groups below (`COMPUTE`, `COMM`, `COPY`, `UPDATE`) are read off it too.
INSTRUCTIONS: tuple[Spelling, ...] = (
    Spelling(Forward, "F", "{microbatch}[.{chunk}]"),
    Spelling(Backward, "B", "{microbatch}[.{chunk}]"),
    Spelling(BackwardInput, "I", "{microbatch}[.{chunk}]"),
    Spelling(BackwardWeight, "W", "{microbatch}[.{chunk}]"),
    Spelling(Recompute, "R", "{microbatch}[.{chunk}]"),
    Spelling(OverlappedBackward, "+B", "{microbatch}[.{chunk}]"),
    Spelling(SendActivation, "SA", "{microbatch}[.{chunk}]"),
    Spelling(RecvActivation, "RA", "{microbatch}[.{chunk}]"),
    Spelling(SendGrad, "SG", "{microbatch}[.{chunk}]"),
    Spelling(RecvGrad, "RG", "{microbatch}[.{chunk}]"),
    Spelling(Offload, "O", "{microbatch}[.{chunk}]"),
    Spelling(Reload, "L", "{microbatch}[.{chunk}]"),
    Spelling(ReduceGrads, "Reduce", "[.{chunk}]"),
    Spelling(OptimizerStep, "Step"),
    Spelling(GatherParams, "Gather", "[.{chunk}]"),
    Spelling(ReduceTied, "Tied", "{tie}"),
    Spelling(GradNorm, "Norm"),
    Spelling(Unshard, "Unshard", "[.{chunk}]"),
    Spelling(Reshard, "Reshard", "[.{chunk}]"),
)

_BY_CLASS: dict[type[Instruction], Spelling] = {row.cls: row for row in INSTRUCTIONS}
_BY_CODE: dict[str, Spelling] = {row.code: row for row in INSTRUCTIONS}
assert len(_BY_CLASS) == len(_BY_CODE) == len(INSTRUCTIONS), "a class or code written twice"
for _row in INSTRUCTIONS:
    _row.cls.code = _row.code
del _row

COMPUTE = tuple(row.cls for row in INSTRUCTIONS if issubclass(row.cls, Compute))
COMM = tuple(row.cls for row in INSTRUCTIONS if issubclass(row.cls, Comm))
#: The instructions on a stage's copy lane (device <-> host).
COPY = tuple(row.cls for row in INSTRUCTIONS if issubclass(row.cls, Copy))
UPDATE = tuple(row.cls for row in INSTRUCTIONS if issubclass(row.cls, Update))
#: ZeRO-3's instructions that make a chunk's parameters whole and release them again.
SHARDING = (Unshard, Reshard)
#: The computes that add to a chunk's weight gradients (`.grad`).
WEIGHT_GRADIENT = (Backward, BackwardWeight, OverlappedBackward)
#: The computes that make a microbatch's input gradient (what `SendGrad` sends).
INPUT_GRADIENT = (Backward, BackwardInput, OverlappedBackward)
SENDS = (SendActivation, SendGrad)
RECEIVES = (RecvActivation, RecvGrad)

_CODE = re.compile(r"[^0-9.]*")


def spelling(cls: type[Instruction]) -> Spelling:
    """The row of `INSTRUCTIONS` that spells instructions of class `cls` (a subclass the table
    does not name is spelled as the nearest class it does).

    Raises:
        TypeError: `cls` is no instruction class of the table (a base such as `Compute`).

    >>> spelling(ReduceTied).code, spelling(ReduceTied).example
    ('Tied', 'Tied1')
    """
    row = _row_of(cls)
    if row is None:
        raise TypeError(f"{cls.__name__} has no row in schedcc.ir.INSTRUCTIONS; add one")
    return row


def _row_of(cls: type) -> Spelling | None:
    try:
        return _BY_CLASS[cls]
    except KeyError:  # a subclass the table does not name, or a base class
        return next((_BY_CLASS[base] for base in cls.__mro__ if base in _BY_CLASS), None)


def parse(text: str) -> Instruction:
    """The instruction whose `str` is `text`; raises `ValueError` for anything else, naming
    every code of `INSTRUCTIONS`.

    >>> parse("B7.2")
    Backward(microbatch=7, chunk=2)
    >>> parse("Tied0"), parse("Step")
    (ReduceTied(tie=0), OptimizerStep())
    """
    text = text.strip()
    code = _CODE.match(text).group()
    row = _BY_CODE.get(code)
    op = row.read(text) if row is not None else None
    if op is None:
        examples = ", ".join(row.example for row in INSTRUCTIONS)
        raise ValueError(f"cannot parse instruction {text!r}: expected one of {examples}")
    return op
