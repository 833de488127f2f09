"""Helpers for tests that run real servers as local processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from tandem.tools.stack import (
    free_port, http_post, metric_value, metrics_text, spawn_router, spawn_server, wait_healthy, wait_router_ready,
)

__all__ = ["PDStack", "RouterProcess", "ServerProcess", "assert_all_freed", "free_port", "http_post", "metric_value",
           "process_gone", "wait_for"]


class ServerProcess:
    """`tandem serve` in a subprocess (float32 unless `--dtype` is given); waits until gRPC health
    says SERVING."""

    def __init__(self, *extra: str, log_path: Path, wait: bool = True):
        # float32 unless a test asks otherwise: the tests compare with HF transformers in float32,
        # and `--dtype auto` rounds prefill products to bfloat16 on CPUs with AVX512-BF16.
        dtype = () if "--dtype" in extra else ("--dtype", "float32")
        self.log_path, self.args = log_path, [*dtype, *extra]
        self.proc, self.port, self.metrics_port = spawn_server(self.args, log_path)
        self.target = f"127.0.0.1:{self.port}"
        if wait:
            self.wait_healthy()

    def restart(self, sig=signal.SIGTERM, wait: bool = True) -> int:
        """Stop the process with `sig`, then start a new one with the same flags at the same ports
        (what a StatefulSet rollout does to a pod). Returns the old process's exit code."""
        code = self.stop(sig)
        self.proc, _, _ = spawn_server(self.args, self.log_path, self.port, self.metrics_port)
        if wait:
            self.wait_healthy()
        return code

    def wait_healthy(self, timeout: float = 240) -> None:
        wait_healthy(self.target, self.proc, self.log_path, timeout)

    def metrics_text(self) -> str:
        return metrics_text(self.metrics_port)

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


class RouterProcess:
    """`smg launch` (the real router) in a subprocess; ready once it generates through a worker.
    `args` name the workers: `--worker-urls ...`, or `--pd-disaggregation --prefill ... --decode ...`."""

    def __init__(self, *args: str, tokenizer_dir: str, log_path: Path, model: str = "smollm2"):
        self.log_path = log_path
        self.proc, self.port, self.metrics_port = spawn_router(list(args), tokenizer_dir, log_path)
        self.base = f"http://127.0.0.1:{self.port}"
        wait_router_ready(self.base, self.proc, log_path, model)

    def post(self, path: str, body: dict, timeout: float = 120) -> tuple[int, str]:
        return http_post(self.base, path, body, timeout)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


class PDStack:
    """Two prefill and two decode servers (loading in parallel) and two routers over them:
    `one_by_one` (the first prefill and the first decode) and `two_by_two` (all four); with
    `pairs=1`, one of each and `one_by_one` only. `router_args`: the router's PD flags (policies,
    retries), before the worker list; `prefill_args`, `decode_args`: flags for one role only."""

    def __init__(self, logs: Path, engine_args: tuple[str, ...], router_args: tuple[str, ...],
                 prefill_args: tuple[str, ...] = (), decode_args: tuple[str, ...] = (), pairs: int = 2):
        import grpc
        from smg_grpc_proto import sglang_scheduler_pb2 as pb
        from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc

        self.bootstrap_ports = [free_port() for _ in range(pairs)]
        self.prefills = [
            ServerProcess("--role", "prefill", "--bootstrap-port", str(port), *engine_args, *prefill_args,
                          log_path=logs / f"prefill{i}.log", wait=False)
            for i, port in enumerate(self.bootstrap_ports)
        ]
        self.decodes = [ServerProcess("--role", "decode", *engine_args, *decode_args, log_path=logs / f"decode{i}.log",
                                      wait=False) for i in range(pairs)]
        self.routers: list[RouterProcess] = []
        try:
            for server in self.servers:
                server.wait_healthy()
            with grpc.insecure_channel(self.prefills[0].target) as channel:
                tokenizer_dir = pb_grpc.SglangSchedulerStub(channel).GetModelInfo(pb.GetModelInfoRequest()).tokenizer_path
            self.one_by_one = self._router(router_args, self.prefills[:1], self.decodes[:1], tokenizer_dir, logs / "router-1x1.log")
            if pairs > 1:
                self.two_by_two = self._router(router_args, self.prefills, self.decodes, tokenizer_dir,
                                               logs / "router-2x2.log")
        except BaseException:  # nothing half-started outlives a failed setup
            self.stop()
            raise

    def _router(self, router_args, prefills, decodes, tokenizer_dir, log_path) -> RouterProcess:
        args = list(router_args)
        for p in prefills:
            args += ["--prefill", f"grpc://{p.target}", str(self.bootstrap_port(p))]
        for d in decodes:
            args += ["--decode", f"grpc://{d.target}"]
        router = RouterProcess(*args, tokenizer_dir=tokenizer_dir, log_path=log_path)
        self.routers.append(router)
        return router

    def bootstrap_port(self, prefill: ServerProcess) -> int:
        return self.bootstrap_ports[self.prefills.index(prefill)]

    def bootstrap(self, prefill: ServerProcess, path: str) -> dict:
        """GET `path` from a prefill's bootstrap service."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.bootstrap_port(prefill)}{path}", timeout=10) as r:
            return json.load(r)

    @property
    def servers(self) -> list[ServerProcess]:
        return self.prefills + self.decodes

    def stop(self) -> None:
        for router in self.routers:
            router.stop()
        for server in self.servers:
            server.stop()


def assert_all_freed(servers, timeout: float = 30) -> None:
    """No request, queue entry or KV page held on any server (cached prefixes may stay, unpinned)."""
    deadline = time.monotonic() + timeout
    while True:
        busy = {}
        for s in servers:
            text = s.metrics_text()
            held = {n: metric_value(text, n) for n in (
                "tandem_num_requests_running", "tandem_num_requests_waiting", "tandem_kv_pages_used",
                "tandem_bootstrap_queue_requests", "tandem_inflight_queue_requests",
                "tandem_prealloc_queue_requests", "tandem_transfer_queue_requests")}
            if any(held.values()):
                busy[s.target] = {n: v for n, v in held.items() if v}
        if not busy:
            return
        assert time.monotonic() < deadline, f"still held after {timeout}s: {busy}"
        time.sleep(0.2)


def process_gone(pid: int) -> bool:
    """No process `pid` any more (exited and reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def wait_for(condition, what: str, timeout: float = 60, interval: float = 0.05) -> None:
    """Poll `condition()` until it is true; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout}s"
        time.sleep(interval)
