"""A local serving stack of real processes on 127.0.0.1: `tandem serve` servers (colocated,
prefill, decode) and the `smg` router in front. `tandem demo` and `tandem bench pd` run on it;
the tests use its servers, routers and waiting helpers.

Ownership: the stack started every process it lists and stops all of them on close (SIGTERM,
then SIGKILL after a grace period), including when the caller is interrupted.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.server.cgroup import usable_cpus

if TYPE_CHECKING:  # certs needs `cryptography`, a development dependency
    from tandem.tools.certs import MutualTLS


# Ports for the servers a stack starts: below Linux's ephemeral range (32768-60999 by default), from
# which the kernel also picks the local ports of outgoing connections. A port bind(0) returned there
# was once taken, before the server bound it, by a connection its own tensor-parallel ranks opened.
PORT_RANGE = (20000, 32768)
# Ports free_port has handed out in this process: a server binds its port only once its model has
# loaded, so until then a second pick could land on the same free port (in a CI run a server of
# test_pd_router's stack failed to bind its port: "Address already in use").
_handed_out: set[int] = set()


def free_port() -> int:
    """A port in PORT_RANGE that nothing listens on now and that this process has not handed out before."""
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(*PORT_RANGE)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {PORT_RANGE} after 100 tries")


def wait_healthy(target: str, proc: subprocess.Popen, log_path: Path, timeout: float = 240,
                 credentials=None) -> None:
    """Until the server at `target` reports SERVING on grpc.health.v1; raise if it exits first.
    `credentials`: TLS channel credentials, for a server started with --tls-cert."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    channel = grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.3)
    raise TimeoutError(f"server {target} not healthy after {timeout}s:\n{log_path.read_text()[-3000:]}")


