"""The operator's own Prometheus metrics (served by `tandem operator --metrics-port`)."""

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter("tandem_operator_reconciles_total", "InferenceService reconciliations by result",
                     ["result"])
RECONCILE_SECONDS = Histogram("tandem_operator_reconcile_seconds", "Time to render and apply one InferenceService")
DRIFT_CORRECTIONS = Counter("tandem_operator_drift_corrections_total",
                            "Owned objects recreated or reset after someone deleted or edited them", ["kind"])

# The autoscaler, per InferenceService pool.
POOL_LABELS = ("namespace", "service", "pool")
AUTOSCALER_REPLICAS = Gauge("tandem_autoscaler_replicas", "Servers the pool's StatefulSet runs (a draining "
                            "one included)", POOL_LABELS)
AUTOSCALER_DESIRED = Gauge("tandem_autoscaler_desired_replicas", "Servers the autoscaler wants in the pool",
                           POOL_LABELS)
AUTOSCALER_LOAD = Gauge("tandem_autoscaler_load", "The pool's load in replica units (1.0 = one server at "
                        "its target)", POOL_LABELS)
AUTOSCALER_DECISIONS = Counter("tandem_autoscaler_decisions_total", "Replica changes the autoscaler made, "
                               "by direction (up|down)", (*POOL_LABELS, "direction"))
AUTOSCALER_HEALTHY = Gauge("tandem_autoscaler_healthy", "1 when every ready server of the pool was scraped "
                           "recently, 0 when its metrics are stale (scale-down frozen)", POOL_LABELS)


def exported_metric_names() -> set[str]:
    """Every sample name the operator exports (dashboards and alert rules are checked against it)."""
    own = (RECONCILES, RECONCILE_SECONDS, DRIFT_CORRECTIONS, AUTOSCALER_REPLICAS, AUTOSCALER_DESIRED,
           AUTOSCALER_LOAD, AUTOSCALER_DECISIONS, AUTOSCALER_HEALTHY)
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    return {family.name + suffix for metric in own for family in metric.describe()
            for suffix in suffixes[family.type]}
