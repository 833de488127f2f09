"""Helpers for tests that run real servers as local processes on 127.0.0.1."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from tandem.server.stack import (
    free_port, http_post, metric_value, metrics_text, spawn_router, spawn_server, wait_healthy, wait_router_ready,
)

__all__ = ["RouterProcess", "ServerProcess", "free_port", "http_post", "metric_value"]


class ServerProcess:
    """`tandem serve` in a subprocess; waits until gRPC health says SERVING."""

    def __init__(self, *extra: str, log_path: Path, wait: bool = True):
        self.log_path, self.args = log_path, list(extra)
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
        self.proc, self.port = spawn_router(list(args), tokenizer_dir, log_path)
        self.base = f"http://127.0.0.1:{self.port}"
        wait_router_ready(self.base, self.proc, log_path, model)

    def post(self, path: str, body: dict, timeout: float = 120) -> tuple[int, str]:
        return http_post(self.base, path, body, timeout)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
