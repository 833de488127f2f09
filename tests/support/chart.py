"""The Helm chart rendered through Helm's Go SDK."""

from __future__ import annotations

from pathlib import Path

import helm_python as helm
import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "tandem"


def render_chart(values: dict, name: str = "tandem", namespace: str = "tandem-system") -> list[dict]:
    """Every non-empty YAML document the chart renders for an install with `values`."""
    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(values=values, name=name, namespace=namespace, is_install=True)
    return [doc for path, text in out.items() if not path.endswith("/NOTES.txt")
            for doc in yaml.safe_load_all(text) if doc]


def rendered_rules(values: dict | None = None) -> list[dict]:
    docs = render_chart({"prometheusRule": {"enabled": True, **(values or {})}}, name="ops")
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]
