"""NetworkPolicy semantics (networking.k8s.io/v1) as a pure function: may endpoint A open a
connection to endpoint B on a port, under a set of policies?

The rules evaluated, as the Kubernetes API documents them:
- a pod selected by no policy of a direction (`policyTypes` holds Ingress, or Egress) is open in
  that direction; a pod selected by at least one is isolated, and a connection is admitted only
  if some rule of some selecting policy admits it. Both ends must agree: the source's egress and
  the destination's ingress;
- a rule without `from`/`to`, or with an empty one, admits every peer; a rule without `ports`,
  or with an empty list, every port; a port entry without `port` every port of its protocol
  (TCP when unnamed), with `endPort` a range;
- a peer with `podSelector` alone selects pods of the policy's own namespace; with
  `namespaceSelector`, pods in the namespaces it selects (an empty selector selects all); with
  `ipBlock`, addresses in its CIDR but not in `except` (and never by label);
- label selectors: `matchLabels` and `matchExpressions` (In, NotIn, Exists, DoesNotExist).

Endpoints outside the cluster's pods (an API server, the internet) have no namespace and no
labels: only ipBlock peers and peer-less rules reach them. Named ports are refused: the
renderers name port numbers, and a test must not pass by a resolution this module skips.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

NAMESPACE_NAME = "kubernetes.io/metadata.name"


@dataclass(frozen=True)
class Endpoint:
    """A pod (namespace and labels) or, with namespace None, an address outside the pod network."""

    name: str
    namespace: str | None
    labels: dict[str, str] = field(default_factory=dict)
    ip: str = "10.0.0.1"


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """Whether a label selector selects these labels (an empty selector selects everything)."""
    unknown = set(selector) - {"matchLabels", "matchExpressions"}
    assert not unknown, f"not a label selector field: {unknown}"
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {"In": lambda: labels.get(key) in values, "NotIn": lambda: key not in labels or labels[key] not in values,
              "Exists": lambda: key in labels, "DoesNotExist": lambda: key not in labels}[op]()
        if not ok:
            return False
    return True


def _peer_admits(peer: dict, policy_namespace: str, other: Endpoint, namespace_labels: dict[str, dict]) -> bool:
    if "ipBlock" in peer:
        assert set(peer) == {"ipBlock"}, f"an ipBlock peer takes no selector: {peer}"
        address = ipaddress.ip_address(other.ip)
        block = peer["ipBlock"]
        return (address in ipaddress.ip_network(block["cidr"])
                and not any(address in ipaddress.ip_network(e) for e in block.get("except", [])))
    assert peer and set(peer) <= {"podSelector", "namespaceSelector"}, f"not a peer: {peer}"
    if other.namespace is None:
        return False  # selectors select pods only
    if "namespaceSelector" in peer:
        in_namespace = selects(peer["namespaceSelector"], namespace_labels[other.namespace])
    else:
        in_namespace = other.namespace == policy_namespace
    return in_namespace and selects(peer.get("podSelector", {}), other.labels)


def _port_admits(ports: list[dict] | None, port: int, protocol: str) -> bool:
    if not ports:
        return True
    for entry in ports:
        if entry.get("protocol", "TCP") != protocol:
            continue
        if "port" not in entry:
            return True
        assert isinstance(entry["port"], int), f"named ports are not evaluated: {entry}"
        if entry["port"] <= port <= entry.get("endPort", entry["port"]):
            return True
    return False


def _direction_admits(policies: list[dict], me: Endpoint, other: Endpoint, port: int, protocol: str,
                      direction: str, namespace_labels: dict[str, dict]) -> bool:
    """Whether `me`'s policies of one direction admit the connection with `other` (ingress: from
    `other` to `me`; egress: from `me` to `other`, on `port` of `other`)."""
    if me.namespace is None:
        return True  # outside the pod network: no policy applies
    rules_key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    selecting = [p for p in policies if p["metadata"]["namespace"] == me.namespace
                 and direction in policy_types(p) and selects(p["spec"]["podSelector"], me.labels)]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get(rules_key, []):
            peers = rule.get(peers_key)
            if _port_admits(rule.get("ports"), port, protocol) and (
                    not peers or any(_peer_admits(peer, me.namespace, other, namespace_labels) for peer in peers)):
                return True
    return False


def policy_types(policy: dict) -> list[str]:
    """`policyTypes`, or what the API server defaults it to: Ingress, plus Egress with egress rules."""
    spec = policy["spec"]
    return spec.get("policyTypes") or ["Ingress", *(["Egress"] if spec.get("egress") else [])]


def allowed(policies: list[dict], source: Endpoint, destination: Endpoint, port: int, protocol: str = "TCP",
            namespace_labels: dict[str, dict] | None = None) -> bool:
    """Whether `source` may connect to `destination` on `port`. `namespace_labels`: each
    namespace's labels (default: just the kubernetes.io/metadata.name label every namespace has)."""
    namespaces = {e.namespace for e in (source, destination) if e.namespace is not None}
    labels = {ns: {NAMESPACE_NAME: ns} for ns in namespaces} | (namespace_labels or {})
    for policy in policies:
        assert policy["kind"] == "NetworkPolicy" and policy["apiVersion"] == "networking.k8s.io/v1", policy["kind"]
    return (_direction_admits(policies, source, destination, port, protocol, "Egress", labels)
            and _direction_admits(policies, destination, source, port, protocol, "Ingress", labels))
