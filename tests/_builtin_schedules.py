"""The built-in schedules, once each, with what the tests need to know of them: the one list of
built-ins every test reads. A new built-in is added here (tests/schedules/test_builtins.py checks
that this table and the entry-point registry name the same schedules).

`backward` says how a microbatch's backward is written: "B" (one `Backward`), "I/W" (split into
`BackwardInput` and `BackwardWeight`) or "mixed" (both, with overlapped pairs). `placement` is
"looped" (segment k on stage k mod p), "v" (two chunks in a V) or "dual" (two model replicas).
`bounds` are the largest shapes the shared properties draw: (stages, microbatches) to validate
over, and to train over (fewer: training is slower).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BUILTINS", "Builtin", "builtins", "names"]


@dataclass(frozen=True)
class Builtin:
    name: str
    backward: str = "B"
    placement: str = "looped"
    validate_bounds: tuple[int, int] = (6, 20)
    train_bounds: tuple[int, int] = (4, 8)

    @property
    def max_chunks(self) -> int:
        """The largest v the shared properties draw (the schedule decides which it accepts)."""
        return 3 if self.placement == "looped" else 2


BUILTINS: tuple[Builtin, ...] = (
    Builtin("gpipe"),
    Builtin("1f1b"),
    Builtin("1f1b-offload"),
    Builtin("seq1f1b"),
    Builtin("interleaved-1f1b"),
    Builtin("2bw"),
    Builtin("looped-bfs"),
    Builtin("zb-h1", backward="I/W"),
    Builtin("zb-h2", backward="I/W"),
    Builtin("interleaved-zb", backward="I/W"),
    Builtin("zb-v", backward="I/W", placement="v", validate_bounds=(6, 14)),
    Builtin("v-half", backward="I/W", placement="v", validate_bounds=(8, 20)),
    Builtin("v-min", backward="I/W", placement="v", validate_bounds=(8, 20)),
    Builtin("dualpipe-v", backward="mixed", placement="v", train_bounds=(3, 8)),
    Builtin("dualpipe", backward="mixed", placement="dual", validate_bounds=(8, 24),
            train_bounds=(4, 10)),
)  # fmt: skip


def builtins(**traits: str) -> tuple[Builtin, ...]:
    """The built-ins whose fields equal `traits`, e.g. `builtins(backward="B")`."""
    return tuple(b for b in BUILTINS if all(getattr(b, k) == v for k, v in traits.items()))


def names(**traits: str) -> tuple[str, ...]:
    """The names of `builtins(**traits)`."""
    return tuple(b.name for b in builtins(**traits))
