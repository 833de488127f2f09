"""The operator's few Kubernetes API calls, for any kind it renders, over the `kubernetes` client.

Objects are applied as whole documents with server-side apply (field manager `tandem-operator`,
which then owns every field it renders, so a field a newer render drops is removed). The apply is
skipped when nothing changed: the live object carries the hash of the render it was applied from,
and every rendered value is still there (the API server's defaults, canonical quantities and
status are not drift; another writer's edit of a rendered field is).
"""

from __future__ import annotations

import hashlib
import json
from urllib.parse import quote, urlencode

import kubernetes
from kubernetes.utils import parse_quantity

FIELD_MANAGER = "tandem-operator"
RENDER_HASH = "tandem.dev/render-hash"

# apiVersion, kind -> URL plural. Only these kinds are ever written.
PLURALS = {
    ("v1", "Service"): "services",
    ("v1", "ConfigMap"): "configmaps",
    ("apps/v1", "StatefulSet"): "statefulsets",
    ("apps/v1", "Deployment"): "deployments",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitors",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitors",
}
ApiException = kubernetes.client.ApiException


def collection_path(api_version: str, plural: str, namespace: str) -> str:
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{prefix}/namespaces/{quote(namespace)}/{plural}"


# Kinds the operator creates once and never applies again (not in PLURALS: no drift correction, no pruning).
CREATED_ONCE = {("v1", "Secret"): "secrets"}


def object_path(api_version: str, kind: str, namespace: str, name: str) -> str:
    plural = PLURALS.get((api_version, kind)) or CREATED_ONCE[api_version, kind]
    return f"{collection_path(api_version, plural, namespace)}/{quote(name)}"


