"""Helpers for tests that run real servers as local processes on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from tandem.server.stack import free_port, http_post, wait_healthy, wait_router_ready

__all__ = ["RouterProcess", "ServerProcess", "free_port", "http_post", "metric_value"]


class ServerProcess:
    """`tandem serve` in a subprocess; waits until gRPC health says SERVING."""

    def __init__(self, *extra: str, log_path: Path, wait: bool = True):
        self.port, self.metrics_port = free_port(), free_port()
        cmd = [sys.executable, "-m", "tandem.server.cli", "serve", "--host", "127.0.0.1",
               "--port", str(self.port), "--metrics-port", str(self.metrics_port), *extra]
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.target = f"127.0.0.1:{self.port}"
        if wait:
            self.wait_healthy()

    def wait_healthy(self, timeout: float = 240) -> None:
        wait_healthy(self.target, self.proc, self.log_path, timeout)

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            return r.read().decode()

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


class RouterProcess:
    """`smg launch` (the real router) in a subprocess; ready once it generates through a worker.
    `args` name the workers: `--worker-urls ...`, or `--pd-disaggregation --prefill ... --decode ...`."""

    def __init__(self, *args: str, tokenizer_dir: str, log_path: Path, model: str = "smollm2"):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "w")
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "smg", "launch", "--host", "127.0.0.1", "--port", str(self.port), *args,
             "--model-path", tokenizer_dir, "--worker-startup-check-interval", "1", "--log-level", "warn",
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
            stdout=self._log, stderr=subprocess.STDOUT,
        )
        wait_router_ready(self.base, self.proc, log_path, model)

    def post(self, path: str, body: dict, timeout: float = 120) -> tuple[int, str]:
        return http_post(self.base, path, body, timeout)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self._log.close()


def metric_value(text: str, name: str) -> float:
    """The value of an unlabelled-by-test sample `name` (summed over its label sets)."""
    from prometheus_client.parser import text_string_to_metric_families

    total, found = 0.0, False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                total += sample.value
                found = True
    if not found:
        raise KeyError(f"metric {name} not exported")
    return total
