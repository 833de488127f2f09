"""`tandem serve`: the engine behind SGLang's gRPC scheduler protocol, the standard gRPC health
service and Prometheus `/metrics`.

Lifecycle: load the model (nothing listens yet, so clients see UNAVAILABLE) -> serve (health
SERVING) -> on SIGTERM or SIGINT drain: new requests get UNAVAILABLE, health turns NOT_SERVING,
in-flight requests get `drain_grace_seconds` to finish (a prefill also tells its decode peers it
is leaving; a decode tells its prefill peers when it exits), the rest are aborted, exit 0. When
the engine fails (its loop crashed, an overlapped forward pass failed, a tensor-parallel rank
died), health turns NOT_SERVING and new requests get UNAVAILABLE at that moment, on the failing
thread and before any open request is ended; in-flight requests end with INTERNAL naming the
failure, `tandem_engine_crashes_total` counts it (across the pod's container restarts with
TANDEM_CRASH_LOG) and the process exits 1, so that Kubernetes restarts the container.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tandem.server.config import DisaggConfig, EngineConfig, ServeConfig
from tandem.server.env import crash_log
from tandem.server.edge.allocator import describe as describe_allocator
from tandem.server.edge.crashes import CrashLog
from tandem.server.edge.tls import ServerCertificates, bind

log = logging.getLogger("tandem.serve")

VERSION = "tandem-0.1.0"

# The router pings idle HTTP/2 connections every 30 s; grpc's defaults would answer GOAWAY.
GRPC_OPTIONS = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
]


class Server:
    """One serving process: build with `Server(engine_config, serve_config)`, then `start()`,
    `wait()`; `drain()` from any thread (the signal handler calls it)."""

    def __init__(self, engine_config: EngineConfig, config: ServeConfig, disagg: DisaggConfig | None = None):
        from tandem.server.loop.engine import Engine
        from tandem.server.edge.grpc_servicer import SchedulerServicer, add_to_server
        from tandem.server.edge.grpc_status import ServerIdentity, ServingState
        from tandem.server.edge.metrics import Metrics
        from tandem.server.model.loader import resolve_model
        from tandem.server.model.tokenizer import tokenizer_dir

        config.validate()
        log.info("memory allocator: %s", describe_allocator(config.allocator, engine_config.device))
        disagg = disagg or DisaggConfig()
        self.config = config
        self.state = ServingState()
        name = config.served_model_name or resolve_model(engine_config.model).name
        self.metrics = Metrics(disagg.role, name)
        self.crash_log = CrashLog(crash_log())
        self.metrics.crashes.inc(len(self.crash_log.earlier))
        self.engine = Engine(engine_config, observer=self.metrics, disagg=disagg, host=config.host, port=config.port,
                             on_failure=self._engine_failed)
        model = self.engine.model
        self.metrics.bind(lambda: self.engine.snapshot)
        tokenizer_path = str(tokenizer_dir(model.source).resolve())
        identity = ServerIdentity(
            served_model_name=name,
            model_path=str(model.source.path),
            tokenizer_path=tokenizer_path,
            role=disagg.role,
            server_args=server_args(engine_config, disagg, name, tokenizer_path, self.engine),
            version=VERSION,
        )
        self.servicer = SchedulerServicer(self.engine, identity, self.state, kv_events=not config.disable_kv_events)
        # A thread per concurrent stream: every running and queued request, plus room for
        # health checks, loads and metrics that must answer while the model computes.
        workers = engine_config.max_running_requests + engine_config.max_queued_requests + 16
        self.grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=min(workers, 2048)), options=GRPC_OPTIONS)
        add_to_server(self.servicer, self.grpc)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        certificates = None
        if config.tls_cert is not None:
            certificates = ServerCertificates(config.tls_cert, config.tls_key, config.tls_ca)
        bound = bind(self.grpc, config.host, config.port, certificates)
        if bound == 0:
            raise OSError(f"--port {config.port}: cannot listen on {config.host}:{config.port}")
        self._stopped = threading.Event()
        self._stopping: str | None = None  # "drain" or "failure" once one of them has begun to stop the server

    def start(self) -> None:
        self.engine.start()
        self.metrics_server = self.metrics.serve(self.config.host, self.config.metrics_port)
        self.grpc.start()
        for service in ("", "sglang.grpc.scheduler.SglangScheduler"):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        c = self.config
        transport = "mutual TLS" if c.tls_ca else "TLS" if c.tls_cert else "plaintext"
        log.info(
            "serving %s as %s on %s:%d (gRPC, %s; metrics :%d), KV pool %d tokens",
            self.servicer.identity.served_model_name, self.engine.role, c.host, c.port, transport,
            c.metrics_port, self.engine.max_total_tokens,
        )

    def drain(self) -> None:
        """Stop admitting, let in-flight requests finish within the grace period, then stop."""
        if self._stopping is not None or self.state.draining:
            return
        self._stopping = "drain"
        self.state.drain()
        self.health.enter_graceful_shutdown()
        log.info("draining: refusing new requests, %.0fs for in-flight ones", self.config.drain_grace_seconds)
        threading.Thread(target=self._finish_drain, name="tandem-drain", daemon=True).start()

    def _finish_drain(self) -> None:
        deadline = time.monotonic() + self.config.drain_grace_seconds
        try:
            self.engine.drain()  # a prefill stops taking rooms and tells its decode peers it is leaving
            while time.monotonic() < deadline and not self.engine.drained():
                time.sleep(0.05)
        except RuntimeError:  # the engine has stopped already
            pass
        self.engine.shutdown()  # aborts whatever is left; their streams end with finish_reason abort
        self.grpc.stop(grace=2.0).wait()
        self.metrics_server[0].shutdown()
        self._stopped.set()

    def wait(self) -> int:
        """Until the server has stopped: 0 after a drain, 1 when the engine failed (its loop crashed,
        a forward pass or a tensor-parallel rank failed), which the exit status reports so that the
        container restarts."""
        while not self._stopped.wait(0.2):
            if self.engine.failed.reason and self._stopping is None:
                self._fail()
        return 1 if self.engine.failed.reason else 0

    def _engine_failed(self, reason: str) -> None:
        """From the failing engine's thread, before it ends the open requests: out of rotation now
        (the router and readiness probes see NOT_SERVING; Generate answers UNAVAILABLE)."""
        self.state.drain()
        for service in ("", "sglang.grpc.scheduler.SglangScheduler"):
            self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.metrics.crashes.inc()
        self.crash_log.record(reason)

    def _fail(self) -> None:
        """The engine failed: `_engine_failed` took the server out of rotation already and the open
        requests have ended with an error (the engine closed them), so stop without a grace period."""
        self._stopping = "failure"
        log.error("stopping: %s", self.engine.failed.reason)
        self.engine.shutdown()
        self.grpc.stop(grace=2.0).wait()
        self.metrics_server[0].shutdown()
        self._stopped.set()


def server_args(engine_config: EngineConfig, disagg: DisaggConfig, name: str, tokenizer_path: str, engine) -> dict:
    """GetServerInfo.server_args, with the keys SGLang's router reads. The router lets these
    override GetModelInfo's, so tokenizer_path must be the directory it can load."""
    c = engine_config
    return {
        "model_path": str(engine.model.source.path),
        "served_model_name": name,
        "tokenizer_path": tokenizer_path,
        "page_size": c.page_size,
        "dtype": str(engine.model.precision.weights).removeprefix("torch."),
        "context_length": engine.context_length,
        "max_total_tokens": engine.max_total_tokens,
        "kv_bytes_per_token": engine.kv_bytes_per_token,
        "max_running_requests": c.max_running_requests,
        "max_prefill_tokens": engine.scheduler.config.max_prefill_tokens,
        "chunked_prefill_size": c.chunked_prefill_size,
        "schedule_policy": c.schedule_policy,
        "disable_radix_cache": c.disable_radix_cache,
        "disaggregation_mode": "null" if disagg.role == "colocated" else disagg.role,
        "disaggregation_transfer_backend": "mooncake",
        "disaggregation_bootstrap_port": disagg.bootstrap_port,
        "disaggregation_ib_device": disagg.ib_device,
        "kv_transfer_protocol": disagg.kv_transfer_protocol,
        "tp_size": c.tp_size,
        "dp_size": 1,
        "pp_size": 1,
        "is_embedding": False,
        "vocab_size": engine.model.config.vocab_size,
        # GetModelInfo names the architecture; the protocol has no field for a mixture of experts
        "model_type": engine.model.config.architecture,
        "num_experts": engine.model.config.num_experts,
        "num_experts_per_tok": engine.model.config.experts_per_token,
        # SGLang's name for what compiles sampling_params.constraint (the protocol has no field of
        # its own for structured output).
        "grammar_backend": "xgrammar",
    }


def run(engine_config: EngineConfig, config: ServeConfig, disagg: DisaggConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = Server(engine_config, config, disagg)
    server.start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.drain())
    code = server.wait()
    log.info("stopped" if code == 0 else "stopped after a failure")
    return code
