"""Instructions run with the user's code: `engine.register_handler(kind, fn)`, and overlapped pairs.

[Note: custom handlers] A handler registered for a compute instruction kind (`Forward`,
`Backward`, `BackwardInput`, `BackwardWeight`, `Recompute`, `OverlappedBackward`) is called in
place of the runtime's own handler for every instruction of that exact kind (but a pair's
forward, which its pair's handler runs, and a `Backward` handler sees no `+B`), with an
`InstructionCall`: which stage and instruction, the stage's modules, and `run()`, the built-in
work, which the handler calls once (around it, anything: a profiler range, a stream, a hook
on the user's MoE all-to-all). So a handler may change how an instruction runs, never what it
computes; a handler that raises is a `RuntimeInstructionError` naming the instruction, and one
that returns without running the built-in work is one too.

[Note: running an overlapped pair] `F3 +B1.1` is the forward of one microbatch and the backward
of another that DualPipe runs at once on one stage (`schedcc.rules.overlap`: nothing sits
between the two, and the backward needs nothing the forward makes). The runtime holds the
forward back when it reaches it, and at the `OverlappedBackward` runs the pair as one
`OverlappedPair`: `run_forward()` then `run_backward()`, each once. That order is the host's
(what the halves record, a loss and its count, reads in program order); on the device their
work may overlap. The distributed engine sends what the forward makes only after the pair
(`backends.distributed.eager`), and the local one at the comm group after it. By default, on a
CUDA device the forward runs on a side stream while the backward runs on the current one, and
the current stream then waits for the side one (autograd runs each backward kernel on its
forward's stream, so it is the forward that must move; the side stream first waits for the
current one, so the forward reads finished inputs and reuses no memory still in use); on the
CPU the pair runs in order, forward then backward, which is exact. The one pair per batch whose
backward carries the batch's count of a `(loss_sum, count)` loss ([Note: the count divides at
the step] in `backends.runtime.losses`) runs in order on CUDA too: that backward reads the
count the forward may have just recorded (`OverlappedPair.in_order` says so to a handler). A
handler registered for `OverlappedBackward` replaces that default with the user's own overlap
(a MoE layer's all-to-all hidden behind the other half's compute, say), with the same two
halves to call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from schedcc.errors import RuntimeInstructionError, ScheduleConfigError, call_user, name_of
from schedcc.ir import COMPUTE, Forward, Instruction, OverlappedBackward

__all__ = ["HANDLED", "Handlers", "InstructionCall", "OverlappedPair", "check_handler"]

#: The instruction kinds a handler may be registered for (`register_handler`): the computes.
HANDLED = COMPUTE

Handler = Callable[["InstructionCall"], Any]


def check_handler(kind: Any, fn: Any) -> None:
    """Raise unless `fn` is a callable handler for instruction kind `kind` (one of `HANDLED`).

    Raises:
        ScheduleConfigError: `kind` is not one of `HANDLED` (an instance instead of its class,
            a comm or update instruction, anything else) or `fn` is not callable.
    """
    if not (isinstance(kind, type) and kind in HANDLED):
        names = ", ".join(cls.__name__ for cls in HANDLED)
        got = f"{kind.__name__}" if isinstance(kind, type) else f"{kind!r}"
        raise ScheduleConfigError(
            f"register_handler takes a compute instruction class, one of {names}; got {got} "
            "(comm and update instructions run only the engine's own code)"
        )
    if not callable(fn):
        raise ScheduleConfigError(
            f"register_handler({kind.__name__}, fn): fn must be a callable fn(call) -> None, "
            f"got {type(fn).__name__}"
        )


class InstructionCall:
    """What a handler gets: one instruction to run on one stage ([Note: custom handlers]).

    Attributes:
        stage: the stage running it.
        instruction: the instruction (for a pair, its `OverlappedBackward`).
        modules: the stage's segments, by chunk.
        device: where the stage computes.
    """

    __slots__ = ("_ran", "_work", "device", "instruction", "modules", "stage")

    def __init__(
        self,
        stage: int,
        instruction: Instruction,
        modules: Sequence[nn.Module],
        device: torch.device,
        work: Callable[[], None],
    ) -> None:
        self.stage = stage
        self.instruction = instruction
        self.modules = modules
        self.device = device
        self._work = work
        self._ran = False

    def run(self) -> None:
        """The built-in work of the instruction; call it once.

        Raises:
            RuntimeInstructionError: called a second time.
        """
        if self._ran:
            raise self._twice("run()")
        self._ran = True
        self._work()

    def _twice(self, what: str) -> RuntimeInstructionError:
        return RuntimeInstructionError(
            f"stage {self.stage}: the handler for {self} called {what} twice; call it once",
            stage=self.stage,
        )

    def _missing(self) -> list[str]:
        """What the handler left undone."""
        return [] if self._ran else ["run()"]

    def __str__(self) -> str:
        return str(self.instruction)


class OverlappedPair(InstructionCall):
    """What a handler for `OverlappedBackward` gets: a pair `F3 +B1.1` to run with its two
    halves ([Note: running an overlapped pair]).

    Attributes:
        forward: the pair's `Forward`; `instruction` (and `backward`) its `OverlappedBackward`.
        in_order: whether the backward's device work must follow the forward's (it reads the
            batch's count that the forward records), as the default runs it.
    """

    __slots__ = ("_halves", "forward", "in_order")

    def __init__(
        self,
        stage: int,
        forward: Forward,
        backward: OverlappedBackward,
        modules: Sequence[nn.Module],
        device: torch.device,
        halves: tuple[Callable[[], None], Callable[[], None]],
        *,
        in_order: bool = False,
    ) -> None:
        super().__init__(stage, backward, modules, device, self._both)
        self.forward = forward
        self.in_order = in_order
        self._halves = list(halves)

    @property
    def backward(self) -> OverlappedBackward:
        return self.instruction  # type: ignore[return-value]

    def run_forward(self) -> None:
        """Run the forward half (`F3`); once."""
        self._half(0, "run_forward()")

    def run_backward(self) -> None:
        """Run the backward half (`+B1.1`); once."""
        self._half(1, "run_backward()")

    def _half(self, index: int, what: str) -> None:
        work = self._halves[index]
        if work is None:
            raise self._twice(what)
        if index == 1 and self._halves[0] is not None:
            raise RuntimeInstructionError(
                f"stage {self.stage}: the handler for {self} called run_backward() before "
                "run_forward(): call run_forward() first (their device work may overlap)",
                stage=self.stage,
            )
        self._halves[index] = None
        work()

    def _both(self) -> None:
        """`run()`: the forward half, then the backward half."""
        self.run_forward()
        self.run_backward()

    def _missing(self) -> list[str]:
        names = ("run_forward()", "run_backward()")
        return [name for name, work in zip(names, self._halves) if work is not None]

    def __str__(self) -> str:
        return f"{self.forward} {self.instruction}"


class Handlers:
    """One stage's handlers: the user's by kind, and its overlapped pairs' forwards held back.

    Args:
        stage: the stage.
        ops: its program (which forwards start an overlapped pair).
        modules: its segments, by chunk.
        device: where it computes (CUDA: a pair's halves on two streams by default).
    """

    def __init__(
        self,
        stage: int,
        ops: Sequence[Instruction],
        modules: Sequence[nn.Module],
        device: torch.device,
    ) -> None:
        self.stage = stage
        self._modules = modules
        self._device = device
        self._by_kind: dict[type, Handler] = {}
        #: each forward that starts an overlapped pair, and its backward
        self._pairs = {
            ops[pos - 1]: op
            for pos, op in enumerate(ops)
            if type(op) is OverlappedBackward and pos and type(ops[pos - 1]) is Forward
        }
        self._held: Forward | None = None
        self._releasing: Forward | None = None
        self._side: torch.cuda.Stream | None = None
        #: whether the run is a training one (a forward-only program has no pairs)
        self.training = True

    def register(self, kind: type, fn: Handler) -> None:
        """Run every instruction of exactly `kind` through `fn` ([Note: custom handlers])."""
        check_handler(kind, fn)
        self._by_kind[kind] = fn

    def run(self, op: Instruction, work: Callable[[], None]) -> None:
        """Run `op`: `work()` itself, or through the handler registered for its kind."""
        fn = self._by_kind.get(type(op))
        paired = type(op) is OverlappedBackward or (self.training and op in self._pairs)
        if fn is None or paired:  # a pair's handler runs both halves, at `run_pair`
            work()
            return
        self._call(fn, InstructionCall(self.stage, op, self._modules, self._device, work))

    def holds_back(self, op: Forward) -> bool:
        """Whether the forward `op` starts an overlapped pair and is to run with its backward
        (it is then held until `run_pair`); False while the pair itself runs it."""
        if not self.training or op not in self._pairs or op is self._releasing:
            return False
        self._held = op
        return True

    def run_pair(
        self,
        backward: OverlappedBackward,
        forward_work: Callable[[Forward], None],
        backward_work: Callable[[], None],
        *,
        in_order: bool = False,
    ) -> None:
        """Run the pair that `backward` ends: the held forward and `backward`, through the
        handler registered for `OverlappedBackward` or the default ([Note: running an
        overlapped pair]); `in_order`: the default runs the halves one after the other on
        every device (the backward carries a count).

        Raises:
            RuntimeInstructionError: no forward was held for it (a program whose pair the
                validator would refuse), or the handler raised or left a half unrun.
        """
        forward, self._held = self._held, None
        if forward is None or self._pairs.get(forward) != backward:
            raise RuntimeInstructionError(
                f"stage {self.stage}: {backward} runs without the forward it overlaps right "
                "before it (a program the validator refuses)",
                stage=self.stage,
            )

        def run_forward() -> None:
            self._releasing = forward
            try:
                forward_work(forward)
            finally:
                self._releasing = None

        halves = (run_forward, backward_work)
        pair = OverlappedPair(
            self.stage, forward, backward, self._modules, self._device, halves, in_order=in_order
        )
        fn = self._by_kind.get(OverlappedBackward)
        if fn is not None:
            self._call(fn, pair)
        elif self._device.type == "cuda" and not in_order:
            self._on_two_streams(pair)
        else:
            pair.run()

    def _on_two_streams(self, pair: OverlappedPair) -> None:
        """The CUDA default: the forward on a side stream, the backward on the current one,
        joined ([Note: running an overlapped pair])."""
        current = torch.cuda.current_stream(self._device)
        if self._side is None:
            self._side = torch.cuda.Stream(self._device)
        side = self._side
        side.wait_stream(current)
        with torch.cuda.stream(side):
            pair.run_forward()
        pair.run_backward()
        current.wait_stream(side)

    def _call(self, fn: Handler, call: InstructionCall) -> None:
        """`fn(call)` through the user-code guard; then every part of it must have run."""

        def function() -> str:
            return f"stage {self.stage}: the handler {name_of(fn)} for {call}"

        call_user(function, lambda: fn(call), error=RuntimeInstructionError)
        missing = call._missing()
        if missing:
            raise RuntimeInstructionError(
                f"{function()} returned without calling {' and '.join(missing)}: a handler "
                "runs the instruction's work itself, once",
                stage=self.stage,
            )
