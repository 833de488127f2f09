"""Helpers for tests that run real servers as local processes on 127.0.0.1: the servers, routers
and stacks of tandem.tools.stack, in float32 unless a test asks otherwise."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path

from tandem.tools.stack import (
    LocalStack, Router, Server, free_port, http_post, metric_value, router_workers, served_tokenizer_dir,
)

__all__ = ["PDStack", "Router", "Server", "ServerProcess", "assert_all_freed", "free_port", "http_post", "metric_value",
           "process_gone", "router_workers", "served_tokenizer_dir", "wait_for"]


def float32(args: tuple[str, ...]) -> tuple[str, ...]:
    """`args`, led by `--dtype float32` unless they set a dtype: the tests compare with HF
    transformers in float32, and `--dtype auto` rounds prefill products to bfloat16 on CPUs with
    AVX512-BF16."""
    return tuple(args) if "--dtype" in args else ("--dtype", "float32", *args)


class ServerProcess(Server):
    """A Server on `extra` flags (float32 unless they set `--dtype`); waits until gRPC health says
    SERVING unless `wait=False`."""

    def __init__(self, *extra: str, log_path: Path, wait: bool = True):
        super().__init__(float32(extra), log_path)
        if wait:
            self.wait_healthy()


class PDStack(LocalStack):
    """A LocalStack (float32 unless `engine_args` set `--dtype`) of two prefill and two decode
    servers, loading in parallel, and two routers over them: `one_by_one` (the first prefill and the
    first decode) and `two_by_two` (all four); with `pairs=1`, one of each and `one_by_one` only.
    `router_args`: router flags beyond the PD ones the stack gives (policies, retries);
    `prefill_args`, `decode_args`: flags for one role only. close() stops it all."""

    def __init__(self, logs: Path, engine_args: tuple[str, ...], router_args: tuple[str, ...] = (),
                 prefill_args: tuple[str, ...] = (), decode_args: tuple[str, ...] = (), pairs: int = 2):
        super().__init__(logs, float32(engine_args))
        try:
            self.prefills = [self.start_server("prefill", *prefill_args) for _ in range(pairs)]
            self.decodes = [self.start_server("decode", *decode_args) for _ in range(pairs)]
            self.wait()
            self.one_by_one = self.start_router(*router_args, servers=[self.prefills[0], self.decodes[0]],
                                                name="router-1x1")
            if pairs > 1:
                self.two_by_two = self.start_router(*router_args, name="router-2x2")
        except BaseException:  # nothing half-started outlives a failed setup
            self.close()
            raise

    def bootstrap(self, prefill: Server, path: str) -> dict:
        """GET `path` from a prefill's bootstrap service."""
        with urllib.request.urlopen(f"http://127.0.0.1:{prefill.bootstrap_port}{path}", timeout=10) as r:
            return json.load(r)


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
