"""How the simulator scales, side by side with torch.distributed.pipelining's simulator.

For each shape (p, m, v) the script compiles the schedule (1F1B for v = 1, interleaved 1F1B
otherwise), times `schedcc.simulate` (and the makespan and bubble it gives), then hands the very
same lowered program, converted to torch's `_Action`s, to torch's private
`_simulate_comms_compute` in a subprocess with a time limit. Both are linear-time claims; the
table prints seconds (best of 3 below 250k instructions), instructions per second and torch's
time over ours. "+events s" is the extra time to build the per-instruction `Event` tuples, which
a `Timeline` does only when asked (makespan, bubble and memory do not need them).

    .venv/bin/python benchmarks/simulate_scale.py            # the default shapes, 60 s limit
    .venv/bin/python benchmarks/simulate_scale.py --quick    # the two smallest shapes
"""

from __future__ import annotations

import argparse
import math
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _stamp import stamp

import schedcc
from schedcc.semantics import Layout

SHAPES = [(16, 256, 1), (32, 512, 2), (64, 1024, 2), (128, 2048, 2)]

#: Our instruction code -> torch's computation type name (updates have no torch counterpart).
_TORCH_TYPE = {
    "F": "FORWARD",
    "B": "FULL_BACKWARD",
    "I": "BACKWARD_INPUT",
    "W": "BACKWARD_WEIGHT",
    "SA": "SEND_F",
    "RA": "RECV_F",
    "SG": "SEND_B",
    "RG": "RECV_B",
}

# Runs in a fresh interpreter: load the actions, time torch's simulator under an alarm.
_CHILD = r"""
import pickle, signal, sys, time
from torch.distributed.pipelining import schedules as S
with open(sys.argv[1], "rb") as f:
    order, stage_of, num_segments = pickle.load(f)
limit, repeat = int(sys.argv[2]), int(sys.argv[3])
actions = {
    rank: [S._Action(k, getattr(S._ComputationType, kind), i) for k, kind, i in row]
    for rank, row in order.items()
}
def expire(*_):
    raise TimeoutError
signal.signal(signal.SIGALRM, expire)
best = None
try:
    for _ in range(repeat):
        signal.alarm(limit)
        start = time.perf_counter()
        S._simulate_comms_compute(actions, lambda k: stage_of[k], num_segments)
        took = time.perf_counter() - start
        signal.alarm(0)
        best = took if best is None else min(best, took)
except TimeoutError:  # also when it lands in the teardown of torch's big structures
    print("timeout")
    sys.exit(0)
print(best)
"""


def schedule_for(p: int, m: int, v: int):
    name = "1f1b" if v == 1 else "interleaved-1f1b"
    return schedcc.get_schedule(name)(p, m, v)


def torch_actions(program) -> tuple[dict, list[int], int]:
    """The program's compute and comm as torch `_Action` fields, per rank (updates dropped)."""
    layout = Layout.of(program.schedule)
    order = {}
    for s, ops in enumerate(program.stages):
        segment = layout.segment[s]
        order[s] = [
            (segment[op.chunk], _TORCH_TYPE[op.code], op.microbatch)
            for op in ops
            if op.code in _TORCH_TYPE
        ]
    return order, list(layout.stage_of), len(layout.stage_of)


def time_torch(program, limit: int, repeat: int) -> float | None:
    """Best seconds of torch's `_simulate_comms_compute` on `program`, or None past `limit`."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "actions.pkl"
        path.write_bytes(pickle.dumps(torch_actions(program)))
        result = subprocess.run(
            [sys.executable, "-c", _CHILD, str(path), str(limit), str(repeat)],
            capture_output=True,
            text=True,
            timeout=limit + 600,
            check=False,
        )
    out = result.stdout.strip().splitlines()
    if result.returncode != 0 or not out:
        raise RuntimeError(f"torch's simulator failed: {result.stderr.strip()[-2000:]}")
    return None if out[-1] == "timeout" else float(out[-1])


def time_ours(program, repeat: int) -> tuple[float, float, schedcc.Timeline]:
    """Best seconds for `simulate` with its makespan and bubble, and for building the events."""
    best = math.inf
    for _ in range(repeat):
        start = time.perf_counter()
        timeline = schedcc.simulate(program)
        _ = timeline.makespan, timeline.bubble_fraction
        best = min(best, time.perf_counter() - start)
    start = time.perf_counter()
    _ = timeline.events
    return best, time.perf_counter() - start, timeline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the two smallest shapes")
    parser.add_argument("--largest", action="store_true", help="only the largest shape")
    parser.add_argument("--limit", type=int, default=60, help="torch's limit per shape, s")
    args = parser.parse_args()
    shapes = SHAPES[:2] if args.quick else SHAPES[-1:] if args.largest else SHAPES
    header = (
        f"{'p':>4} {'m':>5} {'v':>2} {'instructions':>12} {'compile s':>9} {'simulate s':>10} "
        f"{'+events s':>9} {'instr/s':>10} {'bubble':>7} {'torch s':>8} {'torch/ours':>10}"
    )
    print(stamp("simulate_scale"))
    print(header)
    print("-" * len(header))
    for p, m, v in shapes:
        start = time.perf_counter()
        program = schedcc.compile(schedule_for(p, m, v), validate=False)
        compiled = time.perf_counter() - start
        n = program.num_instructions
        repeat = 3 if n < 250_000 else 1  # best of 3 where a run is short and noisy
        ours, events, timeline = time_ours(program, repeat)
        theirs = time_torch(program, args.limit, repeat)
        torch_s = f"> {args.limit}" if theirs is None else f"{theirs:.2f}"
        ratio = f"> {args.limit / ours:.1f}x" if theirs is None else f"{theirs / ours:.1f}x"
        print(
            f"{p:>4} {m:>5} {v:>2} {n:>12,} {compiled:>9.2f} {ours:>10.2f} {events:>9.2f} "
            f"{n / ours:>10,.0f} {timeline.bubble_fraction:>7.1%} {torch_s:>8} {ratio:>10}",
            flush=True,
        )


if __name__ == "__main__":
    main()
