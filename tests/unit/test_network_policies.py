"""The NetworkPolicies the operator renders, judged by what they let through: a reachability
matrix over synthetic pods (this InferenceService's, another one's in the same namespace, a
neighbour, Prometheus, the operator, a pod elsewhere) evaluated with NetworkPolicy's own
semantics (support.netpol), entry by entry, denials included. And each policy is a valid
Kubernetes object: the strict 1.33 schema, and the Kubernetes client's model round trip."""

from __future__ import annotations

import dataclasses

import kubernetes
import kubernetes_validate
import pytest

from support.examples import instance
from support.netpol import Endpoint, allowed, selects
from tandem.operator import render
from tandem.operator.schema import SpecError
from tandem.operator.spec import parse_spec

NS, OTHER_NS, OPERATOR_NS = "team-a", "elsewhere", "tandem-system"
MOONCAKE = 41234  # any port: Mooncake's transfer engine picks its ports when it starts
PORTS = {"grpc": render.GRPC_PORT, "metrics": render.METRICS_PORT, "bootstrap": 8998, "mooncake": MOONCAKE,
         "http": render.ROUTER_HTTP_PORT, "health": render.ROUTER_HEALTH_PORT,
         "router-metrics": render.ROUTER_METRICS_PORT}
# The chart's operator pod (charts/tandem/templates/_helpers.tpl, tandem.operator.selectorLabels);
# tests/packaging/test_chart.py checks that the chart's pod carries render.OPERATOR_POD_LABELS.
OPERATOR_LABELS = {"app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": "tandem",
                   "app.kubernetes.io/component": "operator"}


def service(name: str = "smollm2", operator_namespace: str | None = OPERATOR_NS, **spec_changes) -> render.Instance:
    """examples/minimal.yaml with `spec_changes`, as InferenceService `name` in NS, rendered by an
    operator whose pods run in `operator_namespace`."""
    return dataclasses.replace(instance("minimal", **spec_changes), name=name, namespace=NS,
                               defaults=render.Defaults(operator_namespace=operator_namespace))


def pod_labels(inst: render.Instance) -> dict[str, dict[str, str]]:
    """component -> the labels of its pods, read from the rendered StatefulSets and Deployment."""
    workloads = [o for o in render.render_all(inst) if o["kind"] in ("StatefulSet", "Deployment")]
    return {o["metadata"]["labels"]["app.kubernetes.io/component"]: o["spec"]["template"]["metadata"]["labels"]
            for o in workloads}


def policies(*instances: render.Instance) -> list[dict]:
    return [o for inst in instances for o in render.render_all(inst) if o["kind"] == "NetworkPolicy"]


def endpoints(this: render.Instance, other: render.Instance) -> dict[str, Endpoint]:
    pods = {c: Endpoint(c, NS, labels) for c, labels in pod_labels(this).items()}
    pods |= {f"other-{c}": Endpoint(f"other-{c}", NS, labels) for c, labels in pod_labels(other).items()}
    return pods | {
        "neighbour": Endpoint("neighbour", NS, {"app": "debug"}),
        "prometheus": Endpoint("prometheus", "monitoring", {"app.kubernetes.io/name": "prometheus"}),
        "operator": Endpoint("operator", OPERATOR_NS, OPERATOR_LABELS),
        "stranger": Endpoint("stranger", OTHER_NS, {"app": "debug"}),
        "internet": Endpoint("internet", None, ip="203.0.113.7"),
    }


SOURCES = ["prefill", "decode", "router", "other-prefill", "other-decode", "other-router", "neighbour", "prometheus",
           "operator", "stranger", "internet"]
SAME_NAMESPACE = {"prefill", "decode", "router", "other-prefill", "other-decode", "other-router", "neighbour"}

# (destination, port) -> the sources admitted; every other source is refused. Written for "this"
# service; the other service's rows are the same with the names swapped.
MATRIX = {
    # gRPC: the router; and the decode, because the pools open every TCP port to each other.
    ("prefill", "grpc"): {"router", "decode"},
    ("prefill", "bootstrap"): {"decode"},
    ("prefill", "mooncake"): {"decode"},
    ("prefill", "metrics"): {"prometheus", "operator", "decode"},
    ("decode", "grpc"): {"router", "prefill"},
    ("decode", "mooncake"): {"prefill"},
    ("decode", "metrics"): {"prometheus", "operator", "prefill"},
    ("router", "http"): SAME_NAMESPACE,
    ("router", "health"): SAME_NAMESPACE,
    ("router", "router-metrics"): {"prometheus"},
    # A pod no policy selects stays open to everyone.
    ("neighbour", "http"): set(SOURCES),
    ("neighbour", "grpc"): set(SOURCES),
}


