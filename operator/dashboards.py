"""Grafana dashboards for tandem, generated from Python.

`charts/tandem/dashboards/*.json` are this module's output and are never edited by hand:
`tandem operator dashboards --write` regenerates them, the chart ships them as ConfigMaps for
Grafana's dashboard sidecar, and a test fails when a file differs from what this module produces
or when a query names a metric that neither the server nor the operator exports.

Conventions every query follows (tests rely on them):
- the data source is the dashboard variable `$datasource` (a Prometheus data source);
- every series selector filters on the dashboard's variables with regex matchers,
  `namespace=~"$namespace"` and `model=~"$model"` (server metrics) or `service=~"$service"`
  (autoscaler metrics); "All" is the regex `.*`, which also matches a missing label;
- every `rate()` and `increase()` runs over `[$__rate_interval]`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tandem.operator.spec import POOLS

REPO = Path(__file__).resolve().parent.parent
DASHBOARD_DIR = Path("charts") / "tandem" / "dashboards"

SCHEMA_VERSION = 39
DATASOURCE = {"type": "prometheus", "uid": "$datasource"}
RATE_INTERVAL = "$__rate_interval"
QUANTILES = (0.5, 0.9, 0.99)
GRID_WIDTH = 24
TAG = "tandem"

# The variables each family of metrics is filtered by.
SERVER_FILTERS = ("namespace", "model")
AUTOSCALER_FILTERS = ("namespace", "service")


# --------------------------------------------------------------------------------------------- PromQL


def selector(metric: str, filters: tuple[str, ...], *matchers: str) -> str:
    """`metric{var=~"$var", ..., matcher}`: the dashboard's variables, then literal matchers such
    as `role="prefill"`."""
    parts = [f'{label}=~"${label}"' for label in filters] + list(matchers)
    return f"{metric}{{{', '.join(parts)}}}"


def rate(metric: str, filters: tuple[str, ...], *matchers: str) -> str:
    return f"rate({selector(metric, filters, *matchers)}[{RATE_INTERVAL}])"


def increase(metric: str, filters: tuple[str, ...], *matchers: str) -> str:
    return f"increase({selector(metric, filters, *matchers)}[{RATE_INTERVAL}])"


def sum_by(labels: tuple[str, ...], expr: str) -> str:
    return f"sum by ({', '.join(labels)}) ({expr})" if labels else f"sum({expr})"


def quantile(q: float, histogram: str, filters: tuple[str, ...], by: tuple[str, ...] = ()) -> str:
    """The q-quantile of a histogram's observations over the rate interval, per `by` group."""
    return f"histogram_quantile({q}, {sum_by(('le', *by), rate(f'{histogram}_bucket', filters))})"


def legend(*labels: str) -> str:
    """Grafana's legend template for a series' labels, e.g. `{{service}} {{pool}}`."""
    return " ".join(f"{{{{{label}}}}}" for label in labels)


# --------------------------------------------------------------------------------------------- panels


def target(expr: str, legend_format: str, ref_id: str) -> dict:
    return {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend_format, "refId": ref_id}


def _targets(series: list[tuple[str, str]]) -> list[dict]:
    """(expr, legend) pairs as targets A, B, C..."""
    return [target(expr, name, chr(ord("A") + i)) for i, (expr, name) in enumerate(series)]


def panel(kind: str, title: str, description: str, series: list[tuple[str, str]], *, unit: str,
          width: int, height: int, custom: dict | None = None, options: dict | None = None,
          mappings: list | None = None, max_value: float | None = None) -> dict:
    """A Grafana panel of `kind` querying `series`; `layout` fills in its id and position."""
    defaults: dict = {"unit": unit, "min": 0}
    if max_value is not None:
        defaults["max"] = max_value
    if custom:
        defaults["custom"] = custom
    if mappings:
        defaults["mappings"] = mappings
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": _targets(series),
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": options or {},
        "gridPos": {"w": width, "h": height},
    }


def timeseries(title: str, description: str, series: list[tuple[str, str]], *, unit: str = "short",
               width: int = 12, bars: bool = False, max_value: float | None = None) -> dict:
    custom = {"drawStyle": "bars" if bars else "line", "fillOpacity": 60 if bars else 10,
              "lineWidth": 1, "showPoints": "never", "spanNulls": False}
    options = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
               "tooltip": {"mode": "multi", "sort": "desc"}}
    return panel("timeseries", title, description, series, unit=unit, width=width, height=8,
                 custom=custom, options=options, max_value=max_value)


