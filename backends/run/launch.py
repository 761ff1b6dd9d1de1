"""Starting the ranks of a distributed run: local processes, or the ones `torchrun` started.

`spawn(fn, world_size, args)` starts `world_size` local processes, each calling
`fn(rank, world_size, *args)` with `MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE` and
`LOCAL_RANK` set (a free port on 127.0.0.1), and watches them: when one fails, it gives the
others `grace` seconds to stop on their own (their own timeouts name the instruction they were
waiting on), then ends them, and prints the failure once. A rank that is stopped (SIGSTOP, a
debugger) cannot stop on its own: once another has failed, it is named and ended at once, so the
ranks waiting on it end too. It never waits forever.

`in_torchrun()` tells whether this process was started by `torchrun` (or any launcher that sets
the same variables); then the ranks already exist and nothing is spawned.

[Note: exit codes] A rank exits 0 on success, 1 when training failed (the user's code raised,
a peer was lost, a wait timed out) or a check did not hold, 2 for a user's mistake (a bad
request, a model or loss that breaks the contract). `spawn` returns 0 when every rank did, else
the code of the first cause ([Note: one line per failure] in `backends.run.failures`), else of
the first rank that failed (1 for a rank killed by a signal).

[Note: a rank that stops responding] The ranks waiting on a stopped rank time out after the
engine's timeout (every wait has it, see [Note: failures] in `backends.distributed.engine`) and
exit naming what they waited on; the watcher then ends the stopped rank at once (a SIGTERM would
stay pending until it is continued) rather than after the grace, and every rank is gone within
the timeout plus a second or two (docs/performance.md, "Failures").
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.connection
import os
import platform
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable

from schedcc.backends.run.failures import RankReport, print_failures, say
from schedcc.errors import UserError

__all__ = [
    "OVERSUBSCRIBE",
    "check_cores",
    "cores_for",
    "free_port",
    "in_torchrun",
    "keep_freed_memory",
    "run_rank",
    "spawn",
]


def in_torchrun() -> bool:
    """True when `RANK`, `WORLD_SIZE` and `LOCAL_RANK` are set (torchrun, or a similar launcher)."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_rank(
    fn: Callable[..., object],
    rank: int,
    *args: object,
    debug: bool = False,
    report: str | None = None,
) -> int:
    """Call `fn(rank, *args)` and turn its outcome into an exit code (see the notes above).

    A failure is one line (`RankReport.of`); where it keeps a traceback (the user's code failed,
    or schedcc's own), `debug` prints it above the line, else a log file the line names holds it.
    Given `report` (a path, under `spawn`), the rank writes its `RankReport` there for the
    launcher to print instead and ends the process at once (see [Note: one line per failure]).
    """
    try:
        code = fn(rank, *args)
    except KeyboardInterrupt:
        return 130
    except BaseException as exc:
        outcome = RankReport.of(exc)
        if report is not None:
            outcome.write(report)
            _exit(outcome.code)  # before the failed run's frames are freed
        say(outcome.line(f"rank {rank}", debug=debug))
        return outcome.code
    return int(code or 0)


#: Local ranks a core may take before `schedcc run` refuses to start them ([Note: one core a
#: rank]).
RANKS_PER_CORE = 2
#: Set to 1, the environment's `--oversubscribe`.
OVERSUBSCRIBE = "SCHEDCC_OVERSUBSCRIBE"


