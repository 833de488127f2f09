"""Helpers for tests that run real servers as local processes on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`tandem serve` in a subprocess; waits until gRPC health says SERVING."""

    def __init__(self, *extra: str, log_path: Path):
        self.port, self.metrics_port = free_port(), free_port()
        cmd = [sys.executable, "-m", "tandem.server.cli", "serve", "--host", "127.0.0.1",
               "--port", str(self.port), "--metrics-port", str(self.metrics_port), *extra]
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.target = f"127.0.0.1:{self.port}"
        self.wait_healthy()

    def wait_healthy(self, timeout: float = 240) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.3)
        raise TimeoutError(f"server not healthy after {timeout}s:\n{self.log_path.read_text()[-3000:]}")

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
