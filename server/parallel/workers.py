"""The tensor-parallel ranks other than 0, and rank 0's handle on them (`RankPool`).

Start-up: rank 0 starts ranks 1..N-1 (`python -m tandem.server.parallel.workers`, each with one
end of a socket pair as its pipe, so nothing of the caller's `__main__` runs again); every rank
joins the process group and loads its share of the model; rank 0 sizes the KV pool and
`build(num_pages)` has each rank allocate that many pages over its own KV heads and answer ready. Then a forward pass is one message down a pipe to each
rank (`send`); the all-reduces inside the pass keep the ranks in step. Closing the pipes stops them.

Disaggregated roles: each rank also runs a Mooncake transfer engine over its own KV buffer and
reports that buffer (`parts`); a prefill's rank 0 hands each rank the writes of its heads
(`write`), which the rank runs on a thread of its own and answers on the same pipe.

Failure: a rank that exits (a crash, an OOM kill) is seen at once by rank 0's watcher thread,
which calls `on_lost`. When rank 0 dies, the pipes close and the collectives break, and the other
ranks exit non-zero. A collective that waits longer than the group's timeout raises on every rank
still alive (with gloo at once, when a peer's connection closes; NCCL's watchdog ends a rank
whose collective outlives the timeout). A rank process never outlives rank 0: the kernel kills
it when the thread that started it (rank 0's engine thread) ends (PR_SET_PDEATHSIG), and its pipe
closes then too.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Callable

import torch

from tandem.server.config import DisaggConfig, EngineConfig
from tandem.server.disagg.layout import KVBuffer, Writes
from tandem.server.parallel.group import ProcessGroup, free_port, rank_device, threads_per_rank

log = logging.getLogger("tandem.tp")

# How long rank 0 waits for another rank to load its share and allocate its KV pages.
READY_TIMEOUT = 600.0


@dataclass(frozen=True)
class RankSpec:
    """What a rank process needs to build its share of the server: rank 0's own configs (the
    model, its precision, the KV pool's page size, the threads, the size of the group and its
    timeout; the role, whose prefill and decode ranks register their KV with a Mooncake engine of
    their own) and where to meet rank 0 and the peers."""

    engine: EngineConfig
    disagg: DisaggConfig
    port: int = 0  # rank 0's rendezvous port on 127.0.0.1; 0: RankPool picks a free one
    advertise_host: str = "127.0.0.1"  # the address peers reach each rank's Mooncake engine at


@dataclass
class Relayout:
    """Rank 0 -> every rank: these pages arrived head-major; make them token-major now."""

    pages: list[int]


@dataclass
class WriteJob:
    """Rank 0 -> a rank: write these heads of the KV pool to a decode; answered by job id."""

    job: int
    writes: list[Writes]


class RankPool:
    """Rank 0's handle on ranks 1..size-1. Construction spawns them and joins the process group
    with them (`group`, which rank 0's model reduces over)."""

    def __init__(self, spec: RankSpec, device: torch.device):
        spec = replace(spec, port=spec.port or free_port())
        size = spec.engine.tp_size
        self._conns: list[Connection] = []
        self._procs: list[subprocess.Popen] = []
        self._closing = False
        self.sends, self.send_seconds = 0, 0.0  # forward passes handed out, and the time it took (benchmarks)
        self.parts: list[KVBuffer] = []  # ranks 1..size-1's KV buffers, once built (disaggregated roles)
        self._send_lock = threading.Lock()  # the engine thread and KV senders share each pipe
        self._jobs: list[dict[int, Future]] = [{} for _ in range(size - 1)]  # per rank 1.., by job id
        self._job_ids = itertools.count()
        try:
            for rank in range(1, size):
                ours, theirs = socket.socketpair()
                with theirs:
                    proc = subprocess.Popen([sys.executable, "-m", __name__, str(rank), str(theirs.fileno()),
                                             str(os.getpid())], pass_fds=[theirs.fileno()])
                self._procs.append(proc)
                self._conns.append(Connection(ours.detach()))
                self._conns[-1].send(spec)
            self.group = ProcessGroup(0, size, device, spec.port, spec.engine.tp_timeout)
        except BaseException:
            self.close()
            raise

    @property
    def size(self) -> int:
        return len(self._procs) + 1

    def build(self, num_pages: int, on_lost: Callable[[str], None]) -> None:
        """Every rank allocates `num_pages` KV pages and answers ready; from then on a rank that
        exits is reported to `on_lost` (from a watcher thread) with a line naming it."""
        for conn in self._conns:
            conn.send(("pool", num_pages))
        deadline = time.monotonic() + READY_TIMEOUT
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs), start=1):
            while not conn.poll(0.1):
                if proc.poll() is not None:
                    raise RuntimeError(f"tensor-parallel rank {rank} exited with code {proc.returncode} while loading")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel rank {rank} was not ready within {READY_TIMEOUT:.0f}s")
            reply = conn.recv()
            if reply[0] != "ready":
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {reply[1]}")
            if reply[1] is not None:
                self.parts.append(reply[1])
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs), start=1):
            threading.Thread(target=self._watch, args=(rank, proc, on_lost), name=f"tandem-tp{rank}-watch",
                             daemon=True).start()
            threading.Thread(target=self._read, args=(rank, conn), name=f"tandem-tp{rank}-read", daemon=True).start()

    def send(self, inputs) -> None:
        """The next forward pass (ForwardInputs), to every other rank (raises when one is gone)."""
        start = time.perf_counter()
        self._broadcast(inputs)
        self.send_seconds += time.perf_counter() - start
        self.sends += 1

    def _broadcast(self, message) -> None:
        """`message`, pickled once, down every rank's pipe in the same order."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            for conn in self._conns:
                conn.send_bytes(data)

    def write(self, rank: int, writes: list[Writes]) -> Future:
        """Have rank `rank` (>= 1) make `writes` from its KV buffer; the future ends when it has."""
        future: Future = Future()
        job, jobs = next(self._job_ids), self._jobs[rank - 1]
        jobs[job] = future
        try:
            with self._send_lock:
                self._conns[rank - 1].send_bytes(pickle.dumps(WriteJob(job, writes), protocol=pickle.HIGHEST_PROTOCOL))
        except OSError as e:
            if jobs.pop(job, None) is not None:  # else the reader has failed it already
                future.set_exception(RuntimeError(f"tensor-parallel rank {rank} is gone: {e}"))
        return future

    def relayout(self, pages: list[int]) -> None:
        """Every other rank turns `pages` token-major before its next forward pass (the pipe keeps order)."""
        self._broadcast(Relayout(pages))

    def _read(self, rank: int, conn: Connection) -> None:
        """Rank `rank`'s answers to its write jobs ("written", job, error), until its pipe
        closes; its jobs left unanswered then fail."""
        jobs = self._jobs[rank - 1]
        try:
            while True:
                _, job, error = conn.recv()
                future = jobs.pop(job)
                if error is None:
                    future.set_result(None)
                else:
                    future.set_exception(RuntimeError(f"tensor-parallel rank {rank}: {error}"))
        except (EOFError, OSError):
            pass
        for job in list(jobs):
            future = jobs.pop(job, None)
            if future is not None:
                future.set_exception(RuntimeError(f"tensor-parallel rank {rank} is gone"))

    def explain(self, error: BaseException, wait: float = 2.0) -> str:
        """Why a forward pass failed with `error`: the rank that exited (waiting up to `wait`
        seconds for one to, since a broken collective usually means a rank is going), else the error."""
        deadline = time.monotonic() + wait
        while True:
            for rank, proc in enumerate(self._procs, start=1):
                if proc.poll() is not None:
                    return f"tensor-parallel rank {rank} exited with code {proc.returncode}"
            if time.monotonic() > deadline:
                return f"a tensor-parallel collective failed: {type(error).__name__}: {error}"
            time.sleep(0.05)

    def _watch(self, rank: int, proc: subprocess.Popen, on_lost: Callable[[str], None]) -> None:
        code = proc.wait()
        if not self._closing:
            on_lost(f"tensor-parallel rank {rank} exited with code {code}")

    def close(self) -> None:
        """Stop the other ranks (closing their pipes ends their loops) and leave the group."""
        self._closing = True
        for conn in self._conns:
            conn.close()
        deadline = time.monotonic() + 10.0
        for proc in self._procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if hasattr(self, "group"):
            self.group.close()


def run_rank(rank: int, conn: Connection, parent: int) -> None:
    """Main of rank `rank` >= 1: build its share, then run each forward pass rank 0 sends."""
    from tandem.kernels.attention_backends import create_backend
    from tandem.kernels.kv_cache import PagedKVCache
    from tandem.server.model.load import load_model, resolve_device
    from tandem.server.model.shard import Shard
    from tandem.server.disagg.transfer import token_major
    from tandem.server.loop.runner import forward_pass

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s tp{rank} %(name)s: %(message)s")
    _die_with_parent(parent)
    try:
        spec: RankSpec = conn.recv()
        config, disagg = spec.engine, spec.disagg
        torch.set_num_threads(threads_per_rank(config.num_threads, config.tp_size, torch.get_num_threads())[0])
        device = rank_device(resolve_device(config.device), rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # kernels and the transfer engine that use "the" device
        group = ProcessGroup(rank, config.tp_size, device, spec.port, config.tp_timeout)
        model = load_model(replace(config, device=str(device)), Shard(rank, config.tp_size), group.all_reduce)
        _, num_pages = conn.recv()
        c = model.module.config
        kv = PagedKVCache(c.num_layers, num_pages, config.page_size, c.kv_heads, c.kv_dim, model.precision.kv,
                          model.device, value_dim=c.kv_value_dim)
        attn = create_backend(config.attention_backend, kv, c.num_heads, c.head_dim, c.softmax_scale, c.layer_windows,
                              prompt_dtype=model.module.prefill_dtype)
        transfer, part = None, None
        if disagg.role != "colocated":
            from tandem.server.disagg.transfer import MooncakeTransfer

            transfer = MooncakeTransfer(spec.advertise_host, disagg.kv_transfer_protocol, disagg.ib_device)
            first = 0 if c.latent else rank * c.kv_heads  # a latent: every rank holds all of it
            part = KVBuffer(transfer.register(kv.buffer), num_pages, first, c.kv_heads,
                            transfer.session)
        conn.send(("ready", part))
    except BaseException as e:
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        raise
    writers = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"tandem-tp{rank}-kv-send")
    answer_lock = threading.Lock()

    def write(job: WriteJob) -> None:
        error = None
        try:
            transfer.send(kv.buffer, job.writes)
        except Exception as e:  # rank 0 fails the room
            error = f"{type(e).__name__}: {e}"
        with answer_lock:
            conn.send(("written", job.job, error))

    with torch.inference_mode():
        while True:
            try:
                message = pickle.loads(conn.recv_bytes())
            except EOFError:  # rank 0 closed the pipe: the server is stopping (or gone)
                break
            if isinstance(message, WriteJob):
                if model.device.type == "cuda":  # the forward pass that wrote those pages must be done
                    torch.cuda.current_stream(model.device).synchronize()
                writers.submit(write, message)
            elif isinstance(message, Relayout):
                token_major(kv.buffer, message.pages)
            else:
                forward_pass(model.module, attn, message, model.device)
    writers.shutdown(wait=True)
    group.close()


def _die_with_parent(parent: int) -> None:
    """Have the kernel kill this process when rank 0 (process `parent`) exits, whatever it is
    doing (Linux)."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        log.warning("cannot ask to die with the parent process: relying on the pipe closing")
    if os.getppid() != parent:  # rank 0 exited before the request took effect
        sys.exit(1)


if __name__ == "__main__":  # run from the module proper, whose classes rank 0's messages are pickled as
    from tandem.server.parallel import workers

    workers.run_rank(int(sys.argv[1]), Connection(int(sys.argv[2])), int(sys.argv[3]))
