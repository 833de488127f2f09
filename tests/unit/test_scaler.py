"""The autoscaler's tick without Kubernetes or HTTP: fake pod listings and readings."""

from tandem.operator import render
from tandem.operator.scaler import Scaler
from tandem.operator.signals import PodSignals
from tandem.operator.spec import parse_spec
from tandem.operator.status import with_autoscaler

FAST = {"stableWindowSeconds": 2, "panicWindowSeconds": 1, "scaleDownWindowSeconds": 2, "drainTimeoutSeconds": 30}


class Cluster:
    """Pods by StatefulSet, their readiness, and what each server reports."""

    def __init__(self):
        self.ready: dict[str, bool] = {}
        self.signals: dict[str, dict] = {}
        self.now = 0.0

    def list_pods(self, inst, pool):
        return [{"metadata": {"name": name}, "status": {"podIP": "10.0.0.1", "conditions": [
                    {"type": "Ready", "status": "True" if ready else "False"}]}}
                for name, ready in self.ready.items() if name.startswith(inst.pool_name(pool) + "-")]

    def read(self, namespace, pods):
        return {p.name: PodSignals(p.name, self.now, kv_pages_total=100, **self.signals.get(p.name, {}))
                for p in pods}


def instance(decode_min: int, replicas: dict, draining=frozenset()):
    spec = parse_spec("svc", {"model": {"name": "m"}, "image": "i",
                              "decode": {"replicas": 1, "minReplicas": decode_min, "maxReplicas": 4},
                              "autoscaling": {"enabled": True, "intervalSeconds": 1, "routerSettleSeconds": 0,
                                              "prefill": FAST, "decode": FAST}})
    return render.Instance("svc", "ns", "uid", spec, replicas=replicas, draining=draining)


def ticks(cluster, scaler, status, n):
    changes = []
    for _ in range(n):
        cluster.now += 1
        pools = {p: status.get(p, {}).get("desiredReplicas", 1) for p in render.POOLS}
        draining = frozenset(p for p in render.POOLS if status.get(p, {}).get("draining"))
        scaled, changed = scaler.tick(instance(0, pools, draining), status)
        status.update(with_autoscaler(status, scaled))
        changes += changed
    return changes


def test_scaling_a_pool_to_zero_still_finishes_its_drain():
    cluster = Cluster()
    cluster.ready = {"svc-prefill-0": True, "svc-decode-0": True}
    scaler = Scaler(cluster.list_pods, lambda: cluster.now)
    scaler.scraper = cluster
    status: dict = {}
    changes = ticks(cluster, scaler, status, 6)
    assert [(c.pool, c.reason) for c in changes] == [("decode", "ScalingDown"), ("decode", "ScaledDown")]
    assert status["decode"]["desiredReplicas"] == 0 and status["decode"]["draining"] is None
    assert "svc-decode-0 drained" in changes[1].message
    assert status["prefill"]["desiredReplicas"] == 1  # prefill's minReplicas is 1
    (health,) = [c for c in status["conditions"] if c["type"] == "AutoscalerHealthy"]
    assert (health["status"], health["reason"]) == ("True", "MetricsFresh")
    assert health["message"] == "prefill: 1 server(s) read; decode: 0 server(s) read"


def test_a_draining_pod_that_is_not_ready_goes_at_once_and_a_busy_one_waits():
    cluster = Cluster()
    cluster.ready = {"svc-prefill-0": True, "svc-decode-0": True, "svc-decode-1": False}
    scaler = Scaler(cluster.list_pods, lambda: cluster.now)
    scaler.scraper = cluster
    status = {"decode": {"desiredReplicas": 1, "draining": {"pod": "svc-decode-1", "since": "1970-01-01T00:00:00Z"}}}
    changes = ticks(cluster, scaler, status, 1)
    assert changes[0].reason == "ScaledDown" and "was not ready" in changes[0].message

    cluster.ready["svc-decode-1"] = True
    cluster.signals["svc-decode-1"] = {"running": 3}
    status["decode"]["draining"] = {"pod": "svc-decode-1", "since": "1970-01-01T00:00:00Z"}
    assert [c for c in ticks(cluster, scaler, status, 5) if c.pool == "decode" and c.reason == "ScaledDown"] == []
    cluster.signals["svc-decode-1"] = {}
    assert [c.reason for c in ticks(cluster, scaler, status, 1) if c.pool == "decode"] == ["ScaledDown"]