def stat(title: str, description: str, series: list[tuple[str, str]], *, unit: str = "short",
         width: int = 6, mappings: list | None = None) -> dict:
    options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
               "colorMode": "value", "graphMode": "area", "textMode": "auto", "justifyMode": "auto",
               "orientation": "auto"}
    return panel("stat", title, description, series, unit=unit, width=width, height=4,
                 options=options, mappings=mappings)


def latency(title: str, description: str, histogram: str, filters: tuple[str, ...],
            by: tuple[str, ...] = (), width: int = 12) -> dict:
    """p50/p90/p99 of a `_seconds` histogram, one series per quantile and `by` group."""
    series = [(quantile(q, histogram, filters, by), " ".join([f"p{round(q * 100)}", legend(*by)]).strip())
              for q in QUANTILES]
    return timeseries(title, description, series, unit="s", width=width)


def row(title: str) -> dict:
    return {"type": "row", "title": title, "collapsed": False, "panels": [], "gridPos": {"w": GRID_WIDTH, "h": 1}}


def layout(panels: list[dict]) -> list[dict]:
    """Number the panels 1.. and place them left to right, wrapping at the grid's width; a row
    always starts a new line and fills it."""
    x = y = line_height = 0
    for number, item in enumerate(panels, start=1):
        grid = item["gridPos"]
        if x + grid["w"] > GRID_WIDTH:
            x, y, line_height = 0, y + line_height, 0
        grid.update(x=x, y=y)
        item["id"] = number
        x += grid["w"]
        line_height = max(line_height, grid["h"])
    return panels


# --------------------------------------------------------------------------------------------- dashboards


def datasource_variable() -> dict:
    return {"type": "datasource", "name": "datasource", "label": "Data source", "query": "prometheus",
            "current": {}, "hide": 0, "includeAll": False, "multi": False, "options": [], "refresh": 1,
            "regex": ""}


def query_variable(name: str, label: str, metric: str, parents: tuple[str, ...] = ()) -> dict:
    """A multi-value variable listing `name`'s values on `metric` (narrowed by the variables before
    it); "All" is the regex `.*`."""
    query = f"label_values({selector(metric, parents) if parents else metric}, {name})"
    return {"type": "query", "name": name, "label": label, "datasource": DATASOURCE, "query": query,
            "definition": query, "current": {}, "hide": 0, "includeAll": True, "allValue": ".*",
            "multi": True, "options": [], "refresh": 2, "regex": "", "sort": 1}


def server_variables() -> list[dict]:
    return [datasource_variable(),
            query_variable("namespace", "Namespace", "tandem_num_requests_running"),
            query_variable("model", "Model", "tandem_num_requests_running", ("namespace",))]


def autoscaler_variables() -> list[dict]:
    return [datasource_variable(),
            query_variable("namespace", "Namespace", "tandem_autoscaler_desired_replicas"),
            query_variable("service", "InferenceService", "tandem_autoscaler_desired_replicas", ("namespace",))]


def dashboard(uid: str, title: str, description: str, variables: list[dict], panels: list[dict]) -> dict:
    return {
        "uid": uid,
        "title": title,
        "description": f"{description} Generated by `tandem operator dashboards --write`; do not edit.",
        "tags": [TAG],
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "timezone": "browser",
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "annotations": {"list": []},
        "links": [{"type": "dashboards", "title": "tandem", "tags": [TAG], "asDropdown": True,
                   "includeVars": True, "keepTime": True}],
        "templating": {"list": variables},
        "panels": layout(panels),
    }


