"""The operator under kopf against KMock, kopf's author's Kubernetes API test server.

KMock 0.8 stores what it is sent and streams watch events, but leaves to the test side what a
real API server adds, and this module adds it: uids and resourceVersions on stored objects, a 422
for a failed json-patch `test`, names for `generateName` objects, and an atomic
snapshot+subscribe for watches. The operator runs in its own thread and event loop;
KMock serves on the test's loop. Nothing here fakes the Kubernetes API: every request the
operator makes goes over HTTP to KMock, which stores objects and streams watch events.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import logging
import threading
import uuid
from pathlib import Path

import kmock
import kopf
import kubernetes
import pytest_asyncio
import yaml

import tandem.operator.handlers  # noqa: F401  registers the handlers in kopf's default registry

ISVC = kmock.resource("tandem.dev/v1alpha1/inferenceservices")
STS = kmock.resource("apps/v1/statefulsets")
DEPLOY = kmock.resource("apps/v1/deployments")
SVC = kmock.resource("v1/services")
CM = kmock.resource("v1/configmaps")
PDB = kmock.resource("policy/v1/poddisruptionbudgets")
SMON = kmock.resource("monitoring.coreos.com/v1/servicemonitors")
EVENT = kmock.resource("v1/events")


class StampingEmulator(kmock.KubernetesEmulator):
    """KMock plus the object metadata a real API server assigns (edits requests in place:
    replacing the request object breaks KMock's reaction matching)."""

    _rv = itertools.count(1)

    async def _handle(self, request):
        if request.resource is not None and isinstance(request.data, (dict, list)):
            if request.action == kmock.action.CREATE:
                meta = request.data.setdefault("metadata", {})
                if "name" not in meta and "generateName" in meta:
                    meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("creationTimestamp",
                                datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
                meta.setdefault("generation", 1)
                meta["resourceVersion"] = str(next(self._rv))
            elif request.action == kmock.action.UPDATE and request.name:
                key = (request.resource, request.namespace, request.name)
                current = self.objects[key] if key in self.objects else None
                live_rv = None if current is None or current.deleted else current.get("metadata", {}).get(
                    "resourceVersion")
                rv = str(next(self._rv))
                if isinstance(request.data, list):  # json-patch (kopf's finalizers): honour `test`
                    for op in request.data:
                        if op.get("op") == "test" and op.get("path") == "/metadata/resourceVersion" \
                                and op.get("value") != live_rv:
                            raise kmock.KubernetesError(status=422, reason="Invalid",
                                                        message="resourceVersion test failed")
                    request.data.append({"op": "add", "path": "/metadata/resourceVersion", "value": rv})
                else:
                    request.data.setdefault("metadata", {})["resourceVersion"] = rv
                    if "spec" in request.data and request.subresource is None and current is not None:
                        gen = current.get("metadata", {}).get("generation", 1)
                        request.data["metadata"]["generation"] = gen + 1
        return await super()._handle(request)

    async def _serve_watch(self, request):
        """KMock 0.8 snapshots, then subscribes: a change in between would be lost for good."""
        yield b""
        bus = self._buses[request.resource]
        async with self._lock:  # every mutation publishes its event under this lock
            marker = await bus.mark()
            objs = self._KubernetesEmulator__get_objs(request, strict=False)
            events = [{"type": "ADDED", "object": o.raw} for o in objs if not o.deleted]
        try:
            for event in events:
                yield event
            async for event in bus.stream(since=marker):
                meta = event.get("object", {}).get("metadata", {})
                if self._KubernetesEmulator__check(request, request.resource, meta.get("namespace"),
                                                   meta.get("name"), strict=False):
                    yield event
        finally:
            await bus.unmark(marker)


def declare_resources(emulator: kmock.KubernetesEmulator, *, monitoring: bool) -> None:
    emulator.resources.load_bundled()  # v1/namespaces, CRDs, apps/v1, ...: kopf waits for them
    emulator.resources["tandem.dev/v1alpha1/inferenceservices"] = kmock.ResourceInfo(
        kind="InferenceService", singular="inferenceservice", namespaced=True, shortnames={"tisvc"},
        subresources={"status"}, verbs={"list", "watch", "get", "patch", "create", "delete"})
    if monitoring:  # as if the Prometheus Operator's CRDs were installed
        for kind in ("ServiceMonitor", "PodMonitor"):
            emulator.resources[f"monitoring.coreos.com/v1/{kind.lower()}s"] = kmock.ResourceInfo(
                kind=kind, singular=kind.lower(), namespaced=True,
                verbs={"list", "watch", "get", "patch", "create", "delete"})


def write_kubeconfig(path: Path, server_url: str) -> None:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": server_url.rstrip("/")}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
        "users": [{"name": "kmock", "user": {"token": "test"}}],
    }))


