"""Helpers for tests that run real servers as local processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        deadline = time.monotonic() + 120
        probe = {"model": model, "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        while True:  # workers registered, tokenizer loaded, a request goes through
            assert self.proc.poll() is None, log_path.read_text()[-3000:]
            status, _ = self.post("/generate", probe, timeout=30)
            if status == 200:
                return
            assert time.monotonic() < deadline, f"router not ready ({status}):\n{log_path.read_text()[-3000:]}"
            time.sleep(0.5)

    def post(self, path: str, body: dict, timeout: float = 120) -> tuple[int, str]:
        return http_post(self.base, path, body, timeout)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self._log.close()


def http_post(base: str, path: str, body: dict, timeout: float = 120) -> tuple[int, str]:
    """POST JSON; (HTTP status, body), or (0, why) when nothing answered."""
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        return 0, str(e)


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
