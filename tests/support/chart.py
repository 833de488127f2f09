"""The Helm chart rendered through Helm's Go SDK."""

from __future__ import annotations

from pathlib import Path

import helm_python as helm
import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "tandem"


def rendered_rules(values: dict | None = None) -> list[dict]:
    values = {"prometheusRule": {"enabled": True, **(values or {})}}
    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(values=values, name="ops", namespace="tandem-system", is_install=True)
    (rule,) = [d for path, text in out.items() if not path.endswith("/NOTES.txt")
               for d in yaml.safe_load_all(text) if d and d["kind"] == "PrometheusRule"]
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


def render_chart(values: dict, name: str = "tandem", namespace: str = "tandem-system") -> list[dict]:
    """Every non-empty YAML document the chart renders for an install with `values`."""
    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(values=values, name=name, namespace=namespace, is_install=True)
    return [doc for path, text in out.items() if not path.endswith("/NOTES.txt")
            for doc in yaml.safe_load_all(text) if doc]