def swapped(name: str) -> str:
    if name.startswith("other-"):
        return name.removeprefix("other-")
    return f"other-{name}" if name in ("prefill", "decode", "router") else name


def matrix_for(side: str) -> dict[tuple[str, str], set[str]]:
    if side == "this":
        return MATRIX
    return {(swapped(d), port): {swapped(s) for s in sources} for (d, port), sources in MATRIX.items()}


def reachable(rendered: list[dict], pods: dict[str, Endpoint], destination: str, port: str) -> set[str]:
    return {s for s in SOURCES if allowed(rendered, pods[s], pods[destination], PORTS[port])}


ENTRIES = [(side, destination, port) for side in ("this", "other") for destination, port in matrix_for(side)]


@pytest.mark.parametrize(("side", "destination", "port"), ENTRIES, ids=[f"{s}:{d}:{p}" for s, d, p in ENTRIES])
def test_reachability_matrix(side, destination, port):
    """Each destination port admits exactly its row's sources, with both services' policies in
    place: e.g. another service's decode cannot reach this prefill's bootstrap port, the router
    cannot either, a neighbour cannot reach a server's gRPC port but can reach the router's HTTP
    port, a pod in another namespace cannot."""
    this, other = service("smollm2"), service("llama")
    pods, rendered = endpoints(this, other), policies(this, other)
    assert reachable(rendered, pods, destination, port) == matrix_for(side)[destination, port]


def test_matrix_denials_spelled_out():
    """The denials that matter most, one by one."""
    this, other = service("smollm2"), service("llama")
    pods, rendered = endpoints(this, other), policies(this, other)

    def may(source, destination, port):
        return allowed(rendered, pods[source], pods[destination], PORTS[port])

    assert not may("other-decode", "prefill", "bootstrap") and not may("other-decode", "prefill", "mooncake")
    assert not may("router", "prefill", "bootstrap") and not may("router", "decode", "mooncake")
    assert not may("neighbour", "prefill", "grpc") and not may("neighbour", "decode", "grpc")
    assert not may("other-router", "prefill", "grpc")
    assert may("neighbour", "router", "http") and not may("stranger", "router", "http")
    assert not may("neighbour", "router", "router-metrics") and not may("neighbour", "prefill", "metrics")
    assert not may("operator", "router", "router-metrics")  # the autoscaler reads servers only


def test_unselected_pods_are_open_and_policies_off_render_none():
    """With spec.networkPolicy.enabled false nothing is rendered and every pair connects; the
    policies of one service leave the other's pods open."""
    off = service("smollm2", networkPolicy={"enabled": False})
    assert not policies(off)
    other = service("llama")
    pods = endpoints(off, other)
    for (destination, port) in MATRIX:
        assert reachable([], pods, destination, port) == set(SOURCES)
    only_other = policies(other)
    assert reachable(only_other, pods, "prefill", "bootstrap") == set(SOURCES)
    assert reachable(only_other, pods, "other-prefill", "bootstrap") == {"other-decode"}


def test_without_the_operators_namespace_only_monitoring_reads_server_metrics():
    this = service("smollm2", operator_namespace=None)
    pods, rendered = endpoints(this, service("llama")), policies(this)
    assert reachable(rendered, pods, "prefill", "metrics") == {"prometheus", "decode"}


def test_router_behind_a_load_balancer_is_open_to_every_source_by_default():
    """A LoadBalancer or NodePort Service exists to be reached from outside: its router admits every
    source on HTTP and health, still not on metrics; the servers stay closed."""
    for service_type in ("LoadBalancer", "NodePort"):
        this = service("smollm2", router={"service": {"type": service_type}})
        pods, rendered = endpoints(this, service("llama")), policies(this)
        assert reachable(rendered, pods, "router", "http") == set(SOURCES)
        assert reachable(rendered, pods, "router", "health") == set(SOURCES)
        assert reachable(rendered, pods, "router", "router-metrics") == {"prometheus"}
        assert reachable(rendered, pods, "prefill", "grpc") == {"router", "decode"}


@pytest.mark.parametrize(("router_from", "admitted"), [
    ([], set()),  # nobody: the rule is left out (an empty `from` would admit everyone)
    ([{"cidr": "203.0.113.0/24"}], {"internet"}),
    ([{"namespaceLabels": {}, "podLabels": {"app": "debug"}}], {"neighbour", "stranger"}),
    ([{"namespaceLabels": {"kubernetes.io/metadata.name": OTHER_NS}}], {"stranger"}),
    ([{"podLabels": {"app": "debug"}}, {"namespaceLabels": {"kubernetes.io/metadata.name": "monitoring"}}],
     {"neighbour", "prometheus"}),
])
def test_router_from(router_from, admitted):
    this = service("smollm2", router={"service": {"type": "LoadBalancer"}}, networkPolicy={"routerFrom": router_from})
    pods, rendered = endpoints(this, service("llama")), policies(this)
    assert reachable(rendered, pods, "router", "http") == admitted
    assert reachable(rendered, pods, "router", "health") == admitted
    assert all(rule.get("from") for p in rendered for rule in p["spec"]["ingress"]), "an empty `from` admits everyone"


