"""Every dashboard panel's query returns data from a real Prometheus (the Debian `prometheus`
package, installed by scripts/setup.sh) scraping a local stack: a prefill server, a decode
server and the smg router (what `tandem demo --keep-running` runs), plus the autoscaler's
metrics from the real autoscaler ticking over those servers. The autoscaler's Prometheus
source is checked against its direct scrape, and the chart's alert rules against Prometheus's
parser, on the way."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml
from prometheus_client import REGISTRY, start_http_server

from tandem.operator import dashboards, render
from tandem.operator.scaler import Scaler
from tandem.operator.sources import Pod, PodScraper, PrometheusSource
from tandem.operator.spec import parse_spec
from tandem.operator.status import with_autoscaler
from tandem.tools.stack import LocalStack, free_port, http_post
from support.chart import rendered_rules
from support.serving import wait_for

NAMESPACE, SERVICE = "tandem-test", "smollm2"
SCRAPE_SECONDS = 1
# Grafana's variables as a plain Prometheus needs them: "All" for every selector variable.
VARIABLES = {"$namespace": ".*", "$model": ".*", "$service": ".*", "$__rate_interval": "30s"}


class Prometheus:
    def __init__(self, tmp_path, jobs: list[dict]):
        binary = shutil.which("prometheus")
        assert binary, "the prometheus binary is missing: run scripts/setup.sh (it installs the Debian package)"
        config = tmp_path / "prometheus.yml"
        config.write_text(yaml.safe_dump({"global": {"scrape_interval": f"{SCRAPE_SECONDS}s",
                                                     "evaluation_interval": f"{SCRAPE_SECONDS}s"},
                                          "scrape_configs": jobs}))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(tmp_path / "prometheus.log", "w")
        self.proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                      f"--web.listen-address=127.0.0.1:{self.port}"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(f"{self.url}/-/ready", timeout=2).read()
                break
            except OSError:
                assert time.monotonic() < deadline, "Prometheus did not become ready"
                time.sleep(0.2)

    def query(self, expr: str) -> list[dict]:
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        body = json.loads(urllib.request.urlopen(url, timeout=10).read())
        assert body["status"] == "success", body
        return body["data"]["result"]

    def targets_up(self) -> int:
        return len(self.query("up == 1"))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def static_job(name: str, port: int, **labels: str) -> dict:
    return {"job_name": name, "honor_labels": True,
            "static_configs": [{"targets": [f"127.0.0.1:{port}"], "labels": labels}]}


def chat(base: str, i: int) -> None:
    """Every other request asks for JSON, each with its own schema: the grammar panels get compiles."""
    body = {"model": "smollm2", "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": f"Name {i + 2} colours of the rainbow."}]}
    if i % 2:
        schema = {"type": "object", "properties": {"colours": {"type": "array", "items": {"type": "string"},
                                                               "maxItems": i + 2}}, "required": ["colours"]}
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "colours", "schema": schema}}
    status, reply = http_post(base, "/v1/chat/completions", body)
    assert status == 200, reply


@pytest.fixture(scope="module")
def observed_stack(tmp_path_factory):
    """The stack serving, Prometheus scraping it and the operator's registry, and the
    autoscaler having ticked over the servers while requests ran."""
    logs = tmp_path_factory.mktemp("prometheus-stack")
    with LocalStack(logs) as stack:
        prefill, decode = stack.start_server("prefill"), stack.start_server("decode")
        stack.wait()
        base = stack.start_router().url
        operator_port = free_port()
        operator_http, _ = start_http_server(operator_port, addr="127.0.0.1", registry=REGISTRY)
        pods = {"prefill": f"{SERVICE}-prefill-0", "decode": f"{SERVICE}-decode-0"}
        prom = Prometheus(logs, [
            static_job("prefill", prefill.metrics_port, namespace=NAMESPACE, pod=pods["prefill"], service=SERVICE),
            static_job("decode", decode.metrics_port, namespace=NAMESPACE, pod=pods["decode"], service=SERVICE),
            static_job("tandem-operator", operator_port)])
        try:
            # The autoscaler over these two servers, as the operator would run it; decode's
            # minReplicas was raised above its current size, so its first decision is a scale-up.
            spec = parse_spec(SERVICE, {"model": {"name": "smollm2"}, "image": "tandem:test",
                                        "decode": {"replicas": 2, "minReplicas": 2, "maxReplicas": 4},
                                        "autoscaling": {"enabled": True, "intervalSeconds": 1}})
            inst = render.Instance(SERVICE, NAMESPACE, "uid", spec, replicas={"prefill": 1, "decode": 1})
            by_pool = {"prefill": prefill, "decode": decode}

            def list_pods(inst, pool):
                server = by_pool[pool]
                return [{"metadata": {"name": f"{inst.pool_name(pool)}-0"},
                         "spec": {"containers": [{"ports": [{"name": "metrics", "containerPort": server.metrics_port}]}]},
                         "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}]

            wait_for(lambda: prom.targets_up() == 3, "Prometheus scraping every target", timeout=30, interval=0.3)
            scaler, status = Scaler(list_pods, time.time), {}
            with ThreadPoolExecutor(4) as pool:
                requests = [pool.submit(chat, base, i) for i in range(8)]
                while not all(r.done() for r in requests):
                    status = with_autoscaler(status, scaler.tick(inst, status)[0])
                    time.sleep(0.5)
                for r in requests:
                    r.result()
            status = with_autoscaler(status, scaler.tick(inst, status)[0])
            assert status["decode"]["lastScaling"]["toReplicas"] == 2
            wait_for(lambda: prom.query("tandem_autoscaler_decisions_total"), "the autoscaler's decision scraped", timeout=30, interval=0.3)
            time.sleep(3 * SCRAPE_SECONDS)  # a few samples after the requests, for rate()
            yield prom, pods, by_pool
        finally:
            prom.stop()
            operator_http.shutdown()


@pytest.mark.parametrize("name", sorted(dashboards.dashboards()))
def test_every_dashboard_query_returns_data(observed_stack, name):
    prom, _, _ = observed_stack
    empty = []
    for expr in dashboards.queries(dashboards.dashboards()[name]):
        for variable, value in VARIABLES.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, f"unsubstituted variable in {expr}"
        values = [float(series["value"][1]) for series in prom.query(expr)]
        if not any(not math.isnan(v) for v in values):
            empty.append(expr)
    assert not empty, f"{name}: queries without data:\n" + "\n".join(empty)


def test_prometheus_source_reads_what_the_servers_report(observed_stack):
    prom, pods, by_pool = observed_stack
    targets = [Pod(pods[pool], f"http://127.0.0.1:{server.metrics_port}/metrics") for pool, server in by_pool.items()]
    direct = PodScraper().read(NAMESPACE, targets)
    via_prometheus = PrometheusSource(prom.url).read(NAMESPACE, targets)
    for pod in pods.values():
        a, b = direct[pod], via_prometheus[pod]
        assert a is not None and b is not None, pod
        # Idle servers: the counters and gauges agree; the sample is at most a few scrapes old (a
        # scrape running while the direct read does is stamped a few ms after the read began).
        assert (a.prompt_tokens, a.kv_pages_total, a.waiting) == (b.prompt_tokens, b.kv_pages_total, b.waiting)
        assert a.prompt_tokens > 0 and -1 < a.time - b.time < 10
    assert PrometheusSource(prom.url).read("elsewhere", targets) == {p.name: None for p in targets}


def test_every_alert_rule_is_valid_promql(observed_stack):
    """The chart's alert expressions parse and evaluate on a real Prometheus (they need not fire)."""
    prom, _, _ = observed_stack
    rules = rendered_rules()
    assert rules
    for rule in rules:
        prom.query(rule["expr"])  # a parse or evaluation error is a failed query
    assert prom.query("tandem_autoscaler_healthy == 1")  # what TandemAutoscalerUnhealthy watches is there