def is_subset(desired, live) -> bool:
    """True when every value in `desired` is present in `live` (lists element by element; a
    quantity matches its canonical form: 1024Mi is 1Gi, 1000m is 1; empty maps and lists match
    absent ones, which the API server drops)."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(
            is_subset(v, live[k]) if k in live else v in ({}, []) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(live, list) and len(desired) == len(live) and all(map(is_subset, desired, live))
    if desired == live or str(desired) == str(live):
        return True
    try:
        return parse_quantity(desired) == parse_quantity(live)
    except (ValueError, TypeError):
        return False


def render_hash(obj: dict) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def with_render_hash(obj: dict) -> dict:
    """`obj` annotated with the hash of itself (without the annotation)."""
    out = json.loads(json.dumps(obj))
    out["metadata"].setdefault("annotations", {})[RENDER_HASH] = render_hash(obj)
    return out


def up_to_date(desired: dict, live: dict) -> bool:
    """Whether `live` was applied from this very render and nobody changed a rendered field since."""
    annotations = live.get("metadata", {}).get("annotations") or {}
    return annotations.get(RENDER_HASH) == render_hash(desired) and is_subset(desired, live)


class Kube:
    """Synchronous client; kopf runs the operator's sync handlers in worker threads."""

    def __init__(self, api: kubernetes.client.ApiClient | None = None):
        self.api = api or kubernetes.client.ApiClient()

    def request(self, method: str, path: str, body=None, content_type: str = "application/json",
                query: dict | None = None):
        """One call; the decoded JSON answer, or ApiException for any non-2xx status."""
        if query:
            path = f"{path}?{urlencode(query)}"
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        params = self.api.param_serialize(method=method, resource_path=path, header_params=headers,
                                          body=body, auth_settings=["BearerToken"])
        response = self.api.call_api(*params, _request_timeout=30)
        response.read()
        if not 200 <= response.status <= 299:
            raise ApiException.from_response(http_resp=response, body=response.data.decode(errors="replace"),
                                             data=None)
        return json.loads(response.data) if response.data else None

    # ----------------------------------------------------------------------------------- objects

    def _get_or_none(self, path: str) -> dict | None:
        try:
            return self.request("GET", path)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        return self._get_or_none(object_path(api_version, kind, namespace, name))

    def apply(self, obj: dict) -> str:
        """Make the live object match `obj`: 'created', 'patched', 'unchanged', or 'terminating'
        when the old object is still being deleted (apply again later)."""
        api_version, kind = obj["apiVersion"], obj["kind"]
        meta = obj["metadata"]
        live = self.get(api_version, kind, meta["namespace"], meta["name"])
        if live is not None and live.get("metadata", {}).get("deletionTimestamp"):
            return "terminating"
        if live is not None and up_to_date(obj, live):
            return "unchanged"
        path = object_path(api_version, kind, meta["namespace"], meta["name"])
        query = {"fieldManager": FIELD_MANAGER, "force": "true"}
        body = with_render_hash(obj)
        try:
            # An apply creates a missing object too; the field manager then owns every field.
            applied = self.request("PATCH", path, body, content_type="application/apply-patch+yaml", query=query)
        except ApiException as e:
            if e.status != 404 or live is not None:
                raise
            # API servers without server-side apply create (KMock, the test API server).
            self.request("POST", collection_path(api_version, PLURALS[api_version, kind], meta["namespace"]), body,
                         query={"fieldManager": FIELD_MANAGER})
            return "created"
        if live is None:
            return "created"
        same = (applied or {}).get("metadata", {}).get("resourceVersion") == live["metadata"].get("resourceVersion")
        return "unchanged" if same else "patched"

    def exists(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """Whether the object exists (its body is not kept: it may be a Secret)."""
        return self._get_or_none(object_path(api_version, kind, namespace, name)) is not None

    def create(self, obj: dict) -> bool:
        """Create `obj` of a CREATED_ONCE kind; False if it exists already (another writer was first)."""
        meta, key = obj["metadata"], (obj["apiVersion"], obj["kind"])
        try:
            self.request("POST", collection_path(obj["apiVersion"], CREATED_ONCE[key], meta["namespace"]), obj,
                         query={"fieldManager": FIELD_MANAGER})
        except ApiException as e:
            if e.status != 409:
                raise
            return False
        return True

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """Delete one object; False if it was already gone."""
        try:
            self.request("DELETE", object_path(api_version, kind, namespace, name),
                         {"propagationPolicy": "Background"})
            return True
        except ApiException as e:
            if e.status == 404:
                return False
            raise

    def list(self, api_version: str, kind: str, namespace: str, label_selector: str) -> list[dict]:
        path = collection_path(api_version, PLURALS[api_version, kind], namespace)
        return self.request("GET", path, query={"labelSelector": label_selector}).get("items", [])

    def list_pods(self, namespace: str, label_selector: str) -> list[dict]:
        """Pods are read, never written (the autoscaler reads readiness and addresses)."""
        return self.request("GET", collection_path("v1", "pods", namespace),
                            query={"labelSelector": label_selector}).get("items", [])

    # ----------------------------------------------------------------------------------- discovery

    def served_kinds(self, api_version: str) -> set[str]:
        """Kinds the cluster serves under `api_version` (empty when the group is not installed)."""
        found = self._get_or_none(f"/apis/{api_version}") or {}
        return {r.get("kind") for r in found.get("resources", [])}

    # ----------------------------------------------------------------------------------- custom resource

    def get_custom(self, group: str, version: str, plural: str, namespace: str, name: str) -> dict | None:
        return self._get_or_none(f"/apis/{group}/{version}/namespaces/{quote(namespace)}/{plural}/{quote(name)}")

    def patch_status(self, group: str, version: str, plural: str, namespace: str, name: str, status: dict) -> None:
        """Merge-patch the status subresource (lists such as conditions are replaced whole)."""
        self.request("PATCH", f"/apis/{group}/{version}/namespaces/{quote(namespace)}/{plural}/{quote(name)}/status",
                     {"status": status}, content_type="application/merge-patch+json")