def overview() -> dict:
    f = SERVER_FILTERS
    by_role = ("role",)
    panels = [
        row("Traffic"),
        stat("Requests/s", "Requests that ended on a decode or colocated server (each request exactly once).",
             [(sum_by((), rate("tandem_requests_finished_total", f, 'role=~"decode|colocated"')), "")],
             unit="reqps"),
        stat("Running requests", "Requests holding a slot on every server.",
             [(sum_by((), selector("tandem_num_requests_running", f)), "")]),
        stat("Waiting requests", "Requests in the servers' waiting queues.",
             [(sum_by((), selector("tandem_num_requests_waiting", f)), "")]),
        stat("Generation tokens/s", "Output tokens generated per second.",
             [(sum_by((), rate("tandem_generation_tokens_total", f)), "")]),
        timeseries("Request rate", "Requests that ended per second, by server role (in a PD pair both the "
                   "prefill and the decode leg count).",
                   [(sum_by(by_role, rate("tandem_requests_finished_total", f)), legend("role"))], unit="reqps"),
        timeseries("Tokens/s", "Prompt tokens admitted and output tokens generated per second, by role.",
                   [(sum_by(by_role, rate("tandem_prompt_tokens_total", f)), f"prompt {legend('role')}"),
                    (sum_by(by_role, rate("tandem_generation_tokens_total", f)), f"generation {legend('role')}")]),
        row("Latency"),
        latency("Time to first token", "Arrival to first output token.", "tandem_time_to_first_token_seconds", f),
        latency("Inter-token latency", "Time between consecutive output tokens.",
                "tandem_inter_token_latency_seconds", f),
        latency("End-to-end request latency", "Arrival to the end of the request.",
                "tandem_e2e_request_latency_seconds", f),
        latency("Queue time", "Arrival to first admission into a forward pass.", "tandem_queue_time_seconds", f),
        row("Errors"),
        timeseries("Errors", "Aborted requests, failed KV transfers, legs that never paired, and running "
                   "requests retracted for lack of KV pages, per second.",
                   [(sum_by((), rate("tandem_requests_aborted_total", f)), "aborted"),
                    (sum_by((), rate("tandem_kv_transfer_failures_total", f)), "KV transfer failures"),
                    (sum_by((), rate("tandem_bootstrap_failures_total", f)), "bootstrap failures"),
                    (sum_by((), rate("tandem_retractions_total", f)), "retractions")], unit="ops", width=24),
        row("Structured output"),
        timeseries("Grammar compiles", "Constraints (JSON schemas, regexes, grammars) compiled per second, and "
                   "those found compiled already (cached by their text), by role.",
                   [(sum_by(by_role, rate("tandem_grammar_compiles_total", f)), f"compiled {legend('role')}"),
                    (sum_by(by_role, rate("tandem_grammar_cache_hits_total", f)), f"cached {legend('role')}")],
                   unit="ops"),
        timeseries("Grammar compile time", "Mean time to compile a constraint, by role (requests wait for it "
                   "before they queue).",
                   [(f'{sum_by(by_role, rate("tandem_grammar_compile_seconds_total", f))} / '
                     f'{sum_by(by_role, rate("tandem_grammar_compiles_total", f))}', legend("role"))], unit="s"),
    ]
    return dashboard("tandem-overview", "tandem / Overview",
                     "Traffic, latency and errors of every tandem server.", server_variables(), panels)


