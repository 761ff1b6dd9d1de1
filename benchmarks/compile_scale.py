"""How compile + simulate scale with the program size, side by side with torch.

For each shape (p, m) and each of 1F1B and interleaved 1F1B (v = 2), time schedcc's
`compile(schedule)` (collect, insert comm, insert updates, assign versions, validate) and then
`simulate` of its result, against torch's equivalent: building every rank's order with
`torch.distributed.pipelining`'s own schedule class over mock stage objects,
`_validate_schedule`, the comm lowering (`_add_send_recv`; the interleaved class runs it, with its
reduce-grad and unshard passes, in its constructor) and its simulator
(`_simulate_comms_compute`, which is also its deadlock check). Prints seconds, instructions,
instructions per second and the ratios torch / schedcc (above 1: schedcc is faster), for
compiling alone (against torch's lowering alone) and with the simulation.

    .venv/bin/python benchmarks/compile_scale.py                 # every shape, up to p = 128
    .venv/bin/python benchmarks/compile_scale.py --max-stages 32 # a quick run
    .venv/bin/python benchmarks/compile_scale.py --profile 64 1024

torch's side is skipped (printed as "-") for a shape where it would run longer than
`--torch-limit` seconds, estimated from the previous shape (its lowering is quadratic).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections.abc import Callable

from _stamp import stamp

import schedcc

SHAPES = ((8, 64), (16, 256), (32, 512), (64, 1024), (128, 2048))


def best_of(run: Callable[[], object], repeat: int) -> tuple[float, object]:
    """The shortest CPU time (this process) of `repeat` runs, and the last result.

    CPU time, not wall time: on a shared machine other processes would inflate wall time.
    """
    best, result = float("inf"), None
    for _ in range(repeat):
        start = time.process_time()
        result = run()
        best = min(best, time.process_time() - start)
    return best, result


# -- schedcc ------------------------------------------------------------------------------------


def schedcc_compile(name: str, p: int, m: int, v: int) -> Callable[[], schedcc.Program]:
    cls = schedcc.get_schedule(name)
    return lambda: schedcc.compile(cls(p, m, num_chunks=v))


def schedcc_compile_simulate(name: str, p: int, m: int, v: int) -> Callable[[], object]:
    """compile, then simulate the program it returns (what `schedcc show` does)."""
    compile_ = schedcc_compile(name, p, m, v)
    return lambda: schedcc.simulate(compile_())


# -- torch.distributed.pipelining ---------------------------------------------------------------


class _MockStage:
    """The attributes torch's schedule constructors read from a pipeline stage, and nothing else."""

    def __init__(self, stage_index: int, num_stages: int, group_size: int):
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = stage_index % group_size
        self.stage_index_to_group_rank: dict[int, int] = {}
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1


def torch_compile(p: int, m: int, v: int) -> Callable[[], dict]:
    """torch's lowering of 1F1B (v = 1; the same compute order as schedcc's) or of its own
    interleaved 1F1B class end to end, as its runtime does it: per-rank order,
    `_validate_schedule`, `_add_unshard_reshard`, `_add_reduce_grad`, `_add_send_recv`."""
    from torch.distributed.pipelining import schedules as ts

    if v == 1:

        def run() -> dict:
            order = {rank: _one_f_one_b_actions(ts, p, m, rank) for rank in range(p)}
            ts._validate_schedule(order, p, p, m)
            lowered = {
                rank: ts._add_reduce_grad(ts._add_unshard_reshard(ops), m)
                for rank, ops in order.items()
            }
            return ts._add_send_recv(lowered, lambda s: s, p)

        return run

    def run_interleaved() -> dict:
        stages = [_MockStage(c * p + 0, p * v, p) for c in range(v)]
        schedule = ts.ScheduleInterleaved1F1B(stages, m)
        return schedule.pipeline_order_with_comms

    return run_interleaved


