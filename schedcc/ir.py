"""The instructions a pipeline program is made of.

Each instruction is a small frozen value with a short printable form that `parse` inverts exactly:
`F3.1` is the forward of microbatch 3 on chunk 1, `F3` the same on chunk 0. Stage `s` runs its
instructions in order; the segment an instruction touches is `schedule.segment_of(s, chunk)`.

    >>> from schedcc.ir import Forward, parse
    >>> str(Forward(3, chunk=1))
    'F3.1'
    >>> parse("SG2") == SendGrad(2)
    True
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
    "Unshard",
    "Update",
    "parse",
]


@attrs.frozen(slots=True)
class Instruction:
    """Base of every instruction.

    Tell kinds apart by type (`isinstance(op, Comm)`, `type(op) in WEIGHT_GRADIENT`); `code` is
    the printed name (`F`, `SA`, `Step`, ...) and `group` ("compute", "comm" or "update") is kept
    for display.
    """

    group: ClassVar[str] = ""
    code: ClassVar[str] = ""


@attrs.frozen(slots=True)
class OnMicrobatch(Instruction):
    """Base of the instructions on one microbatch and chunk: every compute and comm instruction.

    >>> isinstance(Forward(3, chunk=1), OnMicrobatch)
    True
    """

    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        if self.chunk:
            return f"{self.code}{self.microbatch}.{self.chunk}"
        return f"{self.code}{self.microbatch}"


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

    code: ClassVar[str] = "F"


@attrs.frozen(slots=True)
class Backward(Compute):
    """Roughly: `grads[i, c] = d outputs[i, c] / d inputs, weights`, accumulated into `.grad`."""

    code: ClassVar[str] = "B"


@attrs.frozen(slots=True)
class BackwardInput(Compute):
    """Roughly: `grads[i, c] = d outputs[i, c] / d inputs`; keeps what `BackwardWeight` needs."""

    code: ClassVar[str] = "I"


@attrs.frozen(slots=True)
class BackwardWeight(Compute):
    """Roughly: `weight.grad += d outputs[i, c] / d weights`, from what `BackwardInput` kept."""

    code: ClassVar[str] = "W"


@attrs.frozen(slots=True)
class Recompute(Compute):
    """Roughly: `graph[i, c] = segment[c](inputs[i, c])` again, on the RNG state its forward used.

    Its presence declares that the forward of microbatch i on chunk c keeps only its input (it
    saves nothing for a backward); `R` rebuilds the graph, and the microbatch's activations are
    held from `R` to its last backward piece (see [Note: recomputation] in docs/design.md).
    """

    code: ClassVar[str] = "R"


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

    code: ClassVar[str] = "+B"


@attrs.frozen(slots=True)
class SendActivation(Comm):
    """Roughly: `send(outputs[i, c], to=stage of segment k + 1)`."""

    code: ClassVar[str] = "SA"
    is_send: ClassVar[bool] = True


@attrs.frozen(slots=True)
class RecvActivation(Comm):
    """Roughly: `inputs[i, c] = recv(from=stage of segment k - 1)`."""

    code: ClassVar[str] = "RA"


@attrs.frozen(slots=True)
class SendGrad(Comm):
    """Roughly: `send(d loss / d inputs[i, c], to=stage of segment k - 1)`."""

    code: ClassVar[str] = "SG"
    is_send: ClassVar[bool] = True
    carries_grad: ClassVar[bool] = True


@attrs.frozen(slots=True)
class RecvGrad(Comm):
    """Roughly: `output_grads[i, c] = recv(from=stage of segment k + 1)`."""

    code: ClassVar[str] = "RG"
    carries_grad: ClassVar[bool] = True


@attrs.frozen(slots=True)
class ReduceGrads(Update):
    """Roughly: `grads[c] = mean over data-parallel ranks` (reduce-scatter under ZeRO)."""

    code: ClassVar[str] = "Reduce"
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.code}.{self.chunk}" if self.chunk else self.code


@attrs.frozen(slots=True)
class OptimizerStep(Update):
    """Roughly: `weights = optimizer.step(weights, grads); grads = 0; version += 1`."""

    code: ClassVar[str] = "Step"

    def __str__(self) -> str:
        return self.code


@attrs.frozen(slots=True)
class GatherParams(Update):
    """Roughly: `weights[c] = all_gather(this rank's updated shard of weights[c])` (ZeRO-1)."""

    code: ClassVar[str] = "Gather"
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.code}.{self.chunk}" if self.chunk else self.code


@attrs.frozen(slots=True)
class ReduceTied(Update):
    """Roughly: `grad[w] = sum of grad[copy] over every copy of w` for each parameter `w` that
    the segments of `Program.tied[tie]` share (a collective among their stages)."""

    code: ClassVar[str] = "Tied"
    tie: int = 0

    def __str__(self) -> str:
        return f"{self.code}{self.tie}"


@attrs.frozen(slots=True)
class GradNorm(Update):
    """Roughly: `norm = sqrt(sum over every stage and shard of |grad|^2)`; clip the gradients by
    it, or mark the step skipped when it is not finite (a collective among all stages)."""

    code: ClassVar[str] = "Norm"

    def __str__(self) -> str:
        return self.code


@attrs.frozen(slots=True)
class Unshard(Update):
    """Roughly: `weights[c] = all_gather(every rank's shard of weights[c])` (ZeRO-3: the chunk's
    parameters are whole from here until its `Reshard`)."""

    code: ClassVar[str] = "Unshard"
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.code}.{self.chunk}" if self.chunk else self.code


@attrs.frozen(slots=True)
class Reshard(Update):
    """Roughly: `del weights[c]` but this rank's shard (ZeRO-3: no compute on chunk c until the
    next `Unshard`)."""

    code: ClassVar[str] = "Reshard"
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.code}.{self.chunk}" if self.chunk else self.code


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

    code: ClassVar[str] = "O"


@attrs.frozen(slots=True)
class Reload(Copy):
    """Roughly: `saved_tensors(graph[i, c]) = host[i, c].to(device, non_blocking=True)`, waited
    for by the first backward piece of microbatch i on chunk c. Printed `L3.1`.

    >>> str(Reload(3)), parse("L3.1")
    ('L3', Reload(microbatch=3, chunk=1))
    """

    code: ClassVar[str] = "L"


COMPUTE = (
    Forward,
    Backward,
    BackwardInput,
    BackwardWeight,
    Recompute,
    OverlappedBackward,
)
COMM = (SendActivation, RecvActivation, SendGrad, RecvGrad)
#: The instructions on a stage's copy lane (device <-> host).
COPY = (Offload, Reload)
UPDATE = (ReduceGrads, OptimizerStep, GatherParams, ReduceTied, GradNorm, Unshard, Reshard)
#: ZeRO-3's instructions that make a chunk's parameters whole and release them again.
SHARDING = (Unshard, Reshard)
#: The computes that add to a chunk's weight gradients (`.grad`).
WEIGHT_GRADIENT = (Backward, BackwardWeight, OverlappedBackward)
#: The computes that make a microbatch's input gradient (what `SendGrad` sends).
INPUT_GRADIENT = (Backward, BackwardInput, OverlappedBackward)
SENDS = (SendActivation, SendGrad)
RECEIVES = (RecvActivation, RecvGrad)

_BY_CODE: dict[str, type[Instruction]] = {
    cls.code: cls for cls in (*COMPUTE, *COMM, *COPY, *UPDATE)
}
_ON_MICROBATCH = re.compile(r"(F|B|I|W|R|\+B|SA|RA|SG|RG|O|L)(\d+)(?:\.(\d+))?")
_ON_CHUNK = re.compile(r"(Reduce|Gather|Unshard|Reshard)(?:\.(\d+))?")
_TIED = re.compile(r"Tied(\d+)")


def parse(text: str) -> Instruction:
    """The instruction whose `str` is `text`; raises `ValueError` for anything else.

    >>> parse("B7.2")
    Backward(microbatch=7, chunk=2)
    """
    text = text.strip()
    if match := _ON_MICROBATCH.fullmatch(text):
        code, microbatch, chunk = match.groups()
        return _BY_CODE[code](int(microbatch), int(chunk or 0))
    if match := _ON_CHUNK.fullmatch(text):
        code, chunk = match.groups()
        return _BY_CODE[code](int(chunk or 0))
    if match := _TIED.fullmatch(text):
        return ReduceTied(int(match.group(1)))
    if text == OptimizerStep.code:
        return OptimizerStep()
    if text == GradNorm.code:
        return GradNorm()
    raise ValueError(
        f"cannot parse instruction {text!r}: expected e.g. F3, B3.1, I0, W0, R3, +B1, SA2, RA2, "
        "SG2, RG2, O3, L3.1, Reduce, Reduce.1, Norm, Step, Gather.1, Tied0, Unshard.1, Reshard.1"
    )