def prefill_decode() -> dict:
    f = SERVER_FILTERS
    by_role = ("role",)

    def per_role(title: str, description: str, metric: str, **kwargs) -> dict:
        return timeseries(title, description, [(sum_by(by_role, selector(metric, f)), legend("role"))], **kwargs)

    panels = [
        row("Queues by pool"),
        per_role("Waiting requests", "Requests in the waiting queue, by pool.", "tandem_num_requests_waiting",
                 width=8),
        per_role("Running requests", "Requests holding a slot, by pool.", "tandem_num_requests_running", width=8),
        per_role("Queued prompt tokens", "Prompt tokens of waiting requests not yet prefilled, by pool.",
                 "tandem_queued_prompt_tokens", width=8),
        timeseries("Prefill disaggregation queues", "Prefill requests waiting for their decode peer "
                   "(bootstrap) and whose KV is being sent (inflight).",
                   [(sum_by((), selector("tandem_bootstrap_queue_requests", f, 'role="prefill"')), "bootstrap"),
                    (sum_by((), selector("tandem_inflight_queue_requests", f, 'role="prefill"')), "inflight")]),
        timeseries("Decode disaggregation queues", "Decode requests handshaking and reserving KV pages "
                   "(prealloc) and waiting for their KV to arrive (transfer).",
                   [(sum_by((), selector("tandem_prealloc_queue_requests", f, 'role="decode"')), "prealloc"),
                    (sum_by((), selector("tandem_transfer_queue_requests", f, 'role="decode"')), "transfer")]),
        row("KV transfer"),
        timeseries("KV transfer throughput", "KV cache bytes sent (prefill) and received (decode) per second.",
                   [(sum_by(by_role, rate("tandem_kv_transfer_bytes_total", f)), legend("role"))],
                   unit="Bps", width=8),
        latency("KV transfer latency", "One request's KV transfer: the write on prefill, registration to "
                "arrival on decode.", "tandem_kv_transfer_latency_seconds", f, by=by_role, width=8),
        timeseries("Transfer and bootstrap failures", "Requests whose KV transfer failed, and whose two legs "
                   "never paired, per second.",
                   [(sum_by(by_role, rate("tandem_kv_transfer_failures_total", f)), f"transfer {legend('role')}"),
                    (sum_by(by_role, rate("tandem_bootstrap_failures_total", f)), f"bootstrap {legend('role')}")],
                   unit="ops", width=8),
        timeseries("Peer handshakes", "Bootstrap handshakes between prefill and decode processes, those with a "
                   "restarted peer (a new instance at a known address), and prefill peers a decode marked offline, "
                   "per second.",
                   [(sum_by(by_role, rate("tandem_peer_handshakes_total", f)), f"handshakes {legend('role')}"),
                    (sum_by(by_role, rate("tandem_peer_rehandshakes_total", f)), f"re-handshakes {legend('role')}"),
                    (sum_by((), rate("tandem_peers_offline_total", f)), "offline")],
                   unit="ops", width=12),
        timeseries("Decode prefix reuse", "Prompt KV the decodes received per second, and what they did not need "
                   "sent because their own prefix cache held it.",
                   [(sum_by((), rate("tandem_kv_transfer_bytes_total", f, 'role="decode"')), "received"),
                    (sum_by((), rate("tandem_kv_transfer_skipped_bytes_total", f)), "skipped")],
                   unit="Bps", width=12),
        row("KV cache"),
        timeseries("KV cache usage", "KV pages used by requests over the pages in the pool, by pool.",
                   [(f'{sum_by(by_role, selector("tandem_kv_pages_used", f))} / '
                     f'{sum_by(by_role, selector("tandem_kv_pages_total", f))}', legend("role"))],
                   unit="percentunit", width=8, max_value=1),
        timeseries("KV pages", "KV pages used and in the pool, by pool.",
                   [(sum_by(by_role, selector("tandem_kv_pages_used", f)), f"used {legend('role')}"),
                    (sum_by(by_role, selector("tandem_kv_pages_total", f)), f"total {legend('role')}")], width=8),
        timeseries("Prefix cache hit ratio", "Prompt tokens served from the prefix cache over those looked up.",
                   [(f'{sum_by(by_role, rate("tandem_prefix_cache_hit_tokens_total", f))} / '
                     f'{sum_by(by_role, rate("tandem_prefix_cache_query_tokens_total", f))}', legend("role"))],
                   unit="percentunit", width=8, max_value=1),
        timeseries("KV events", "What the prefix caches tell routers (SubscribeKvEvents): event batches "
                   "published per second, subscribers, and subscribers dropped for falling behind, by pool.",
                   [(sum_by(by_role, rate("tandem_kv_event_batches_total", f)), f"batches/s {legend('role')}"),
                    (sum_by(by_role, selector("tandem_kv_event_subscribers", f)), f"subscribers {legend('role')}"),
                    (sum_by(by_role, rate("tandem_kv_event_subscribers_dropped_total", f)),
                     f"dropped/s {legend('role')}")], width=12),
        timeseries("Decode prefix hit ratio", "Prompt tokens the decodes found in their own prefix cache before "
                   "the KV transfer (not sent) over the prompt tokens of the requests that arrived.",
                   [(f'{sum_by((), rate("tandem_decode_prefix_hit_tokens_total", f))} / '
                     f'{sum_by((), rate("tandem_decode_prefix_query_tokens_total", f))}', "decode")],
                   unit="percentunit", width=12, max_value=1),
    ]
    return dashboard("tandem-pd", "tandem / Prefill-decode",
                     "Per-pool queues, KV transfer and KV cache of prefill/decode disaggregation.",
                     server_variables(), panels)


