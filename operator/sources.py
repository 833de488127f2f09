"""Where the autoscaler reads servers' signals: each pod's /metrics, or a Prometheus server.

Both answer `read(namespace, pods) -> {pod name: PodSignals or None}`; None means the pod could
not be read this time (the autoscaler counts it as unknown).
"""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tandem.operator.signals import METRICS, PodSignals

TIMEOUT = 3.0


@dataclass(frozen=True)
class Pod:
    """A ready server: its name and where its /metrics answers."""

    name: str
    metrics_url: str


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=TIMEOUT) as response:
        return response.read().decode()


class PodScraper:
    """GET each pod's /metrics (in parallel)."""

    def __init__(self, workers: int = 8):
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="scrape")

    def _one(self, pod: Pod) -> PodSignals | None:
        try:
            return PodSignals.from_text(pod.name, time.time(), _fetch(pod.metrics_url))
        except (OSError, ValueError):
            return None

    def read(self, namespace: str, pods: list[Pod]) -> dict[str, PodSignals | None]:
        return dict(zip((p.name for p in pods), self.pool.map(self._one, pods)))


class PrometheusSource:
    """Instant queries against the Prometheus HTTP API, one per signal, for the pods' series
    (which must carry `namespace` and `pod` labels)."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")

    def _query(self, expr: str) -> list[dict]:
        body = json.loads(_fetch(f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
        if body.get("status") != "success":
            raise ValueError(f"Prometheus query failed: {body.get('error', body)}")
        return body["data"]["result"]

    def read(self, namespace: str, pods: list[Pod]) -> dict[str, PodSignals | None]:
        if not pods:
            return {}
        selector = f'{{namespace="{namespace}",pod=~"{"|".join(p.name for p in pods)}"}}'
        values: dict[str, dict[str, float]] = {p.name: {} for p in pods}
        try:
            for field, metric in METRICS.items():
                for pod, value in self._by_pod(f"sum by (pod) ({metric}{selector})"):
                    values[pod][field] = value
            # When the pod was last scraped (an instant query's own time is the query's).
            times = dict(self._by_pod(f"max by (pod) (timestamp(tandem_num_requests_waiting{selector}))"))
        except (OSError, ValueError, KeyError):
            return {p.name: None for p in pods}
        return {pod: PodSignals(pod, times[pod], **fields) if len(fields) == len(METRICS) and pod in times else None
                for pod, fields in values.items()}

    def _by_pod(self, expr: str) -> list[tuple[str, float]]:
        return [(series["metric"]["pod"], float(series["value"][1])) for series in self._query(expr)
                if "pod" in series["metric"]]
