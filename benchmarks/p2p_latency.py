"""One message between two local ranks: gloo send/recv, gloo broadcast in a two-rank group, and
shared memory (a benchmark).

Two processes, each bound to its own core, one thread each, ping-pong a float32 tensor of the given
size N times, first through gloo (`dist.send`/`dist.recv` on 127.0.0.1), then as `dist.broadcast`
in a group of the two ranks (the engine's `p2p="broadcast"`, DeepSpeed's first transport: see
[Note: broadcast pairs] in backends/distributed/pairs.py), then through `ShmLinks`
(backends/distributed/shm.py). Prints, per one-way message, the wall time and the CPU time of both
processes together (gloo's I/O threads included), and their ratio.

    python benchmarks/p2p_latency.py [--kib 128] [--messages 2000]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported

import argparse
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from _stamp import stamp

from schedcc.backends.distributed.shm import ShmLinks, host_key
from schedcc.backends.run.launch import spawn


def _gloo(rank: int, tensor: torch.Tensor, buffer: torch.Tensor, n: int) -> None:
    peer = 1 - rank
    for _ in range(n):
        if rank == 0:
            dist.send(tensor, peer)
            dist.recv(buffer, peer)
        else:
            dist.recv(buffer, peer)
            dist.send(tensor, peer)


def _broadcast(rank: int, tensor: torch.Tensor, buffer: torch.Tensor, n: int, groups) -> None:
    """One group per direction, as the engine makes them (sender first, then receiver)."""
    there, back = groups
    for _ in range(n):
        if rank == 0:
            dist.broadcast(tensor, 0, group=there)
            dist.broadcast(buffer, 1, group=back)
        else:
            dist.broadcast(buffer, 0, group=there)
            dist.broadcast(tensor, 1, group=back)


def _shm(rank: int, tensor: torch.Tensor, links: ShmLinks, n: int, first: int) -> None:
    peer, shape, dtype = 1 - rank, tuple(tensor.shape), tensor.dtype
    for i in range(first, first + n):
        if rank == 0:
            links.send(peer, tensor)
            links.recv(peer, i, shape, dtype)
        else:
            links.recv(peer, i, shape, dtype)
            links.send(peer, tensor)


def _timed(run) -> tuple[float, float]:
    """(wall, CPU of both ranks) seconds of `run()`, barrier to barrier."""
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    spent = torch.tensor([time.process_time() - cpu], dtype=torch.float64)
    dist.barrier()
    wall = time.perf_counter() - wall
    dist.all_reduce(spent)
    return wall, spent.item()


def _worker(rank: int, world_size: int, opts) -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(60))
    tensor = torch.randn(opts.kib * 256)
    buffer = torch.empty_like(tensor)
    links = ShmLinks.connect(dist.group.WORLD, [1 - rank], timeout=60)
    if links.peers != {1 - rank}:
        raise SystemExit("the two ranks could not link through shared memory here")
    groups = (dist.new_group([0, 1]), dist.new_group([0, 1]))
    n, warm = opts.messages, 100
    _gloo(rank, tensor, buffer, warm)
    _broadcast(rank, tensor, buffer, warm, groups)
    _shm(rank, tensor, links, warm, 0)
    gloo = _timed(lambda: _gloo(rank, tensor, buffer, n))
    broadcast = _timed(lambda: _broadcast(rank, tensor, buffer, n, groups))
    shm = _timed(lambda: _shm(rank, tensor, links, n, warm))
    if rank == 0:
        per = 2 * n  # one-way messages
        print(stamp("p2p_latency"))
        print(f"{opts.kib} KiB, {n} round trips, ranks bound, per one-way message:")
        print("| transport | wall us | CPU us (both ranks) |")
        print("|---|---|---|")
        rows = [("gloo send/recv", gloo), ("gloo broadcast pair", broadcast)]
        rows.append(("shared memory", shm))
        for name, (wall, cpu) in rows:
            print(f"| {name} | {wall / per * 1e6:.1f} | {cpu / per * 1e6:.1f} |")
        print(f"gloo / shared memory: wall {gloo[0] / shm[0]:.1f}x, CPU {gloo[1] / shm[1]:.1f}x")
        print(f"broadcast / send-recv: wall {broadcast[0] / gloo[0]:.2f}x")
    links.close()
    dist.barrier()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kib", type=int, default=128, help="message size in KiB")
    parser.add_argument("--messages", type=int, default=2000, help="round trips")
    opts = parser.parse_args()
    if host_key() is None:
        raise SystemExit("shared-memory links need Linux (memfd, SOCK_SEQPACKET)")
    return spawn(_worker, 2, (opts,), grace=120, threads=1, bind_cores=True)


if __name__ == "__main__":
    raise SystemExit(main())