HEALTHY_MAPPINGS = [{"type": "value", "options": {"0": {"text": "Stale", "color": "red", "index": 0},
                                                  "1": {"text": "Healthy", "color": "green", "index": 1}}}]


def autoscaling() -> dict:
    f = AUTOSCALER_FILTERS
    by_pool = ("service", "pool")

    def replicas(pool: str) -> dict:
        matcher = f'pool="{pool}"'
        return timeseries(f"{pool.capitalize()} replicas", f"Servers the {pool} StatefulSet runs (a draining one "
                          "included) and the servers the autoscaler wants.",
                          [(sum_by(("service",), selector("tandem_autoscaler_replicas", f, matcher)),
                            f"{legend('service')} running"),
                           (sum_by(("service",), selector("tandem_autoscaler_desired_replicas", f, matcher)),
                            f"{legend('service')} desired")])

    panels = [
        row("Replicas"),
        *(replicas(pool) for pool in POOLS),
        row("Decisions"),
        timeseries("Load", "The pool's load in replica units (1.0 = one server at its target).",
                   [(sum_by(by_pool, selector("tandem_autoscaler_load", f)), legend(*by_pool))]),
        timeseries("Scaling decisions", "Replica changes the autoscaler made, by pool and direction.",
                   [(sum_by((*by_pool, "direction"), increase("tandem_autoscaler_decisions_total", f)),
                     legend(*by_pool, "direction"))], bars=True),
        stat("Autoscaler healthy", "Healthy: every ready server of the pool was scraped recently. Stale: its "
             "metrics are stale and scale-down is frozen.",
             [(f"min by (service, pool) ({selector('tandem_autoscaler_healthy', f)})", legend(*by_pool))],
             unit="none", width=24, mappings=HEALTHY_MAPPINGS),
    ]
    return dashboard("tandem-autoscaling", "tandem / Autoscaling",
                     "Replicas, load and decisions of the operator's autoscaler, per InferenceService pool.",
                     autoscaler_variables(), panels)


def dashboards() -> dict[str, dict]:
    """File name -> dashboard JSON (as a dict), for every dashboard the chart ships."""
    return {f"{board['uid']}.json": board for board in (overview(), prefill_decode(), autoscaling())}


def queries(board: dict) -> list[str]:
    """Every PromQL expression of a dashboard's panels (rows' nested panels included)."""
    def walk(panels: list[dict]):
        for item in panels:
            yield from (t["expr"] for t in item.get("targets", []))
            yield from walk(item.get("panels", []))
    return list(walk(board["panels"]))


# --------------------------------------------------------------------------------------------- checking

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", re.IGNORECASE)
_IDENTIFIER = re.compile(r"(?<![\w.:$])[A-Za-z_:][\w:]*")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
             "offset", "atan2", "start", "end", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: every identifier left once string literals,
    label matchers `{...}`, ranges `[...]` and grouping label lists `by (...)` are removed, that is
    neither a function or aggregation (followed by `(`) nor a keyword. Any name counts, not only
    `tandem_*` ones, so a misspelt name is reported rather than skipped."""
    text = _STRINGS.sub('""', expr)
    text = _MATCHERS.sub("", text)
    text = _RANGES.sub("", text)
    text = _LABEL_LISTS.sub("", text)
    names = set()
    for match in _IDENTIFIER.finditer(text):
        if match.group().lower() in _KEYWORDS or re.match(r"\s*\(", text[match.end():]):
            continue
        names.add(match.group())
    return names


# --------------------------------------------------------------------------------------------- files


def dashboard_json(board: dict) -> str:
    return json.dumps(board, indent=2, sort_keys=True) + "\n"


def write(root: Path = REPO) -> list[Path]:
    """Write every dashboard to `root`/charts/tandem/dashboards/, removing stale ones there."""
    folder = root / DASHBOARD_DIR
    folder.mkdir(parents=True, exist_ok=True)
    boards = dashboards()
    for stale in folder.glob("*.json"):
        if stale.name not in boards:
            stale.unlink()
    paths = []
    for name, board in boards.items():
        path = folder / name
        path.write_text(dashboard_json(board))
        paths.append(path)
    return paths