@pytest.mark.parametrize(("metrics_from", "servers", "router"), [
    ([], {"operator"}, set()),
    ([{"namespaceLabels": {}, "podLabels": {"app.kubernetes.io/name": "prometheus"}}], {"prometheus", "operator"},
     {"prometheus"}),
    ([{"podLabels": {"app": "debug"}}], {"neighbour", "operator"}, {"neighbour"}),
])
def test_metrics_from(metrics_from, servers, router):
    this = service("smollm2", networkPolicy={"metricsFrom": metrics_from})
    pods, rendered = endpoints(this, service("llama")), policies(this)
    assert reachable(rendered, pods, "prefill", "metrics") == servers | {"decode"}
    assert reachable(rendered, pods, "decode", "metrics") == servers | {"prefill"}
    assert reachable(rendered, pods, "router", "router-metrics") == router


def test_policies_select_their_components_pods_and_are_ingress_only():
    inst = service("smollm2")
    labels = pod_labels(inst)
    rendered = policies(inst)
    assert [p["metadata"]["name"] for p in rendered] == ["smollm2-prefill", "smollm2-decode", "smollm2-router"]
    for policy in rendered:
        component = policy["metadata"]["labels"]["app.kubernetes.io/component"]
        assert [c for c, pod in labels.items() if selects(policy["spec"]["podSelector"], pod)] == [component]
        assert policy["spec"]["policyTypes"] == ["Ingress"] and "egress" not in policy["spec"]
    assert render.render_all(inst)[-3:] == rendered  # after every other object


def test_bootstrap_port_follows_the_spec():
    this = service("smollm2", kvTransfer={"bootstrapPort": 9100})
    pods, rendered = endpoints(this, service("llama")), policies(this)
    assert {s for s in SOURCES if allowed(rendered, pods[s], pods["prefill"], 9100)} == {"decode"}


VARIANTS = {
    "default": {},
    "load-balancer": {"router": {"service": {"type": "LoadBalancer", "port": 80}}},
    "custom": {"networkPolicy": {"routerFrom": [{"cidr": "10.0.0.0/8"}, {"podLabels": {"app": "gateway"}}],
                                 "metricsFrom": [{"namespaceLabels": {"team": "obs"}, "podLabels": {"app": "prom"}}]}},
    "nobody": {"networkPolicy": {"routerFrom": [], "metricsFrom": []}},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_policies_are_valid_kubernetes_objects(variant):
    """Strict 1.33 schema, and the Kubernetes client's V1NetworkPolicy model gives back exactly the
    rendered dict (a misspelled field would be dropped on the way)."""
    api = kubernetes.client.ApiClient()
    rendered = policies(service("smollm2", **VARIANTS[variant])) + policies(service("smollm2", operator_namespace=None))
    assert len(rendered) == 6
    for policy in rendered:
        kubernetes_validate.validate(policy, "1.33", strict=True)
        model = api._ApiClient__deserialize(policy, "V1NetworkPolicy")
        assert api.sanitize_for_serialization(model) == policy


@pytest.mark.parametrize(("peer", "path"), [
    ({"cidr": "10.0.0.0/8", "podLabels": {"app": "x"}}, "spec.networkPolicy.routerFrom[0].cidr"),
    ({"cidr": "10.0.0.0/8", "namespaceLabels": {}}, "spec.networkPolicy.routerFrom[0].cidr"),
    ({"cidr": "10.0.0.0/33"}, "spec.networkPolicy.routerFrom[0].cidr"),
    ({"cidr": "10.0.0.1/8"}, "spec.networkPolicy.routerFrom[0].cidr"),
    ({"cidr": "example.com"}, "spec.networkPolicy.routerFrom[0].cidr"),
    ({"podLabel": {"app": "x"}}, "spec.networkPolicy.routerFrom[0].podLabel"),
])
def test_bad_peers_are_refused_naming_the_field(peer, path):
    with pytest.raises(SpecError) as e:
        parse_spec("smollm2", {"image": "x", "model": {"name": "m"}, "networkPolicy": {"routerFrom": [peer]}})
    assert e.value.path == path, str(e.value)
