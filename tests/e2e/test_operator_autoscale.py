"""The autoscaler under kopf against KMock: real /metrics servers on 127.0.0.1 stand in for the
pods' servers; the test plays the StatefulSet controller (creates and deletes pods). The operator
scales prefill up on a queue burst, drains and then scales it down, and leaves decode alone."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import kmock
import pytest
from prometheus_client import REGISTRY

from tandem.server.edge.metrics import Metrics
from tandem.server.loop.stats import EngineSnapshot
from tandem.tools.stack import free_port
from support.kube_emulator import (CM, ISVC, NS, STS, URL, cluster, condition, eventually, events,  # noqa: F401
                                 example)

POD = kmock.resource("v1/pods")
FAST = {"stableWindowSeconds": 3, "panicWindowSeconds": 2, "scaleDownWindowSeconds": 4, "drainTimeoutSeconds": 60}


class FakeServer:
    """A pod's /metrics: tandem's real registry over a snapshot the test sets."""

    def __init__(self, role: str):
        self.snapshot = EngineSnapshot(kv_pages_total=1000)
        self.metrics = Metrics(role, "smollm2")
        self.metrics.bind(lambda: self.snapshot)
        self.port = free_port()
        self.http, self.thread = self.metrics.serve("127.0.0.1", self.port)

    def set(self, **values) -> None:
        self.snapshot = replace(self.snapshot, **values)

    def stop(self) -> None:
        self.http.shutdown()
        self.http.server_close()


class Pods:
    """The StatefulSet controller: a ready pod (with its FakeServer) per ordinal below replicas."""

    def __init__(self, k8s):
        self.k8s, self.servers = k8s, {}

    async def sync(self, statefulset: str, role: str) -> None:
        replicas = self.k8s.objects[STS, NS, statefulset]["spec"]["replicas"]
        for i in range(replicas):
            name = f"{statefulset}-{i}"
            if name not in self.servers:
                server = self.servers[name] = FakeServer(role)
                pod = {"apiVersion": "v1", "kind": "Pod",
                       "metadata": {"name": name, "namespace": NS, "labels": {
                           "app.kubernetes.io/instance": "smollm2", "app.kubernetes.io/component": role}},
                       "spec": {"containers": [{"name": "server", "ports": [
                           {"name": "metrics", "containerPort": server.port}]}]},
                       "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}
                resp = await self.k8s.post(f"/api/v1/namespaces/{NS}/pods", json=pod)
                assert resp.status == 200, await resp.text()
        for name in [n for n in self.servers if n.startswith(statefulset + "-") and int(n.rsplit("-", 1)[1]) >= replicas]:
            self.servers.pop(name).stop()
            await self.k8s.delete(f"/api/v1/namespaces/{NS}/pods/{name}")

    def close(self) -> None:
        for server in self.servers.values():
            server.stop()


def replicas(k8s, pool: str) -> int:
    return k8s.objects[STS, NS, f"smollm2-{pool}"]["spec"]["replicas"]


def routed(k8s) -> list[str]:
    return [w["id"] for w in json.loads(k8s.objects[CM, NS, "smollm2-router-workers"]["data"]["workers.json"])["workers"]]


def decisions(pool: str, direction: str) -> float:
    return REGISTRY.get_sample_value("tandem_autoscaler_decisions_total",
                                     {"namespace": NS, "service": "smollm2", "pool": pool, "direction": direction}) or 0.0


@pytest.mark.asyncio
async def test_scale_up_on_a_burst_then_drain_and_scale_down(cluster):
    k8s = cluster
    body = example("minimal")
    body["spec"]["prefill"] = {"replicas": 1, "minReplicas": 1, "maxReplicas": 3}
    body["spec"]["decode"] = {"replicas": 1, "minReplicas": 1, "maxReplicas": 2}
    body["spec"]["autoscaling"] = {"enabled": True, "intervalSeconds": 1, "routerSettleSeconds": 1,
                                   "prefill": FAST, "decode": FAST}
    resp = await k8s.post(URL, json=body)
    assert resp.status == 200, await resp.text()
    isvc = lambda: k8s.objects[ISVC, NS, "smollm2"]  # noqa: E731
    await eventually(lambda: (STS, NS, "smollm2-decode") in k8s.objects, what="StatefulSets")
    pods = Pods(k8s)
    try:
        await pods.sync("smollm2-prefill", "prefill")
        await pods.sync("smollm2-decode", "decode")
        decode = pods.servers["smollm2-decode-0"]
        decode.set(kv_pages_used=300, running=4)  # 0.3 of KV: under decode's target, no change
        await eventually(lambda: condition(isvc(), "AutoscalerHealthy").get("status") == "True",
                         what="first sample")
        signals = isvc()["status"]["prefill"]["signals"]
        assert signals["servers"] == 1 and signals["values"]["waiting"] == 0

        # A burst: 12 waiting on one prefill server (4 per server) is 3 servers' worth, ≥ 2× now: panic, 1→2.
        pods.servers["smollm2-prefill-0"].set(waiting=12, queued_prompt_tokens=24000)
        await eventually(lambda: replicas(k8s, "prefill") == 2, what="prefill scale-up")
        last = await eventually(lambda: isvc()["status"]["prefill"].get("lastScaling"), what="status")
        assert (last["fromReplicas"], last["toReplicas"]) == (1, 2)
        assert last["reason"].startswith("prefill scale up 1→2: ") and last["reason"].endswith("(waiting 12 over target 4)")
        assert routed(k8s) == ["smollm2-prefill-0", "smollm2-prefill-1", "smollm2-decode-0"]
        await eventually(lambda: events(k8s, "ScaledUp"), what="ScaledUp event")
        assert decisions("prefill", "up") == 1
        await pods.sync("smollm2-prefill", "prefill")

        # The burst is served; the new server still finishes two requests when the load falls.
        pods.servers["smollm2-prefill-1"].set(running=2)
        pods.servers["smollm2-prefill-0"].set(waiting=0, queued_prompt_tokens=0)
        await eventually(lambda: (isvc()["status"]["prefill"].get("draining") or {}).get("pod") == "smollm2-prefill-1",
                         timeout=30, what="drain of the highest ordinal")
        assert routed(k8s) == ["smollm2-prefill-0", "smollm2-decode-0"]  # out of the router's list at once
        assert events(k8s, "ScalingDown")
        await asyncio.sleep(3)  # three more ticks: the pod still has requests, so it stays
        assert replicas(k8s, "prefill") == 2 and isvc()["status"]["prefill"]["draining"]

        pods.servers["smollm2-prefill-1"].set(running=0)
        await eventually(lambda: replicas(k8s, "prefill") == 1, what="prefill scale-down after the drain")
        await eventually(lambda: isvc()["status"]["prefill"].get("draining") is None, what="drain cleared")
        last = isvc()["status"]["prefill"]["lastScaling"]
        assert (last["fromReplicas"], last["toReplicas"]) == (2, 1) and "scale down 2→1" in last["reason"]
        done = await eventually(lambda: events(k8s, "ScaledDown"), what="ScaledDown event")
        assert "smollm2-prefill-1 drained" in done[0]["message"]
        assert decisions("prefill", "down") == 1
        await pods.sync("smollm2-prefill", "prefill")

        # Decode was never touched: the pools move independently.
        assert replicas(k8s, "decode") == 1 and isvc()["status"]["decode"].get("lastScaling") is None
        assert decisions("decode", "up") == decisions("decode", "down") == 0

        # The decode server stops answering: stale metrics, AutoscalerHealthy False.
        decode.stop()
        pods.servers.pop("smollm2-decode-0")
        await eventually(lambda: condition(isvc(), "AutoscalerHealthy").get("status") == "False",
                         timeout=10, what="stale metrics")
        assert "decode: metrics stale" in condition(isvc(), "AutoscalerHealthy")["message"]
        assert REGISTRY.get_sample_value("tandem_autoscaler_healthy",
                                         {"namespace": NS, "service": "smollm2", "pool": "decode"}) == 0
    finally:
        pods.close()