def http_post(base: str, path: str, body: dict, timeout: float = 120, api_key: str | None = None) -> tuple[int, str]:
    """POST JSON (with `Authorization: Bearer api_key` when given); (HTTP status, body), or (0, why)
    when nothing answered."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    req = urllib.request.Request(base + path, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        return 0, str(e)


def wait_router_ready(base: str, proc: subprocess.Popen, log_path: Path, model: str, timeout: float = 120,
                      api_key: str | None = None) -> None:
    """Until the router generates through its workers (registered, tokenizer loaded)."""
    deadline = time.monotonic() + timeout
    probe = {"model": model, "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        status, body = http_post(base, "/generate", probe, timeout=30, api_key=api_key)
        if status == 200:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"router not ready after {timeout}s ({status} {body[:200]}):\n{log_path.read_text()[-3000:]}")
        time.sleep(0.5)


def spawn_server(args: list[str], log_path: Path, port: int | None = None,
                 metrics_port: int | None = None) -> tuple[subprocess.Popen, int, int]:
    """Start `tandem serve --host 127.0.0.1` (not waiting) on the given ports, or free ones:
    (process, gRPC port, metrics port). `args` are further serve flags (role, engine settings).
    A server started at given ports (a restart) appends to its log; a new one starts it afresh."""
    mode = "a" if port else "w"
    port, metrics_port = port or free_port(), metrics_port or free_port()
    cmd = [sys.executable, "-m", "tandem.cli.main", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--metrics-port", str(metrics_port), *args]
    with open(log_path, mode) as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, port, metrics_port


def spawn_router(workers: list[str], tokenizer_dir: str, log_path: Path) -> tuple[subprocess.Popen, int, int]:
    """Start `smg launch` on free ports (not waiting): (process, HTTP port, /metrics port). `workers`
    name the workers: `--worker-urls ...`, or `--pd-disaggregation --prefill ... --decode ...`."""
    port, metrics_port = free_port(), free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "smg", "launch", "--host", "127.0.0.1", "--port", str(port), *workers,
             "--model-path", tokenizer_dir, "--worker-startup-check-interval", "1", "--log-level", "warn",
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)],
            stdout=log, stderr=subprocess.STDOUT,
        )
    return proc, port, metrics_port


def metrics_text(metrics_port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        return r.read().decode()


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sample `name` in a Prometheus exposition, summed over its label sets (those with `labels`);
    KeyError if absent."""
    from prometheus_client.parser import text_string_to_metric_families

    values = [s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    if not values:
        raise KeyError(f"metric {name} not exported")
    return sum(values)


# smg treats a PD leg that answers nothing for 3 s as a wedged worker; a CPU prefill of a few long
# prompts takes longer than that. A server being restarted is excluded once the router has had no
# contact with it for 2 s (--worker-stall-secs) and a load poll (each second) fails; until then,
# retries (each with a new prefill/decode pair and room, about 5 s in all) carry its requests.
ROUTER_PD_ARGS = ("--worker-wedge-secs", "120", "--load-monitor-interval", "1", "--retry-max-retries", "10",
                  "--retry-initial-backoff-ms", "100", "--retry-max-backoff-ms", "1000")


def served_tokenizer_dir(target: str) -> str:
    """The tokenizer directory the server at `target` names in GetModelInfo: what smg loads as its
    `--model-path`."""
    import grpc
    from smg_grpc_proto import sglang_scheduler_pb2 as pb
    from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc

    with grpc.insecure_channel(target) as channel:
        return pb_grpc.SglangSchedulerStub(channel).GetModelInfo(pb.GetModelInfoRequest()).tokenizer_path


def stop_process(proc: subprocess.Popen, sig=signal.SIGTERM, timeout: float = 60) -> int:
    """Send `sig` to `proc` if it runs, SIGKILL after `timeout` seconds; its exit code."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class Server:
    """`tandem serve` (spawn_server) on free ports, not waited for (see wait_healthy()). `args` are
    its serve flags; `role` and `bootstrap_port` say what they set, for router_workers();
    `credentials`, what a gRPC client presents where the flags turn TLS on."""

    def __init__(self, args: list[str] | tuple[str, ...], log_path: Path, role: str = "colocated",
                 bootstrap_port: int | None = None, credentials=None):
        self.args, self.log_path, self.role, self.bootstrap_port = list(args), log_path, role, bootstrap_port
        self.credentials = credentials
        self.proc, self.port, self.metrics_port = spawn_server(self.args, log_path)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def metrics_text(self) -> str:
        return metrics_text(self.metrics_port)

    def wait_healthy(self, timeout: float = 240) -> None:
        wait_healthy(self.target, self.proc, self.log_path, timeout, self.credentials)

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        return stop_process(self.proc, sig, timeout)

    def restart(self, sig=signal.SIGTERM, wait: bool = True) -> int:
        """Stop the process with `sig`, then start a new one with the same flags at the same ports
        (what a StatefulSet rollout does to a pod). Returns the old process's exit code."""
        code = self.stop(sig)
        self.proc, _, _ = spawn_server(self.args, self.log_path, self.port, self.metrics_port)
        if wait:
            self.wait_healthy()
        return code


class Router:
    """`smg launch` (spawn_router) with flags `args`, the workers first (router_workers()), serving
    `model` with the tokenizer in `tokenizer_dir`; constructed once it generates through its
    workers, stopped if it never does. `api_key`: what the readiness probe and `post` present, for a
    router started with `--tenant-api-key`."""

    def __init__(self, *args: str, tokenizer_dir: str, log_path: Path, model: str = "smollm2",
                 api_key: str | None = None):
        self.log_path = log_path
        self.api_key = api_key
        self.proc, self.port, self.metrics_port = spawn_router(list(args), tokenizer_dir, log_path)
        try:
            wait_router_ready(self.url, self.proc, log_path, model, api_key=api_key)
        except BaseException:  # nothing half-started outlives a failed start
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def post(self, path: str, body: dict, timeout: float = 120) -> tuple[int, str]:
        return http_post(self.url, path, body, timeout, self.api_key)

    def stop(self) -> None:
        stop_process(self.proc, signal.SIGTERM, 30)


def router_workers(servers: list[Server]) -> list[str]:
    """smg's flags naming `servers` as its workers: where any is a prefill, PD mode
    (`--pd-disaggregation` and ROUTER_PD_ARGS, `--prefill URL BOOTSTRAP_PORT` per prefill, `--decode
    URL` per decode); else `--worker-urls`."""
    prefills = [s for s in servers if s.role == "prefill"]
    if not prefills:
        return ["--worker-urls", *(f"grpc://{s.target}" for s in servers)]
    workers = ["--pd-disaggregation", *ROUTER_PD_ARGS]
    for s in prefills:
        workers += ["--prefill", f"grpc://{s.target}", str(s.bootstrap_port)]
    return workers + [a for s in servers if s.role == "decode" for a in ("--decode", f"grpc://{s.target}")]


@dataclass
class LocalStack:
    log_dir: Path
    engine_args: tuple[str, ...] = ()
    model_name: str = "smollm2"
    tls: MutualTLS | None = None  # every server's gRPC over mutual TLS with these certificates
    servers: list[Server] = field(default_factory=list)
    routers: list[Router] = field(default_factory=list)

    def start_server(self, role: str, *extra: str) -> Server:
        """Launch `tandem serve --role ROLE` (not waiting; see wait())."""
        bootstrap = free_port() if role == "prefill" else None
        args = ["--role", role, "--served-model-name", self.model_name, *self.engine_args, *extra]
        if bootstrap is not None:
            args += ["--bootstrap-port", str(bootstrap)]
        credentials = None
        if self.tls is not None:
            args += self.tls.serve_flags()
            credentials = self.tls.client_credentials()
        server = Server(args, self.log_dir / f"{role}-{len(self.servers)}.log", role, bootstrap, credentials)
        self.servers.append(server)
        return server

    def start_servers(self, roles: list[str]) -> list[Server]:
        """Launch one server per role on this machine's cores (engine flags that set
        `--num-threads` or `--compute-priority` take precedence). Servers of one role split the
        cores between them: more torch threads than cores at one priority stall each other's
        parallel regions. Decodes beside prefills take the cores too, at `--compute-priority
        idle`: a prefill's forward pass goes first, as a colocated server's prefills pause its
        decodes, and the decodes compute in the time it leaves (measured in docs/disaggregation.md)."""
        cores = usable_cpus()[0]  # in a container, what its CPU limit allows
        given = {a.split("=")[0] for a in self.engine_args}
        servers = []
        for role in roles:
            extra: list[str] = []
            if "--num-threads" not in given:
                extra += ["--num-threads", str(max(1, cores // roles.count(role)))]
            if role == "decode" and "prefill" in roles and "--compute-priority" not in given:
                extra += ["--compute-priority", "idle"]
            servers.append(self.start_server(role, *extra))
        return servers

    def wait(self) -> None:
        for server in self.servers:
            server.wait_healthy()

    def start_router(self, *extra: str, servers: list[Server] | None = None, name: str = "router",
                     api_key: str | None = None) -> Router:
        """`smg launch` over `servers` (every server by default; PD mode where there are prefill
        servers), with `extra` router flags after the workers, logging to NAME.log; returned once it
        generates."""
        servers = self.servers if servers is None else servers
        router = Router(*router_workers(servers), *extra, tokenizer_dir=served_tokenizer_dir(servers[0].target),
                        log_path=self.log_dir / f"{name}.log", model=self.model_name, api_key=api_key)
        self.routers.append(router)
        return router

    @property
    def router_url(self) -> str:
        """The first router's base URL."""
        return self.routers[0].url

    def close(self, grace: float = 30) -> None:
        procs = [r.proc for r in self.routers] + [s.proc for s in self.servers]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def __enter__(self) -> "LocalStack":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