def torch_simulate(lowered: dict, p: int, v: int) -> Callable[[], object]:
    """torch's deadlock check of a lowered order (`_simulate_comms_compute`), the counterpart of
    schedcc's validator; it knows only compute and P2P actions, so the rest is filtered out."""
    from torch.distributed.pipelining import schedules as ts

    kinds = {ts.F, ts.B, ts.I, ts.W, ts.SEND_F, ts.RECV_F, ts.SEND_B, ts.RECV_B}
    order = {
        rank: [a for a in ops if a is not None and a.computation_type in kinds]
        for rank, ops in lowered.items()
    }
    return lambda: ts._simulate_comms_compute(
        {rank: list(ops) for rank, ops in order.items()}, lambda s: s % p, p * v
    )


def _one_f_one_b_actions(ts, p: int, m: int, rank: int) -> list:
    """schedcc's 1F1B compute order of one stage, as torch `_Action`s (stage index = rank)."""
    forward, backward = ts._ComputationType.FORWARD, ts._ComputationType.FULL_BACKWARD
    warmup = min(p - rank - 1, m)
    actions = [ts._Action(rank, forward, i) for i in range(warmup)]
    for j in range(m - warmup):
        actions.append(ts._Action(rank, forward, warmup + j))
        actions.append(ts._Action(rank, backward, j))
    actions.extend(ts._Action(rank, backward, j) for j in range(m - warmup, m))
    return actions


# -- the table ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-stages", type=int, default=128, help="largest p to run")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (best)")
    parser.add_argument("--torch-limit", type=float, default=120.0, help="skip torch past this")
    parser.add_argument("--no-torch", action="store_true", help="time schedcc only")
    parser.add_argument("--profile", nargs=2, type=int, metavar=("P", "M"), help="cProfile it")
    args = parser.parse_args(argv)
    if args.profile:
        profile(*args.profile)
        return
    header = (
        f"{'schedule':<18}{'p':>5}{'m':>6}{'instr':>9}{'compile s':>11}{'instr/s':>10}"
        f"{'torch s':>10}{'ratio':>7}{'+sim s':>9}{'torch s':>9}{'ratio':>7}"
    )
    print(stamp("compile_scale"))
    print(header)
    print("-" * len(header))
    for name, v in (("1f1b", 1), ("interleaved-1f1b", 2)):
        torch_last: tuple[int, float] | None = None
        for p, m in SHAPES:
            if p > args.max_stages:
                continue
            seconds, program = best_of(schedcc_compile(name, p, m, v), args.repeat)
            total, _ = best_of(schedcc_compile_simulate(name, p, m, v), args.repeat)
            size = program.num_instructions
            row = f"{name:<18}{p:>5}{m:>6}{size:>9}{seconds:>11.3f}{size / seconds:>10.0f}"
            guess = None
            if torch_last is not None:  # torch's lowering is quadratic in the ops per rank
                last_size, last_seconds = torch_last
                guess = last_seconds * (size / last_size) ** 2 / 2
            if args.no_torch or (guess is not None and guess > args.torch_limit):
                row += f"{'-':>10}{'-':>7}{total:>9.3f}{'-':>9}{'-':>7}"
            else:
                repeat = 1 if p >= 64 else args.repeat
                lower_seconds, lowered = best_of(torch_compile(p, m, v), repeat)
                sim_seconds, _ = best_of(torch_simulate(lowered, p, v), repeat)
                torch_last = (size, lower_seconds + sim_seconds)
                both = lower_seconds + sim_seconds
                row += (
                    f"{lower_seconds:>10.3f}{lower_seconds / seconds:>7.2f}"
                    f"{total:>9.3f}{both:>9.3f}{both / total:>7.2f}"
                )
            print(row, flush=True)


def profile(p: int, m: int) -> None:
    """cProfile schedcc's compile + simulate of 1F1B and interleaved 1F1B at (p, m); the top 25
    by time."""
    for name, v in (("1f1b", 1), ("interleaved-1f1b", 2)):
        run = schedcc_compile_simulate(name, p, m, v)
        profiler = cProfile.Profile()
        profiler.enable()
        run()
        profiler.disable()
        print(f"== {name} p={p} m={m}")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
