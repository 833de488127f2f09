"""The operator's own Prometheus metrics (served by `tandem operator --metrics-port`)."""

from prometheus_client import Counter, Histogram

RECONCILES = Counter("tandem_operator_reconciles_total", "InferenceService reconciliations by result",
                     ["result"])
RECONCILE_SECONDS = Histogram("tandem_operator_reconcile_seconds", "Time to render and apply one InferenceService")
DRIFT_CORRECTIONS = Counter("tandem_operator_drift_corrections_total",
                            "Owned objects recreated or reset after someone deleted or edited them", ["kind"])