def check_cores(world_size: int, *, oversubscribe: bool = False) -> None:
    """Raise `UserError` when `world_size` local ranks would crowd the cores: more than
    `RANKS_PER_CORE` ranks a core this process may use, unless `oversubscribe` (or
    `SCHEDCC_OVERSUBSCRIBE=1`).

    [Note: one core a rank] A rank polls its peers' messages and computes on its own; each
    rank past the cores waits on the scheduler as well as on its peers. Two ranks a core still
    train at a useful pace (the README's `--dp 2` examples on a 2-core laptop, the test suite's
    4-rank runs), but many more make a run that takes seconds on enough cores take minutes
    (`-p 64` on 2 cores ran past a minute). That is refused up front, saying the fix, rather
    than run that slowly.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    most = RANKS_PER_CORE * cores
    if world_size <= most or oversubscribe or os.environ.get(OVERSUBSCRIBE) == "1":
        return
    raise UserError(
        f"{world_size} ranks (p * dp * tp) would share the {cores} core(s) this process may use: "
        f"lower -p, --dp or --tp to at most {most} ranks, or pass --oversubscribe (or set "
        f"{OVERSUBSCRIBE}=1) to run them anyway, slowly"
    )


def cores_for(rank: int, world_size: int) -> set[int] | None:
    """The cores local rank `rank` of `world_size` is bound to (None: leave it unbound).

    An equal, disjoint slice of the cores this process may use, in order; None when there are
    fewer cores than ranks, or where the platform cannot bind threads.

    [Note: binding ranks to cores] A bound rank computes on its own cores, and the threads it
    starts later (gloo's I/O thread, the intra-op pool) stay there too. Unbound, the kernel may
    wake a rank that waited on a peer on a core another rank has just used, with cold caches.
    `benchmarks/step_time.py` against its `--no-bind` (README): interleaved 1F1B, where ranks
    wait on each other most often, ran about a quarter faster bound on 2 cores; 1F1B showed no
    clear difference.
    """
    if not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // world_size
    if share == 0:
        return None
    return set(cores[rank * share : (rank + 1) * share])


#: glibc's `mallopt` parameters (malloc.h) and what `keep_freed_memory` sets them to.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_KEEP = {_M_MMAP_THRESHOLD: 32 << 20, _M_TRIM_THRESHOLD: 2**31 - 1}


def keep_freed_memory() -> bool:
    """Make this process's allocator keep the memory it frees for reuse (glibc); True if done.

    [Note: keeping freed memory] A training step frees and allocates the same sizes every
    time, but glibc returns heap memory to the kernel once the free space on top passes a
    threshold it keeps moving, and serves blocks above another from fresh mappings; every page of
    memory handed back is faulted in again on its next use. A pipeline holds more activations at
    once than plain training, so its heap rises and falls more, and it faults in more pages a
    step (docs/performance.md). With both thresholds fixed (blocks up to 32 MiB from the heap,
    which is never trimmed) nothing is faulted in again; the process keeps its peak heap, as
    PyTorch's CUDA caching allocator keeps its peak on the GPU.

    Nothing is changed where the allocator is not glibc's, or where the user set either threshold
    through the environment (`MALLOC_TRIM_THRESHOLD_`, `MALLOC_MMAP_THRESHOLD_`).
    """
    if platform.libc_ver()[0] != "glibc":
        return False
    if any(name in os.environ for name in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")):
        return False
    mallopt = ctypes.CDLL(None).mallopt
    return all(mallopt(param, value) == 1 for param, value in _KEEP.items())


def _child(
    fn,
    rank: int,
    world_size: int,
    port: int,
    args: tuple,
    threads: int | None,
    bind: bool,
    report: str,
) -> None:
    if bind and (cores := cores_for(rank, world_size)) is not None:
        os.sched_setaffinity(0, cores)  # see [Note: binding ranks to cores]
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    _exit(run_rank(fn, rank, world_size, *args, report=report))


def _exit(code: int) -> None:
    """End this rank now: no interpreter teardown, no destructor of a failed run (a process
    group, a pending send) that could wait on a dead or stopped peer."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def spawn(
    fn: Callable[..., object],
    world_size: int,
    args: tuple = (),
    *,
    grace: float = 30.0,
    threads: int | None = None,
    method: str | None = None,
    describe: Callable[[int], str] | None = None,
    bind_cores: bool = False,
    debug: bool = False,
) -> int:
    """Run `fn(rank, world_size, *args)` in `world_size` local processes; returns the exit code.

    Args:
        fn: a module-level function (it must be importable by the children).
        world_size: number of processes.
        args: extra positional arguments for `fn` (picklable).
        grace: seconds the others get to stop by themselves after one fails.
        threads: `OMP_NUM_THREADS` for each child (None: leave as is).
        method: multiprocessing start method; default "fork" on Linux without CUDA, else "spawn".
        describe: `describe(rank)` names a rank in messages (e.g. "rank 1 (stage 1, dp 0)").
        bind_cores: bind each rank to its own slice of the cores (see `cores_for`); nothing is
            bound when there are fewer cores than ranks.
        debug: print a failed rank's traceback above its line (else a log file holds it).

    Example:
        >>> spawn(my_worker, 2, ("cfg",))  # doctest: +SKIP
        0
    """
    describe = describe or (lambda rank: f"rank {rank}")
    context = multiprocessing.get_context(method or _default_method())
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="schedcc-ranks-") as reports:
        paths = [os.path.join(reports, f"rank-{rank}.json") for rank in range(world_size)]
        processes = [
            context.Process(
                target=_child,
                args=(fn, rank, world_size, port, args, threads, bind_cores, paths[rank]),
            )
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        try:
            code = _watch(processes, grace, describe)
        finally:
            _end(processes)
        return print_failures(code, [RankReport.read(path) for path in paths], describe, debug)


def _default_method() -> str:
    if sys.platform != "linux":
        return "spawn"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return "spawn"
    return "fork"


def _watch(processes, grace: float, describe: Callable[[int], str]) -> int:
    failed: tuple[int, int] | None = None
    reported: set[int] = set()  # ranks that ended and were reported, or were ended here
    deadline = None
    while True:
        running = []  # the sentinels of the ranks still running
        for rank, process in enumerate(processes):
            code = process.exitcode
            if code is None:
                running.append(process.sentinel)
                continue
            if code == 0 or rank in reported:
                continue
            reported.add(rank)
            if failed is None or code < 0 <= failed[1]:
                failed = (rank, code)  # a rank killed by a signal is the likeliest cause
                deadline = time.monotonic() + grace
            if code not in (1, 2):  # 1 and 2: the rank reported its own one-line reason
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                say(f"schedcc: {describe(rank)} {how}; stopping the other ranks")
        if failed is not None:
            _end_stopped(processes, reported, describe)
        if not running:
            break
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            say(
                f"schedcc: the other ranks did not stop within {grace:g}s after "
                f"{describe(failed[0])} failed; ending them"  # type: ignore[index]
            )
            break
        # sleep until a rank ends (or the grace runs out): no periodic wake-up on the ranks' cores
        # while they train; after a failure, a look each second for a rank stopped since.
        # The sentinels are those seen running above: one that has ended since is ready at once.
        multiprocessing.connection.wait(running, left if left is None else min(left, 1.0))
    if failed is None:
        return 0
    return failed[1] if failed[1] > 0 else 1


def _end_stopped(processes, reported: set[int], describe: Callable[[int], str]) -> None:
    """End at once every rank that is stopped: it cannot end by itself (see [Note: a rank that
    stops responding])."""
    for rank, process in enumerate(processes):
        if rank in reported or process.exitcode is not None or not _is_stopped(process.pid):
            continue
        say(
            f"schedcc: {describe(rank)} is stopped (SIGSTOP or a debugger) and cannot end by "
            "itself; ending it"
        )
        process.kill()  # SIGKILL ends a stopped process; a SIGTERM would wait for SIGCONT
        reported.add(rank)


def _is_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped by a signal or a tracer (Linux's /proc; else False)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            stat = file.read()
    except OSError:
        return False
    fields = stat.rpartition(b")")[2].split()  # after the command name, which may hold spaces
    return bool(fields) and fields[0] in (b"T", b"t")


def _end(processes) -> None:
    for process in processes:
        if process.exitcode is None:
            os.kill(process.pid, signal.SIGTERM)
            os.kill(process.pid, signal.SIGCONT)  # a stopped rank takes the SIGTERM only then
    limit = time.monotonic() + 3.0
    for process in processes:
        process.join(max(0.0, limit - time.monotonic()))
        if process.exitcode is None:
            process.kill()
            process.join(1.0)
