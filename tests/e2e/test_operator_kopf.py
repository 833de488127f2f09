"""The operator under kopf against a Kubernetes API test server (KMock): create, update, drift,
invalid spec, delete. Assertions read what KMock stored and the requests the operator made."""

from __future__ import annotations

import copy
import json

import kmock
import pytest

from support.kube_emulator import (CM, DEPLOY, ISVC, MERGE, NS, PDB, SMON, STS, SVC, URL, alive, cluster,  # noqa: F401
                                 condition, eventually, events, example, mark_ready, owned_by)

def container_args(emulator, statefulset: str) -> list[str]:
    return emulator.objects[STS, NS, statefulset]["spec"]["template"]["spec"]["containers"][0]["args"]


EXPECTED = {("statefulsets", "smollm2-prefill"), ("statefulsets", "smollm2-decode"),
            ("services", "smollm2-prefill"), ("services", "smollm2-decode"), ("services", "smollm2-router"),
            ("services", "smollm2-router-metrics"),
            ("configmaps", "smollm2-router-workers"), ("deployments", "smollm2-router"),
            ("poddisruptionbudgets", "smollm2-prefill"), ("poddisruptionbudgets", "smollm2-decode"),
            ("poddisruptionbudgets", "smollm2-router"),
            ("networkpolicies", "smollm2-prefill"), ("networkpolicies", "smollm2-decode"),
            ("networkpolicies", "smollm2-router"), ("secrets", "smollm2-bootstrap-token")}


