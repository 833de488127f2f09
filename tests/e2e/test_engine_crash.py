"""A crash in the engine loop is loud and short: the server leaves rotation at that moment (health
NOT_SERVING, new requests UNAVAILABLE) before any open request is ended, every open request ends
with INTERNAL naming the failure and the request the loop was handling, the crash is counted in
`tandem_engine_crashes_total` and in TANDEM_CRASH_LOG (so the next container of the pod counts it
too), and the process would exit 1. The server runs in this process on 127.0.0.1, so that the test
can break its loop."""

from __future__ import annotations

import logging
import threading
import urllib.request

import pytest
from grpc_health.v1 import health_pb2

from tandem.server.config import EngineConfig, ServeConfig
from tandem.server.edge.crashes import CrashLog
from tandem.server.edge.serve import Server
from tandem.server.scheduling.sampling_params import SamplingParams
from tandem.tools.stack import free_port, metric_value

LONG = SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)


def health(server: Server) -> int:
    return server.health.Check(health_pb2.HealthCheckRequest(service=""), None).status


def crashes_metric(server: Server) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.config.metrics_port}/metrics", timeout=5).read().decode()
    return metric_value(body, "tandem_engine_crashes_total")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the loop thread raises, on purpose
def test_a_crashed_loop_leaves_rotation_first_ends_every_request_and_is_counted(tmp_path, monkeypatch, caplog):
    log_file = tmp_path / "crashes.log"
    monkeypatch.setenv("TANDEM_CRASH_LOG", str(log_file))
    log_file.write_text("1700000000 engine loop crashed: an earlier container's failure\n")
    server = Server(EngineConfig(max_total_tokens=4096), ServeConfig(port=free_port(), metrics_port=free_port()))
    server.start()
    engine = server.engine
    try:
        assert health(server) == health_pb2.HealthCheckResponse.SERVING
        assert crashes_metric(server) == 1, "the earlier container's failure is counted from the start"
        seen_at_failure = []

        def on_failure(reason, told=engine.failed.on_failure):
            told(reason)
            # What the router sees at the moment open requests are about to end.
            seen_at_failure.append((health(server), server.state.draining, list(engine.outputs._live)))

        engine.failed.on_failure = on_failure
        streams = [engine.submit([1000 + i] * 20, LONG) for i in range(3)]
        next(iter(streams[0]))  # running

        def broken_abort(rid, *args, **kwargs):
            raise RuntimeError("injected: a broken abort path")

        engine.call(lambda: setattr(engine.scheduler, "abort", broken_abort))
        with caplog.at_level(logging.ERROR, logger="tandem.engine"):
            streams[1].abort()
            results = [s.result() for s in streams]
            code = {}
            waiter = threading.Thread(target=lambda: code.setdefault("exit", server.wait()))
            waiter.start()
            waiter.join(30)
        assert code == {"exit": 1}
        status, draining, open_streams = seen_at_failure[0]
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING and draining
        assert len(open_streams) == 3, "requests ended before the server left rotation"
        for r in results:
            assert r.finish_reason == "abort" and r.error_code == "internal", r
            assert "engine loop crashed: RuntimeError: injected" in r.error
            assert f"while aborting request {streams[1].rid}" in r.error, r.error
        assert any(f"while aborting request {streams[1].rid}" in m for m in caplog.messages), caplog.messages
        assert seen_at_failure and len(seen_at_failure) == 1
        assert server.metrics.crashes._value.get() == 2
        lines = log_file.read_text().splitlines()
        assert len(lines) == 2 and "injected: a broken abort path" in lines[1] and streams[1].rid in lines[1]
        assert len(CrashLog(log_file).earlier) == 2, "the next container counts both"
    finally:
        engine.shutdown()


def test_without_a_crash_log_failures_are_counted_in_the_process_only(tmp_path, monkeypatch):
    monkeypatch.delenv("TANDEM_CRASH_LOG", raising=False)
    log = CrashLog(None)
    log.record("engine loop crashed: nothing written")
    assert log.earlier == [] and not list(tmp_path.iterdir())


@pytest.mark.parametrize("reason", ["a\nmulti-line\treason", "plain"])
def test_the_crash_log_keeps_one_line_per_failure(tmp_path, reason):
    path = tmp_path / "sub" / "crashes.log"
    CrashLog(path).record(reason)
    CrashLog(path).record("second")
    earlier = CrashLog(path).earlier
    assert len(earlier) == 2 and earlier[0].split(" ", 1)[1] == " ".join(reason.split())
