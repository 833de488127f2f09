"""The operator's few Kubernetes API calls, for any kind it renders, over the `kubernetes` client.

Objects are applied as whole documents: created when absent, left alone when every field the
operator renders already has the rendered value (the API server adds defaults and status, which
are not drift), otherwise patched with a server-side apply of the full rendered object (field
manager `tandem-operator`), which also removes fields a newer render no longer sets.
"""

from __future__ import annotations

import json
from urllib.parse import quote, urlencode

import kubernetes

FIELD_MANAGER = "tandem-operator"

# apiVersion, kind -> URL plural. Only these kinds are ever written.
PLURALS = {
    ("v1", "Service"): "services",
    ("v1", "ConfigMap"): "configmaps",
    ("apps/v1", "StatefulSet"): "statefulsets",
    ("apps/v1", "Deployment"): "deployments",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitors",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitors",
}
ApiException = kubernetes.client.ApiException


def collection_path(api_version: str, plural: str, namespace: str) -> str:
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{prefix}/namespaces/{quote(namespace)}/{plural}"


def object_path(api_version: str, kind: str, namespace: str, name: str) -> str:
    return f"{collection_path(api_version, PLURALS[api_version, kind], namespace)}/{quote(name)}"


def is_subset(desired, live) -> bool:
    """True when every value in `desired` is present in `live` (lists element by element)."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(k in live and is_subset(v, live[k]) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(live, list) and len(desired) == len(live) and all(map(is_subset, desired, live))
    return desired == live or (isinstance(live, (int, float)) and str(desired) == str(live))


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

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        try:
            return self.request("GET", object_path(api_version, kind, namespace, name))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def apply(self, obj: dict) -> str:
        """Make the live object match `obj`: 'created', 'patched', 'unchanged', or 'terminating'
        when the old object is still being deleted (apply again later)."""
        api_version, kind = obj["apiVersion"], obj["kind"]
        meta = obj["metadata"]
        live = self.get(api_version, kind, meta["namespace"], meta["name"])
        if live is None:
            self.request("POST", collection_path(api_version, PLURALS[api_version, kind], meta["namespace"]), obj)
            return "created"
        if live.get("metadata", {}).get("deletionTimestamp"):
            return "terminating"
        if is_subset(obj, live):
            return "unchanged"
        self.request("PATCH", object_path(api_version, kind, meta["namespace"], meta["name"]), obj,
                     content_type="application/apply-patch+yaml", query={"fieldManager": FIELD_MANAGER, "force": "true"})
        return "patched"

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

    # ----------------------------------------------------------------------------------- discovery

    def serves(self, api_version: str, kind: str) -> bool:
        """Whether the cluster serves `kind` (e.g. the Prometheus Operator's ServiceMonitor)."""
        try:
            resources = self.request("GET", f"/apis/{api_version}").get("resources", [])
        except ApiException as e:
            if e.status == 404:
                return False
            raise
        return any(r.get("kind") == kind for r in resources)

    # ----------------------------------------------------------------------------------- custom resource

    def get_custom(self, group: str, version: str, plural: str, namespace: str, name: str) -> dict | None:
        try:
            return self.request("GET", f"/apis/{group}/{version}/namespaces/{quote(namespace)}/{plural}/{quote(name)}")
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def patch_status(self, group: str, version: str, plural: str, namespace: str, name: str, status: dict) -> None:
        """Merge-patch the status subresource (lists such as conditions are replaced whole)."""
        self.request("PATCH", f"/apis/{group}/{version}/namespaces/{quote(namespace)}/{plural}/{quote(name)}/status",
                     {"status": status}, content_type="application/merge-patch+json")