@pytest.mark.asyncio
async def test_create_ready_update_drift_delete(cluster):
    k8s = cluster
    resp = await k8s.post(URL, json=example("minimal"))
    assert resp.status == 200, await resp.text()
    uid = k8s.objects[ISVC, NS, "smollm2"]["metadata"]["uid"]

    # Create: every object, owned by the InferenceService; status Progressing until pods are ready.
    await eventually(lambda: set(owned_by(k8s, uid)) == EXPECTED, what="all owned objects")
    prefill = k8s.objects[STS, NS, "smollm2-prefill"]
    assert prefill["spec"]["template"]["spec"]["containers"][0]["args"][:3] == ["serve", "--role", "prefill"]
    workers = json.loads(k8s.objects[CM, NS, "smollm2-router-workers"]["data"]["workers.json"])["workers"]
    assert [w["id"] for w in workers] == ["smollm2-prefill-0", "smollm2-decode-0"]
    await eventually(lambda: k8s.objects[ISVC, NS, "smollm2"].get("status", {}).get("phase") == "Progressing")
    await eventually(lambda: events(k8s, "Applied"), what="Applied event")

    # The pods turn ready (the test plays the StatefulSet and Deployment controllers).
    await mark_ready(k8s, STS, "smollm2-prefill", 1)
    await mark_ready(k8s, STS, "smollm2-decode", 1)
    await mark_ready(k8s, DEPLOY, "smollm2-router", 1)
    await eventually(lambda: condition(k8s.objects[ISVC, NS, "smollm2"], "Ready").get("status") == "True",
                     what="Ready condition")
    status = k8s.objects[ISVC, NS, "smollm2"]["status"]
    assert status["phase"] == "Ready" and status["prefill"]["ready"] == "1/1" and status["decode"]["ready"] == "1/1"
    assert status["router"]["endpoint"] == "http://smollm2-router.default.svc.cluster.local:8000"
    assert status["observedGeneration"] == 1

    # Update: replicas, image and engine args reach the StatefulSets and the router's worker list.
    patch = {"spec": {"image": "registry.local/tandem-server:2", "prefill": {"replicas": 2, "maxReplicas": 4},
                      "decode": {"engineArgs": ["--max-running-requests", "32"]}}}
    resp = await k8s.patch(f"{URL}/smollm2", json=patch, headers=MERGE)
    assert resp.status == 200, await resp.text()

    def updated():
        p, d = k8s.objects[STS, NS, "smollm2-prefill"], k8s.objects[STS, NS, "smollm2-decode"]
        return (p["spec"]["replicas"] == 2
                and p["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.local/tandem-server:2"
                and d["spec"]["template"]["spec"]["containers"][0]["args"][-2:] == ["--max-running-requests", "32"])

    await eventually(updated, what="StatefulSets updated")

    def worker_ids():
        manifest = json.loads(k8s.objects[CM, NS, "smollm2-router-workers"]["data"]["workers.json"])
        return [w["id"] for w in manifest["workers"]]

    await eventually(lambda: worker_ids() == ["smollm2-prefill-0", "smollm2-prefill-1", "smollm2-decode-0"],
                     what="the router's worker manifest lists the new prefill pod")
    await eventually(lambda: k8s.objects[ISVC, NS, "smollm2"]["status"]["observedGeneration"] == 2,
                     what="status describes the new spec")
    assert k8s.objects[ISVC, NS, "smollm2"]["status"]["prefill"]["ready"] == "1/2"

    # A setting the spec drops is dropped from the object: the operator sends a server-side apply
    # of the new render (on a real API server that removes fields; KMock merges).
    resp = await k8s.patch(f"{URL}/smollm2", json={"spec": {"decode": {"engineArgs": None}}}, headers=MERGE)
    assert resp.status == 200, await resp.text()

    def applied_without_args():
        return [r for r in list(k8s) if r.action == kmock.action.UPDATE and r.resource == STS
                and r.name == "smollm2-decode" and "apply-patch" in r.headers.get("Content-Type", "")
                and r.params.get("fieldManager") == "tandem-operator"
                and "--max-running-requests" not in json.dumps(r.data)]

    await eventually(applied_without_args, what="a server-side apply without the dropped engine args")
    await eventually(lambda: "--max-running-requests" not in container_args(k8s, "smollm2-decode"),
                     what="the stored StatefulSet without the dropped args")

    # Drift: a deleted StatefulSet comes back; an edited Service port is put back.
    resp = await k8s.delete(f"/apis/apps/v1/namespaces/{NS}/statefulsets/smollm2-decode")
    assert resp.status == 200
    await eventually(lambda: k8s.objects[STS, NS, "smollm2-decode"].deleted, what="deletion seen")
    await eventually(lambda: alive(k8s, (STS, NS, "smollm2-decode")), what="StatefulSet recreated")
    resp = await k8s.patch(f"/api/v1/namespaces/{NS}/services/smollm2-router",
                           json={"spec": {"type": "NodePort"}}, headers=MERGE)
    assert resp.status == 200
    await eventually(lambda: k8s.objects[SVC, NS, "smollm2-router"]["spec"]["type"] == "ClusterIP",
                     what="Service edit undone")
    await eventually(lambda: len(events(k8s, "DriftCorrected")) >= 2, what="DriftCorrected events")

    # Turning on a ServiceMonitor and off the router's PDB adds and prunes objects.
    patch = {"spec": {"monitoring": {"serviceMonitor": True}, "router": {"podDisruptionBudget": {"enabled": False}}}}
    resp = await k8s.patch(f"{URL}/smollm2", json=patch, headers=MERGE)
    assert resp.status == 200
    await eventually(lambda: alive(k8s, (SMON, NS, "smollm2")) and not alive(k8s, (PDB, NS, "smollm2-router")),
                     what="monitor added, router PDB pruned")

    # Delete: nothing owned is left, and the finalizer lets the InferenceService go.
    resp = await k8s.delete(f"{URL}/smollm2")
    assert resp.status == 200
    await eventually(lambda: not alive(k8s, (ISVC, NS, "smollm2")), what="InferenceService gone")
    assert owned_by(k8s, uid) == {}
    kinds = {STS, DEPLOY, SVC, CM, PDB, SMON}
    assert not [key for key, obj in k8s.objects.items() if key[0] in kinds and not obj.deleted]


@pytest.mark.asyncio
async def test_invalid_spec_is_reported_and_nothing_is_applied(cluster):
    k8s = cluster
    body = example("minimal")
    body["spec"]["decode"] = {"replicas": 1, "minReplicas": 3, "maxReplicas": 2}
    resp = await k8s.post(URL, json=body)
    assert resp.status == 200, await resp.text()

    def failed():
        return k8s.objects[ISVC, NS, "smollm2"].get("status", {}).get("phase") == "Failed"

    await eventually(failed, what="phase Failed")
    degraded = condition(k8s.objects[ISVC, NS, "smollm2"], "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "InvalidSpec"
    assert "spec.decode.minReplicas" in degraded["message"] and "maxReplicas 2" in degraded["message"]
    warning = await eventually(lambda: events(k8s, "InvalidSpec"), what="InvalidSpec event")
    assert warning[0]["type"] == "Warning" and "spec.decode.minReplicas" in warning[0]["message"]
    writes = [r for r in list(k8s) if r.action in (kmock.action.CREATE, kmock.action.UPDATE)
              and r.resource in (STS, DEPLOY, SVC, CM, PDB)]
    assert writes == [], "an invalid spec must not be half-applied"

    # Fixing the spec applies it.
    fixed = copy.deepcopy(body["spec"]["decode"])
    fixed["minReplicas"] = 1
    resp = await k8s.patch(f"{URL}/smollm2", json={"spec": {"decode": fixed}}, headers=MERGE)
    assert resp.status == 200
    await eventually(lambda: alive(k8s, (STS, NS, "smollm2-decode")), what="applied after the fix")
    await eventually(lambda: condition(k8s.objects[ISVC, NS, "smollm2"], "Degraded").get("status") == "False",
                     what="Degraded cleared")


@pytest.mark.asyncio
async def test_an_object_the_api_server_rejects_fails_the_service(cluster):
    k8s = cluster
    ns = "strict"
    rejection = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Invalid", "code": 422,
                 "message": 'StatefulSet.apps "smollm2-prefill" is invalid: spec.template.spec.affinity: Invalid value'}
    k8s[f"post /apis/apps/v1/namespaces/{ns}/statefulsets"] << 422 << rejection
    body = example("minimal")
    body["metadata"]["namespace"] = ns
    resp = await k8s.post(f"/apis/tandem.dev/v1alpha1/namespaces/{ns}/inferenceservices", json=body)
    assert resp.status == 200, await resp.text()

    def failed():
        return k8s.objects[ISVC, ns, "smollm2"].get("status", {}).get("phase") == "Failed"

    await eventually(failed, what="phase Failed")
    degraded = condition(k8s.objects[ISVC, ns, "smollm2"], "Degraded")
    assert degraded["status"] == "True" and "rejected StatefulSet/smollm2-prefill" in degraded["message"]
    assert "spec.template.spec.affinity" in degraded["message"]
    await eventually(lambda: events(k8s, "InvalidSpec"), what="InvalidSpec event")