class OperatorThread:
    """`kopf.operator()` with tandem's handlers in its own thread and loop (a same-loop operator
    cancels every task created after it, pytest-asyncio's included, when it stops)."""

    def __init__(self):
        settings = kopf.OperatorSettings()
        settings.peering.standalone = True
        settings.networking.request_timeout = 10
        settings.queueing.idle_timeout = 0.1
        self.stop, self.ready = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=asyncio.run, name="kopf", daemon=True, args=(kopf.operator(
            clusterwide=True,  # namespaces=[...] makes kopf LIST /api/v1/namespaces, which KMock 0.8 fails
            settings=settings, stop_flag=self.stop, ready_flag=self.ready),))

    async def start(self, emulator, *plurals: str) -> None:
        self.thread.start()
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, self.ready.wait, 15), "kopf did not start"

        def watched():  # ready_flag comes before discovery: wait for the watch requests
            return {r.resource.plural for r in list(emulator) if r.action == kmock.action.WATCH and r.resource}

        await eventually(lambda: set(plurals) <= watched(), what=f"kopf watching {plurals}")

    async def close(self) -> None:
        self.stop.set()
        await asyncio.get_running_loop().run_in_executor(None, self.thread.join, 20)
        assert not self.thread.is_alive(), "kopf did not stop"


async def eventually(predicate, timeout: float = 15.0, what: str = "condition"):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (result := predicate()):
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)
    return result


def alive(emulator, key) -> dict | None:
    """The stored object, or None when absent or deleted."""
    if key in emulator.objects and not emulator.objects[key].deleted:
        return emulator.objects[key]
    return None


def quiet_kopf_logs() -> None:
    logging.getLogger("kopf").setLevel(logging.WARNING)


# ------------------------------------------------------------------------------ the operator's cluster

REPO = Path(__file__).resolve().parents[2]
NS = "default"
URL = f"/apis/tandem.dev/v1alpha1/namespaces/{NS}/inferenceservices"
MERGE = {"Content-Type": "application/merge-patch+json"}
_server = {}


@kopf.on.login()
def _login_to_kmock(**_):
    """Tests only: connect kopf to this test's KMock server."""
    return kopf.ConnectionInfo(server=_server["url"], token="test", insecure=True)


@pytest_asyncio.fixture()
async def cluster(monkeypatch):
    """KMock with the built-in resources, the CRD's resource and the monitoring CRDs, and the
    operator running against it."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # never a real cluster
    quiet_kopf_logs()
    async with StampingEmulator() as emulator, kmock.Server(emulator) as server:
        declare_resources(emulator, monitoring=True)
        _server["url"] = str(server.url).rstrip("/")
        config = kubernetes.client.Configuration()
        config.host = _server["url"]
        config.api_key = {"BearerToken": "test"}
        config.api_key_prefix = {"BearerToken": "Bearer"}
        kubernetes.client.Configuration.set_default(config)
        operator = OperatorThread()
        await operator.start(emulator, "inferenceservices", "statefulsets", "deployments", "services")
        try:
            yield emulator
        finally:
            await operator.close()


def example(name: str) -> dict:
    body = yaml.safe_load((REPO / "examples" / f"{name}.yaml").read_text())
    body["metadata"]["namespace"] = NS
    return body


def owned_by(emulator, uid: str) -> dict:
    """(resource plural, name) -> object, for every live object controlled by `uid`."""
    return {(key[0].plural, key[2]): obj for key, obj in emulator.objects.items()
            if not obj.deleted and any(r.get("uid") == uid for r in obj.get("metadata", {}).get("ownerReferences", []))}


def events(emulator, reason: str) -> list[dict]:
    return [o for (r, _, _), o in emulator.objects.items() if r == EVENT and not o.deleted and o.get("reason") == reason]


def condition(obj, type_: str) -> dict:
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == type_), {})


async def mark_ready(emulator, resource, name: str, replicas: int) -> None:
    """Be the StatefulSet/Deployment controller: report every pod ready and updated."""
    obj = emulator.objects[resource, NS, name]
    status = {"replicas": replicas, "readyReplicas": replicas, "updatedReplicas": replicas,
              "observedGeneration": obj["metadata"]["generation"]}
    plural_path = f"/apis/apps/v1/namespaces/{NS}/{resource.plural}/{name}"
    resp = await emulator.patch(plural_path, json={"status": status}, headers=MERGE)
    assert resp.status == 200, await resp.text()
