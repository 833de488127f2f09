"""The Grafana dashboards and the chart's alert rules: the files the chart ships are exactly what
tandem.operator.dashboards generates, every panel queries `$datasource` and filters on the dashboard's
variables, the panels the dashboards promise are there, and every metric a query or an alert names is one
the server or the operator exports."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from support.chart import rendered_rules
from tandem.operator import dashboards
from tandem.operator.metrics import exported_metric_names as operator_metric_names
from tandem.server.edge.metrics import exported_metric_names as server_metric_names

REPO = Path(__file__).resolve().parents[2]
FOLDER = REPO / dashboards.DASHBOARD_DIR
EXPORTED = server_metric_names() | operator_metric_names()
BOARDS = dashboards.dashboards()
DATASOURCE = {"type": "prometheus", "uid": "$datasource"}
# The variables every query of a dashboard filters on.
FILTERS = {"tandem-overview.json": ("namespace", "model"), "tandem-pd.json": ("namespace", "model"),
           "tandem-autoscaling.json": ("namespace", "service")}
REGENERATE = "run `tandem operator dashboards --write`"


def unknown_metrics(exprs: list[str]) -> dict[str, set[str]]:
    """expr -> the metric names it selects that neither the server nor the operator exports."""
    return {expr: unknown for expr in exprs if (unknown := dashboards.metric_names(expr) - EXPORTED)}


def panels(board: dict) -> list[dict]:
    """Every panel but rows, nested ones included."""
    def walk(items):
        for item in items:
            if item["type"] != "row":
                yield item
            yield from walk(item.get("panels", []))
    return list(walk(board["panels"]))


def by_title(board: dict) -> dict[str, dict]:
    found = {p["title"]: p for p in panels(board)}
    assert len(found) == len(panels(board)), "panel titles repeat"
    return found


def exprs(panel: dict) -> list[str]:
    return [t["expr"] for t in panel["targets"]]


def panel_metrics(panel: dict) -> set[str]:
    return set().union(*(dashboards.metric_names(e) for e in exprs(panel)))


# --------------------------------------------------------------------------------------------- generated files


def test_files_are_exactly_what_the_module_generates():
    assert sorted(p.name for p in FOLDER.glob("*.json")) == sorted(BOARDS), f"{FOLDER} is stale: {REGENERATE}"
    for name, board in BOARDS.items():
        assert (FOLDER / name).read_text() == dashboards.dashboard_json(board), f"{name} is stale: {REGENERATE}"


def test_write_regenerates_the_same_bytes_and_drops_stale_files(tmp_path):
    stale = tmp_path / dashboards.DASHBOARD_DIR / "tandem-old.json"
    stale.parent.mkdir(parents=True)
    stale.write_text("{}\n")
    written = dashboards.write(tmp_path)
    assert sorted(p.name for p in written) == sorted(BOARDS) and not stale.exists()
    for path in written:
        assert path.read_bytes() == (FOLDER / path.name).read_bytes()
        assert path.read_text().endswith("}\n") and json.loads(path.read_text()) == BOARDS[path.name]


# --------------------------------------------------------------------------------------------- structure


@pytest.mark.parametrize("name", BOARDS)
def test_panels_are_well_formed(name):
    """Unique ids, positions inside the 24-column grid without overlaps, and every panel queries the
    `$datasource` variable with at least one target (unique refIds)."""
    board = BOARDS[name]
    assert board["uid"] == name.removesuffix(".json") and board["schemaVersion"] >= 39
    everything = [*board["panels"], *(n for p in board["panels"] for n in p.get("panels", []))]
    ids = [p["id"] for p in everything]
    assert len(ids) == len(set(ids)), f"{name}: panel ids repeat: {ids}"
    cells = set()
    for item in everything:
        grid = item["gridPos"]
        assert grid["x"] + grid["w"] <= 24, item["title"]
        area = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not area & cells, f"{name}: {item['title']} overlaps another panel"
        cells |= area
    for item in panels(board):
        assert item["datasource"] == DATASOURCE, item["title"]
        assert item["targets"], f"{name}: {item['title']} has no targets"
        assert all(t["datasource"] == DATASOURCE for t in item["targets"]), item["title"]
        ref_ids = [t["refId"] for t in item["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), item["title"]


@pytest.mark.parametrize("name", BOARDS)
def test_variables_and_query_conventions(name):
    """A Prometheus `datasource` variable, then multi-value `label_values` variables whose "All" is `.*`;
    every selector in every query filters on each of them with `=~`, every rate() and increase() runs over
    `$__rate_interval`, and no query names a variable the dashboard lacks."""
    board = BOARDS[name]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert list(variables) == ["datasource", *FILTERS[name]]
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for label in FILTERS[name]:
        variable = variables[label]
        assert variable["type"] == "query" and variable["datasource"] == DATASOURCE
        assert variable["includeAll"] is True and variable["allValue"] == ".*" and variable["multi"] is True
        metric, by = re.fullmatch(r"label_values\((\w+)(?:\{[^}]*\})?, (\w+)\)", variable["query"]).groups()
        assert metric in EXPORTED and by == label
    for item in panels(board):
        for expr in exprs(item):
            selectors = re.findall(r"\b(tandem_\w+)(\{[^}]*\})?", expr)
            assert selectors, expr
            for metric, matchers in selectors:
                for label in FILTERS[name]:
                    assert f'{label}=~"${label}"' in matchers, f"{item['title']}: {metric} is not filtered on ${label}"
            for function, window in re.findall(r"\b(rate|increase)\((?:[^()\[]|\([^()]*\))*\[([^\]]*)\]", expr):
                assert window == "$__rate_interval", f"{item['title']}: {function}() over [{window}]"
            assert len(re.findall(r"\b(?:rate|increase)\(", expr)) == expr.count("[$__rate_interval]")
            assert set(re.findall(r"\$(\w+)", expr)) <= {*FILTERS[name], "__rate_interval"}, expr


# --------------------------------------------------------------------------------------------- metric names


@pytest.mark.parametrize("name", BOARDS)
def test_dashboard_queries_use_only_exported_metrics(name):
    queries = dashboards.queries(BOARDS[name])
    assert len(queries) == sum(len(p["targets"]) for p in panels(BOARDS[name]))
    assert all(dashboards.metric_names(q) for q in queries)
    assert unknown_metrics(queries) == {}, f"metrics no tandem code exports in {name}"


def test_metric_names_finds_only_metric_names():
    expr = ('histogram_quantile(0.99, sum by (le, role) (rate(tandem_a_bucket{role="tandem_b", model=~"$model"}'
            '[$__rate_interval]))) / on (role) group_left sum without (pod) (tandem_c offset 5m) > bool 1e3'
            ' and tandem_d unless absent(tandem_e) or vector(1)')
    assert dashboards.metric_names(expr) == {"tandem_a_bucket", "tandem_c", "tandem_d", "tandem_e"}
    assert dashboards.metric_names("sum(rate(tandm_requests_finished_total[1m]))") == {"tandm_requests_finished_total"}
    assert dashboards.metric_names("up == 0") == {"up"}


def test_checker_catches_unknown_metric_names():
    """A dashboard that queries a misspelt or invented name, tandem_ or not, fails the check."""
    board = copy.deepcopy(BOARDS["tandem-overview.json"])
    first = panels(board)[0]["targets"][0]
    first["expr"] = first["expr"].replace("tandem_requests_finished_total", "tandem_foo_total")
    panels(board)[1]["targets"][0]["expr"] = 'sum(tandem_num_requests_running{model=~"$model"}) / sum(up)'
    unknown = unknown_metrics(dashboards.queries(board))
    assert sorted(unknown.values(), key=sorted) == [{"tandem_foo_total"}, {"up"}]
    assert unknown_metrics(["rate(tandem_kv_transfer_failure_total[1m])"]) != {}  # _failure_ vs _failures_


def test_alert_rules_use_only_exported_metrics():
    rules = rendered_rules()
    assert {r["alert"] for r in rules} == {"TandemKVTransferFailures", "TandemEngineCrashed", "TandemBootstrapFailures",
                                           "TandemWaitingQueueHigh", "TandemWaitingQueueGrowing",
                                           "TandemAutoscalerUnhealthy"}
    exprs_ = [r["expr"] for r in rules]
    assert all(dashboards.metric_names(e) for e in exprs_)
    assert unknown_metrics(exprs_) == {}, "alert rules name metrics no tandem code exports"
    names = set().union(*(dashboards.metric_names(e) for e in exprs_))
    assert {"tandem_kv_transfer_failures_total", "tandem_engine_crashes_total", "tandem_num_requests_waiting",
            "tandem_autoscaler_healthy"} <= names


# --------------------------------------------------------------------------------------------- promised panels

QUANTILES = {"histogram_quantile(0.5,", "histogram_quantile(0.9,", "histogram_quantile(0.99,"}
PROMISED = {
    "tandem-overview.json": {
        "Request rate": {"tandem_requests_finished_total"},
        "Tokens/s": {"tandem_prompt_tokens_total", "tandem_generation_tokens_total"},
        "Time to first token": {"tandem_time_to_first_token_seconds_bucket"},
        "Inter-token latency": {"tandem_inter_token_latency_seconds_bucket"},
        "End-to-end request latency": {"tandem_e2e_request_latency_seconds_bucket"},
        "Errors": {"tandem_requests_aborted_total", "tandem_kv_transfer_failures_total",
                   "tandem_bootstrap_failures_total", "tandem_retractions_total"},
        "Grammar compiles": {"tandem_grammar_compiles_total", "tandem_grammar_cache_hits_total"},
        "Grammar compile time": {"tandem_grammar_compile_seconds_total", "tandem_grammar_compiles_total"},
    },
    "tandem-pd.json": {
        "Waiting requests": {"tandem_num_requests_waiting"},
        "Running requests": {"tandem_num_requests_running"},
        "Queued prompt tokens": {"tandem_queued_prompt_tokens"},
        "Prefill disaggregation queues": {"tandem_bootstrap_queue_requests", "tandem_inflight_queue_requests"},
        "Decode disaggregation queues": {"tandem_prealloc_queue_requests", "tandem_transfer_queue_requests"},
        "KV transfer throughput": {"tandem_kv_transfer_bytes_total"},
        "KV transfer latency": {"tandem_kv_transfer_latency_seconds_bucket"},
        "Transfer and bootstrap failures": {"tandem_kv_transfer_failures_total", "tandem_bootstrap_failures_total"},
        "Peer handshakes": {"tandem_peer_handshakes_total", "tandem_peer_rehandshakes_total", "tandem_peers_offline_total"},
        "Decode prefix reuse": {"tandem_kv_transfer_bytes_total", "tandem_kv_transfer_skipped_bytes_total"},
        "KV cache usage": {"tandem_kv_pages_used", "tandem_kv_pages_total"},
        "Prefix cache hit ratio": {"tandem_prefix_cache_hit_tokens_total", "tandem_prefix_cache_query_tokens_total"},
        "KV events": {"tandem_kv_event_batches_total", "tandem_kv_event_subscribers", "tandem_kv_event_subscribers_dropped_total"},
        "Decode prefix hit ratio": {"tandem_decode_prefix_hit_tokens_total", "tandem_decode_prefix_query_tokens_total"},
    },
    "tandem-autoscaling.json": {
        "Prefill replicas": {"tandem_autoscaler_replicas", "tandem_autoscaler_desired_replicas"},
        "Decode replicas": {"tandem_autoscaler_replicas", "tandem_autoscaler_desired_replicas"},
        "Load": {"tandem_autoscaler_load"},
        "Scaling decisions": {"tandem_autoscaler_decisions_total"},
        "Autoscaler healthy": {"tandem_autoscaler_healthy"},
    },
}


@pytest.mark.parametrize("name", PROMISED)
def test_dashboards_have_the_promised_panels(name):
    titles = by_title(BOARDS[name])
    for title, metrics in PROMISED[name].items():
        assert title in titles, f"{name} lacks {title!r}"
        assert panel_metrics(titles[title]) == metrics, title


def test_overview_latencies_are_p50_p90_p99_over_all_servers():
    titles = by_title(BOARDS["tandem-overview.json"])
    for title in ("Time to first token", "Inter-token latency", "End-to-end request latency"):
        queries = exprs(titles[title])
        assert {q.split(" ")[0] for q in queries} == QUANTILES, title
        assert all("sum by (le) (rate(" in q for q in queries), title
        assert titles[title]["fieldConfig"]["defaults"]["unit"] == "s"
    assert all("rate(" in q for q in exprs(titles["Request rate"]) + exprs(titles["Errors"]))


def test_pd_panels_are_per_pool():
    """Queue, transfer and cache panels group by the server's role (its pool); the ratios divide two
    per-role sums; the disaggregation queues read the role that owns them."""
    titles = by_title(BOARDS["tandem-pd.json"])
    for title in ("Waiting requests", "Running requests", "Queued prompt tokens", "KV transfer throughput",
                  "Transfer and bootstrap failures", "KV cache usage", "Prefix cache hit ratio"):
        assert all("sum by (role)" in q for q in exprs(titles[title])), title
    assert all("sum by (le, role)" in q for q in exprs(titles["KV transfer latency"]))
    assert {q.split(" ")[0] for q in exprs(titles["KV transfer latency"])} == QUANTILES
    for title in ("KV cache usage", "Prefix cache hit ratio"):
        (query,) = exprs(titles[title])
        assert query.count(" / ") == 1 and titles[title]["fieldConfig"]["defaults"]["unit"] == "percentunit"
    assert all('role="prefill"' in q for q in exprs(titles["Prefill disaggregation queues"]))
    assert all('role="decode"' in q for q in exprs(titles["Decode disaggregation queues"]))


def test_autoscaling_panels_are_per_pool():
    board = BOARDS["tandem-autoscaling.json"]
    titles = by_title(board)
    for pool in ("prefill", "decode"):
        replicas, desired = exprs(titles[f"{pool.capitalize()} replicas"])
        assert f'pool="{pool}"' in replicas and f'pool="{pool}"' in desired
    (decisions,) = exprs(titles["Scaling decisions"])
    assert decisions.startswith("sum by (service, pool, direction) (increase(")
    (healthy,) = exprs(titles["Autoscaler healthy"])
    assert titles["Autoscaler healthy"]["type"] == "stat" and "by (service, pool)" in healthy
    service = next(v for v in board["templating"]["list"] if v["name"] == "service")
    assert service["query"].startswith("label_values(tandem_autoscaler_desired_replicas")
