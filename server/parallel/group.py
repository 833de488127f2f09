"""The collectives between the tensor-parallel ranks of one server.

The backend is chosen here and nowhere else: gloo for CPU ranks (what the tests run), NCCL for
CUDA ranks, one GPU per rank. Every collective is bounded by the group's timeout: with gloo a rank
that stops answering turns into an error on the others (at once when its connections close);
with NCCL, whose collectives do not block the CPU, the watchdog ends a process whose collective
outlives the timeout (and the pod restarts). The all-reduce time counted here is meaningful for
gloo only.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tandem.server.cgroup import usable_cpus


def backend_for(device: torch.device) -> str:
    """The torch.distributed backend for ranks on `device`."""
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Where rank `rank` computes: the `rank`-th GPU from rank 0's on CUDA (one GPU per rank), the
    CPU otherwise."""
    return torch.device("cuda", (device.index or 0) + rank) if device.type == "cuda" else device


def threads_per_rank(num_threads: int | None, size: int, default: int) -> tuple[int, str]:
    """torch threads each rank runs, and why: `num_threads` when given; else the CPUs this process may
    use (its affinity and its cgroup's CPU quota: a container's CPU limit) shared evenly between the
    ranks, and for one rank no more than `default`, torch's own choice (the physical cores)."""
    if num_threads:
        return num_threads, "--num-threads"
    cpus, why = usable_cpus()
    if size > 1:
        return max(1, cpus // size), f"{why}, shared by {size} ranks"
    return min(cpus, default), why if cpus <= default else f"torch's default; {why}"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ProcessGroup:
    """This process's membership in one server's rank group; construction blocks until every
    rank has joined (or the timeout passes). A group of its own, not torch.distributed's default
    one: a process may hold several servers' rank 0 (a prefill and a decode engine in one test)."""

    def __init__(self, rank: int, size: int, device: torch.device, port: int, timeout: float):
        self.rank, self.size, self.timeout = rank, size, timeout
        self.calls, self.seconds = 0, 0.0  # all-reduces so far, and the time spent in them (benchmarks)
        self.backend = backend_for(device)
        limit = timedelta(seconds=timeout)
        self._store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0, timeout=limit)
        if self.backend == "gloo":
            self._group = dist.ProcessGroupGloo(self._store, rank, size, limit)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = limit
            self._group = dist.ProcessGroupNCCL(self._store, rank, size, options)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place; every rank gets the same bits."""
        start = time.perf_counter()
        self._group.allreduce([t]).wait()
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return t

    def close(self) -> None:
        self._group = None  # its connections close with it
        self._store = None
