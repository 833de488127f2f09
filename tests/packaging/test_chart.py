"""The Helm chart charts/tandem, rendered and linted with Helm's Go SDK (helm-python-sdk): every object is valid
for Kubernetes, the operator Deployment runs the operator's real CLI, RBAC is exactly what the operator uses,
values.schema.json rejects bad values, the chart ships the generated CRD and dashboards, its monitors
select what the operator renders, and its NetworkPolicy lets the operator reach exactly what it calls."""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from support.netpol import Endpoint, allowed
from tandem.operator import main as operator_main
from tandem.operator import render as operator_render
from tandem.operator.kube import PLURALS
from tandem.operator.spec import GROUP, PLURAL, parse_spec

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "tandem"
CRD_FILE = "inferenceservices.tandem.dev.yaml"
APP_VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
RELEASE, NAMESPACE = "ops", "tandem-system"
LONG_RELEASE = "r" * 53  # the longest release name Helm accepts

CUSTOM = {
    "operator": {
        "image": {"tag": "1.2.3", "pullPolicy": "Always"},
        "watchNamespaces": ["team-a", "team-b"],
        "resources": {"requests": {"cpu": "250m", "memory": "300Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}},
        "nodeSelector": {"pool": "system"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "system", "effect": "NoSchedule"}],
        "podAnnotations": {"example.com/team": "ml"},
        "serviceMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "prometheus"}},
        "networkPolicy": {"metricsFrom": [{"namespaceSelector": {"matchLabels": {"team": "obs"}},
                                           "podSelector": {"matchLabels": {"app": "prometheus"}}}],
                          "prometheus": {"to": [], "port": 9090}},
    },
    "routerImage": {"repository": "registry.example.com/router", "tag": "9.9.9"},
    "imagePullSecrets": [{"name": "regcred"}],
    "serviceAccount": {"create": False, "name": "tandem-ops"},
    "clusterDomain": "corp.example",
    "podMonitor": {"enabled": True, "interval": "30s", "labels": {"release": "prometheus"}},
    "prometheusRule": {"enabled": True, "labels": {"release": "prometheus"},
                       "waitingQueueHigh": {"threshold": 20, "for": "3m", "severity": "critical"}},
    "dashboards": {"enabled": True, "folder": "LLM serving", "namespace": "monitoring"},
}
VALUE_SETS = {"default": {}, "custom": CUSTOM}

WRITE = {"get", "list", "watch", "create", "patch", "delete"}
# What the operator calls inside a watched namespace, and what kopf reads cluster-wide in any case.
NAMESPACED_GRANTS = {
    ("tandem.dev", "inferenceservices"): {"get", "list", "watch", "patch", "update"},
    ("tandem.dev", "inferenceservices/status"): {"get", "patch", "update"},
    ("tandem.dev", "inferenceservices/finalizers"): {"update"},
    ("apps", "statefulsets"): WRITE,
    ("apps", "deployments"): WRITE,
    ("", "services"): WRITE,
    ("", "configmaps"): WRITE,
    ("", "pods"): {"get", "list"},
    ("", "secrets"): {"get", "create", "delete"},  # the bootstrap-token Secret: made once, never changed or listed
    ("policy", "poddisruptionbudgets"): WRITE,
    ("networking.k8s.io", "networkpolicies"): WRITE,
    ("monitoring.coreos.com", "servicemonitors"): WRITE,
    ("monitoring.coreos.com", "podmonitors"): WRITE,
    ("", "events"): {"create", "patch"},
    ("events.k8s.io", "events"): {"create", "patch"},
}
# Kinds from the monitoring.coreos.com CRDs, which kubernetes_validate has no schema for (checked field by field).
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
DASHBOARD_FILES = sorted((CHART / "dashboards").glob("*.json"))
CLUSTER_GRANTS = {
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"},
    ("", "namespaces"): {"get", "list", "watch"},
}


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(str(CHART)) as loaded:
        yield loaded


def render(chart, values: dict, name: str = RELEASE) -> list[dict]:
    """Every non-empty YAML document the chart renders (NOTES.txt and disabled templates left out)."""
    out = chart.render(values=values, name=name, namespace=NAMESPACE, is_install=True)
    return [doc for path, text in out.items() if not path.endswith("/NOTES.txt")
            for doc in yaml.safe_load_all(text) if doc]


@pytest.fixture(scope="module")
def default_docs(chart):
    return render(chart, {})


@pytest.fixture(scope="module")
def custom_docs(chart):
    return render(chart, CUSTOM)


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str) -> dict:
    found = of_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def grants(role: dict) -> dict[tuple[str, str], set[str]]:
    """(apiGroup, resource) -> verbs granted by a Role or ClusterRole."""
    out = defaultdict(set)
    for rule in role["rules"]:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out[group, resource] |= set(rule["verbs"])
    return dict(out)


def container(docs: list[dict]) -> dict:
    (operator,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return operator


def parse_operator_cli(docs: list[dict]) -> argparse.Namespace:
    """The container's command line parsed by the operator's own argument parser."""
    command = container(docs)["command"] + container(docs)["args"]
    assert command[:2] == ["tandem", "operator"]
    parser = argparse.ArgumentParser(exit_on_error=False)
    operator_main.add_arguments(parser)
    return parser.parse_args(command[2:])


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_objects_valid_for_kubernetes(chart, value_set):
    """Every rendered object except the monitoring kinds (CRD kinds, checked below) passes the strict
    Kubernetes 1.33 schema, and the expected kinds are all there; monitors, rules and dashboards only
    when enabled."""
    docs = render(chart, VALUE_SETS[value_set])
    for doc in docs:
        if doc["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(doc, "1.33", strict=True)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ClusterRole", "ClusterRoleBinding", "NetworkPolicy"} <= kinds
    assert ("ServiceAccount" in kinds) == (value_set == "default")
    for kind in (*CRD_KINDS, "ConfigMap"):
        assert (kind in kinds) == (value_set == "custom"), kind


def test_names_fit_with_longest_release_name(chart):
    """With a 53-character release name every object name and label value stays within 63 characters."""
    helm.validate_release_name(LONG_RELEASE)
    docs = render(chart, CUSTOM, name=LONG_RELEASE)
    # Deployment, Service, ServiceMonitor, NetworkPolicy, ClusterRole(Binding), 2x Role(Binding), PodMonitor,
    # PrometheusRule, and a ConfigMap per dashboard.
    assert len(docs) == 12 + len(DASHBOARD_FILES)
    names = {(d["kind"], d["metadata"]["name"]) for d in docs if d["kind"] not in ("Role", "RoleBinding")}
    assert len(names) == len(docs) - 4
    for doc in docs:
        meta = doc["metadata"]
        assert len(meta["name"]) <= 63, meta["name"]
        assert all(len(value) <= 63 for value in meta["labels"].values()), meta["labels"]
        if doc["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(doc, "1.33", strict=True)
    assert one(docs, "Deployment")["metadata"]["labels"]["app.kubernetes.io/instance"] == LONG_RELEASE


def test_operator_deployment_defaults(default_docs):
    """One replica recreated on upgrade, the operator CLI with the chart's defaults, kopf's liveness probe,
    a non-root read-only container, and resources from values.yaml."""
    deployment = one(default_docs, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    operator = container(default_docs)
    assert operator["image"] == f"ghcr.io/tandem-serving/tandem-operator:{APP_VERSION}"
    assert operator["imagePullPolicy"] == "IfNotPresent"
    cli = parse_operator_cli(default_docs)
    assert cli.router_image == f"ghcr.io/tandem-serving/tandem-router:{APP_VERSION}"
    assert cli.cluster_domain == "cluster.local"
    assert cli.namespace == []  # all namespaces
    assert cli.operator_namespace == NAMESPACE  # the InferenceServices' NetworkPolicies admit it to the metrics
    assert cli.peering is None and cli.operator_command is None
    assert (cli.liveness_port, cli.metrics_port) == (8080, 9090)
    assert {p["name"]: p["containerPort"] for p in operator["ports"]} == {"http-health": 8080, "metrics": 9090}
    assert operator["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http-health"}
    assert operator["resources"] == {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}}
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
    security = operator["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == 10001
    assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert not {"nodeSelector", "tolerations", "affinity", "imagePullSecrets"} & set(pod)


def test_operator_deployment_custom_values(custom_docs):
    """Custom image tags, watched namespaces, cluster domain, resources and scheduling reach the pod."""
    operator = container(custom_docs)
    assert operator["image"] == "ghcr.io/tandem-serving/tandem-operator:1.2.3"
    assert operator["imagePullPolicy"] == "Always"
    cli = parse_operator_cli(custom_docs)
    assert cli.router_image == "registry.example.com/router:9.9.9"
    assert cli.cluster_domain == "corp.example"
    assert cli.namespace == ["team-a", "team-b"]
    assert operator["resources"] == CUSTOM["operator"]["resources"]
    template = one(custom_docs, "Deployment")["spec"]["template"]
    assert template["metadata"]["annotations"] == {"example.com/team": "ml"}
    assert template["spec"]["nodeSelector"] == {"pool": "system"}
    assert template["spec"]["tolerations"] == CUSTOM["operator"]["tolerations"]
    assert template["spec"]["imagePullSecrets"] == [{"name": "regcred"}]


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_service_account_is_the_bound_subject(chart, value_set):
    """The pod runs as the ServiceAccount that every (Cluster)RoleBinding names, in the release namespace."""
    docs = render(chart, VALUE_SETS[value_set])
    name = one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"]
    if value_set == "custom":
        assert name == "tandem-ops" and not of_kind(docs, "ServiceAccount")
    else:
        assert name == one(docs, "ServiceAccount")["metadata"]["name"] == f"{RELEASE}-tandem"
    bindings = of_kind(docs, "ClusterRoleBinding") + of_kind(docs, "RoleBinding")
    assert len(bindings) == (3 if value_set == "custom" else 1)
    for binding in bindings:
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": NAMESPACE}]


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_selectors_pick_only_the_operator(chart, value_set):
    """The Deployment selector matches its pod labels and carries component=operator (InferenceService pods
    share the name/instance labels); the metrics Service selects the same pods on the metrics port."""
    docs = render(chart, VALUE_SETS[value_set])
    deployment, service = one(docs, "Deployment"), one(docs, "Service")
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector["app.kubernetes.io/component"] == "operator"
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert service["spec"]["selector"] == selector
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}]
    assert "metrics" in {p["name"] for p in container(docs)["ports"]}


def test_rbac_cluster_wide_by_default(default_docs):
    """Watching all namespaces: one ClusterRole with exactly the operator's rules, bound by a
    ClusterRoleBinding; no wildcards, no namespaced Roles."""
    role = one(default_docs, "ClusterRole")
    assert grants(role) == NAMESPACED_GRANTS | CLUSTER_GRANTS
    assert "*" not in str(role["rules"])
    assert not of_kind(default_docs, "Role") and not of_kind(default_docs, "RoleBinding")
    binding = one(default_docs, "ClusterRoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": role["metadata"]["name"]}


def test_rbac_namespaced_when_watching_a_list(custom_docs):
    """Watching team-a and team-b: a Role and RoleBinding in each, and a ClusterRole with only kopf's
    cluster-scoped reads."""
    cluster_role = one(custom_docs, "ClusterRole")
    assert grants(cluster_role) == CLUSTER_GRANTS
    roles = {r["metadata"]["namespace"]: r for r in of_kind(custom_docs, "Role")}
    bindings = {b["metadata"]["namespace"]: b for b in of_kind(custom_docs, "RoleBinding")}
    assert set(roles) == set(bindings) == {"team-a", "team-b"}
    for namespace, role in roles.items():
        assert grants(role) == NAMESPACED_GRANTS
        assert "*" not in str(role["rules"])
        assert bindings[namespace]["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                                  "name": role["metadata"]["name"]}
    assert one(custom_docs, "ClusterRoleBinding")["roleRef"]["name"] == cluster_role["metadata"]["name"]


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_rbac_covers_what_the_operator_calls(chart, value_set):
    """Every kind the operator writes (tandem.operator.kube.PLURALS) is granted get/list/watch/create/patch/delete,
    and its InferenceServices can be watched and patched, with their status, wherever it watches."""
    docs = render(chart, VALUE_SETS[value_set])
    roles = of_kind(docs, "Role") if value_set == "custom" else of_kind(docs, "ClusterRole")
    assert len(roles) == (2 if value_set == "custom" else 1)
    for role in roles:
        granted = grants(role)
        for (api_version, _kind), plural in PLURALS.items():
            group = api_version.rpartition("/")[0]
            assert WRITE <= granted.get((group, plural), set()), f"{group}/{plural} in {role['metadata']}"
        assert {"get", "list", "watch", "patch"} <= granted[GROUP, PLURAL]
        assert "patch" in granted[GROUP, f"{PLURAL}/status"]


def test_service_monitor(custom_docs, default_docs):
    """The ServiceMonitor (off by default) scrapes the metrics Service's port in the release namespace
    with the interval and extra labels from values."""
    assert not of_kind(default_docs, "ServiceMonitor")
    monitor, service = one(custom_docs, "ServiceMonitor"), one(custom_docs, "Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["metadata"]["labels"]["app.kubernetes.io/component"] == "operator"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    # honorLabels: the autoscaler's series keep their own namespace and service labels.
    assert monitor["spec"]["endpoints"] == [{"port": service["spec"]["ports"][0]["name"], "path": "/metrics",
                                             "interval": "15s", "honorLabels": True}]


def test_rbac_can_be_left_out(chart):
    """With rbac.create false the chart renders no (Cluster)Roles or bindings; the ServiceAccount stays."""
    kinds = {d["kind"] for d in render(chart, {"rbac": {"create": False}})}
    assert kinds == {"Deployment", "Service", "ServiceAccount", "NetworkPolicy"}


def test_notes(chart):
    """NOTES.txt tells how to create an InferenceService, list it and reach its router."""
    notes = chart.render(values={}, name=RELEASE, namespace=NAMESPACE, is_install=True)["tandem/templates/NOTES.txt"]
    assert "kubectl apply -f examples/minimal.yaml" in notes and (REPO / "examples" / "minimal.yaml").is_file()
    assert "kubectl get tisvc" in notes
    assert "kubectl port-forward svc/<name>-router 8000" in notes


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_lint_clean(value_set):
    """`helm lint --strict` for Kubernetes 1.30 reports no warnings or errors."""
    report = helm.lint(str(CHART), VALUE_SETS[value_set], strict=True, kube_version="v1.30.0")
    serious = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["total_charts_linted"] == 1
    assert report["errors"] == [] and serious == [], report["messages"]


@pytest.mark.parametrize(("values", "field"), [
    ({"operator": {"watchNamespaces": "default"}}, "/operator/watchNamespaces"),
    ({"operator": {"watchNamespaces": ["Team_A"]}}, "/operator/watchNamespaces/0"),
    ({"operator": {"watchNamespaces": ["a", "a"]}}, "/operator/watchNamespaces"),
    ({"operator": {"image": {"pullPolicy": "Sometimes"}}}, "/operator/image/pullPolicy"),
    ({"operator": {"serviceMonitor": {"interval": "often"}}}, "/operator/serviceMonitor/interval"),
    ({"serviceAccount": {"create": "yes"}}, "/serviceAccount/create"),
    ({"podMonitor": {"enabled": "yes"}}, "/podMonitor/enabled"),
    ({"podMonitor": {"interval": "often"}}, "/podMonitor/interval"),
    ({"prometheusRule": {"waitingQueueHigh": {"threshold": -1}}}, "/prometheusRule/waitingQueueHigh/threshold"),
    ({"prometheusRule": {"waitingQueueHigh": {"threshold": "many"}}}, "/prometheusRule/waitingQueueHigh/threshold"),
    ({"prometheusRule": {"kvTransferFailures": {"severity": "page"}}}, "/prometheusRule/kvTransferFailures/severity"),
    ({"prometheusRule": {"autoscalerUnhealthy": {"for": "soon"}}}, "/prometheusRule/autoscalerUnhealthy/for"),
    ({"prometheusRule": {"waitingQueueGrowing": {"after": "5m"}}}, "after"),
    ({"dashboards": {"enabled": 1}}, "/dashboards/enabled"),
    ({"dashboards": {"label": "grafana dashboard"}}, "/dashboards/label"),
    ({"dashboards": {"labelValue": 1}}, "/dashboards/labelValue"),
    ({"dashboards": {"namespace": "Monitoring"}}, "/dashboards/namespace"),
    ({"dashboards": {"folders": "tandem"}}, "folders"),
    ({"replicaCount": 2}, "replicaCount"),
    ({"operator": {"replicas": 2}}, "replicas"),
    ({"operator": {"networkPolicy": {"enabled": "yes"}}}, "/operator/networkPolicy/enabled"),
    ({"operator": {"networkPolicy": {"metricsFrom": [{}]}}}, "/operator/networkPolicy/metricsFrom/0"),
    ({"operator": {"networkPolicy": {"metricsFrom": [{"podSelectr": {}}]}}}, "podSelectr"),
    ({"operator": {"networkPolicy": {"prometheus": {"port": 0}}}}, "/operator/networkPolicy/prometheus/port"),
])
def test_schema_rejects_bad_values(chart, values, field):
    """values.schema.json rejects wrong types, enums, patterns, duplicates and unknown keys, naming the field."""
    with pytest.raises(helm.HelmValuesError, match=f"'{field}'"):
        chart.render(values=values, name=RELEASE, namespace=NAMESPACE, is_install=True)


def test_chart_ships_the_generated_crd(chart):
    """The chart's crds/ copy is byte-identical to crds/ at the repository root, and Helm loads it as the
    InferenceService CRD."""
    chart_copy = (CHART / "crds" / CRD_FILE).read_bytes()
    assert chart_copy == (REPO / "crds" / CRD_FILE).read_bytes()
    (crd,) = chart.crds
    assert crd["data"] == chart_copy.decode()
    doc = yaml.safe_load(crd["data"])
    assert doc["kind"] == "CustomResourceDefinition" and doc["metadata"]["name"] == f"{PLURAL}.{GROUP}"
    kubernetes_validate.validate(doc, "1.33", strict=True)


def dashboard_configmaps(docs: list[dict]) -> dict[str, dict]:
    """File name -> the ConfigMap carrying it."""
    found = {}
    for configmap in of_kind(docs, "ConfigMap"):
        assert configmap["metadata"]["labels"]["app.kubernetes.io/component"] == "dashboards"
        (file_name,) = configmap["data"]
        found[file_name] = configmap
    return found


def test_dashboard_configmaps(custom_docs, default_docs):
    """Off by default; when enabled one ConfigMap per generated dashboard, labelled for Grafana's sidecar, in
    the namespace and folder from values, holding the file byte for byte (valid dashboard JSON)."""
    assert not of_kind(default_docs, "ConfigMap")
    configmaps = dashboard_configmaps(custom_docs)
    assert sorted(configmaps) == [p.name for p in DASHBOARD_FILES] and len(DASHBOARD_FILES) == 3
    for path in DASHBOARD_FILES:
        meta = configmaps[path.name]["metadata"]
        assert meta["labels"]["grafana_dashboard"] == "1"
        assert meta["annotations"] == {"grafana_folder": "LLM serving"}
        assert meta["namespace"] == "monitoring"
        text = configmaps[path.name]["data"][path.name]
        assert text == path.read_text()
        assert json.loads(text)["uid"] == path.stem


def test_dashboard_configmaps_sidecar_label_is_configurable(chart):
    """Another sidecar label and value; no folder annotation; the release namespace by default."""
    docs = render(chart, {"dashboards": {"enabled": True, "label": "example.com/dashboard", "labelValue": "tandem"}})
    configmaps = dashboard_configmaps(docs)
    assert len(configmaps) == len(DASHBOARD_FILES)
    for configmap in configmaps.values():
        meta = configmap["metadata"]
        assert meta["labels"]["example.com/dashboard"] == "tandem" and "grafana_dashboard" not in meta["labels"]
        assert "annotations" not in meta and meta["namespace"] == NAMESPACE
        kubernetes_validate.validate(configmap, "1.33", strict=True)


def inference_service(namespace: str) -> operator_render.Instance:
    body = yaml.safe_load((REPO / "examples" / "minimal.yaml").read_text())
    name = body["metadata"]["name"]
    return operator_render.Instance(name=name, namespace=namespace, uid="uid", spec=parse_spec(name, body["spec"]))


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """Whether a Kubernetes label selector (matchLabels, matchExpressions with In) selects these labels."""
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In"
    return (selector["matchLabels"].items() <= labels.items()
            and all(labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", [])))


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_pod_monitor_scrapes_what_the_operator_renders(chart, value_set):
    """The PodMonitor (off by default) selects the prefill, decode and router pods the operator renders in
    every watched namespace, and not the operator's own pod; it scrapes their container port `metrics` and
    turns the InferenceService label into `service`."""
    docs = render(chart, VALUE_SETS[value_set])
    if value_set == "default":
        assert not of_kind(docs, "PodMonitor")
        docs = render(chart, {"podMonitor": {"enabled": True}})
    monitor = one(docs, "PodMonitor")
    spec = monitor["spec"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    watched = CUSTOM["operator"]["watchNamespaces"] if value_set == "custom" else []
    assert spec["namespaceSelector"] == ({"matchNames": watched} if watched else {"any": True})
    (endpoint,) = spec["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    assert endpoint["interval"] == ("30s" if value_set == "custom" else "15s")
    label = f"{GROUP}/inference-service"
    # Prometheus' name for a pod label: every character outside [a-zA-Z0-9_] becomes "_".
    source = "__meta_kubernetes_pod_label_" + re.sub(r"\W", "_", label)
    assert endpoint["relabelings"] == [{"sourceLabels": [source], "targetLabel": "service"}]
    inst = inference_service(watched[0] if watched else "default")
    workloads = [o for o in operator_render.render_all(inst) if o["kind"] in ("StatefulSet", "Deployment")]
    assert len(workloads) == 3
    for workload in workloads:
        template = workload["spec"]["template"]
        assert selects(spec["selector"], template["metadata"]["labels"]), workload["metadata"]["name"]
        assert template["metadata"]["labels"][label] == inst.name
        ports = {p["name"] for c in template["spec"]["containers"] for p in c["ports"]}
        assert endpoint["port"] in ports, workload["metadata"]["name"]
    operator_pod = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert not selects(spec["selector"], operator_pod)


def test_prometheus_rule(chart, custom_docs, default_docs):
    """The PrometheusRule (off by default) has every alert with a severity, a summary and a description;
    thresholds, durations and severities come from values, and Prometheus' own templates survive Helm."""
    assert not of_kind(default_docs, "PrometheusRule")
    rule = one(custom_docs, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    alerts = {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"]}
    assert set(alerts) == {"TandemKVTransferFailures", "TandemEngineCrashed", "TandemBootstrapFailures", "TandemWaitingQueueHigh",
                           "TandemWaitingQueueGrowing", "TandemAutoscalerUnhealthy"}
    for alert in alerts.values():
        assert set(alert) == {"alert", "expr", "for", "labels", "annotations"}
        assert alert["labels"]["severity"] in {"critical", "warning", "info"}
        assert set(alert["annotations"]) == {"summary", "description"}
        assert "{{ $labels." in alert["annotations"]["description"]
    high = alerts["TandemWaitingQueueHigh"]
    assert high["expr"] == "sum by (namespace, service, role) (tandem_num_requests_waiting) > 20"
    assert (high["for"], high["labels"]["severity"]) == ("3m", "critical")
    assert "more than 20 waiting requests for 3m" in high["annotations"]["description"]
    assert "deriv(tandem_num_requests_waiting[10m])" in alerts["TandemWaitingQueueGrowing"]["expr"]
    assert "increase(tandem_kv_transfer_failures_total[5m])" in alerts["TandemKVTransferFailures"]["expr"]
    crashed = alerts["TandemEngineCrashed"]
    assert "increase(tandem_engine_crashes_total[15m])" in crashed["expr"]
    assert (crashed["for"], crashed["labels"]["severity"]) == ("0m", "critical")
    unhealthy = alerts["TandemAutoscalerUnhealthy"]
    assert unhealthy["expr"] == "min by (namespace, service, pool) (tandem_autoscaler_healthy) == 0"
    assert (unhealthy["for"], unhealthy["labels"]["severity"]) == ("10m", "warning")


def _operator_reach(docs: list[dict], watched: list[str]) -> dict:
    """The operator pod, and what its NetworkPolicy (with an InferenceService's own policies, rendered
    by an operator given the chart's --operator-namespace) admits to and from it."""
    cli = parse_operator_cli(docs)
    operator = Endpoint("operator", NAMESPACE, one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"])
    namespace = watched[0] if watched else "team-z"
    inst = inference_service(namespace)
    inst = operator_render.Instance(name=inst.name, namespace=namespace, uid="uid", spec=inst.spec,
                                    defaults=operator_render.Defaults(operator_namespace=cli.operator_namespace))
    objects = operator_render.render_all(inst)
    workloads = [o for o in objects if o["kind"] in ("StatefulSet", "Deployment")]
    pods = {o["metadata"]["labels"]["app.kubernetes.io/component"]:
            Endpoint(o["metadata"]["name"], namespace, o["spec"]["template"]["metadata"]["labels"]) for o in workloads}
    # Helm installs the chart's objects into the release namespace (they name none).
    chart_policies = [{**p, "metadata": {**p["metadata"], "namespace": NAMESPACE}}
                      for p in of_kind(docs, "NetworkPolicy")]
    policies = chart_policies + [o for o in objects if o["kind"] == "NetworkPolicy"]
    return {"operator": operator, "pods": pods, "policies": policies}


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_operator_network_policy(chart, value_set):
    """The operator pod admits only its metrics and health ports, from the monitoring peers in values; it reaches
    the API server (443, 6443 at any address), DNS, Prometheus, and the servers' metrics port in the watched
    namespaces, where the InferenceServices' own policies admit it; nothing else."""
    docs = render(chart, VALUE_SETS[value_set])
    watched = CUSTOM["operator"]["watchNamespaces"] if value_set == "custom" else []
    reach = _operator_reach(docs, watched)
    operator, pods, policies = reach["operator"], reach["pods"], reach["policies"]
    assert operator_render.OPERATOR_POD_LABELS.items() <= operator.labels.items()
    labels = {"monitoring": {"kubernetes.io/metadata.name": "monitoring"},
              "obs": {"kubernetes.io/metadata.name": "obs", "team": "obs"}}
    scraper = (Endpoint("prometheus", "obs", {"app": "prometheus"}) if value_set == "custom"
               else Endpoint("prometheus", "monitoring", {"app.kubernetes.io/name": "prometheus"}))
    neighbour = Endpoint("neighbour", NAMESPACE, {"app": "debug"})
    api_server = Endpoint("apiserver", None, ip="10.96.0.1")
    dns = Endpoint("dns", "kube-system", {"k8s-app": "kube-dns"})

    def may(source, destination, port, protocol="TCP"):
        return allowed(policies, source, destination, port, protocol, namespace_labels=labels)

    cli = parse_operator_cli(docs)
    assert (cli.metrics_port, cli.liveness_port) == (9090, 8080)
    for port in (9090, 8080):
        assert may(scraper, operator, port) and not may(neighbour, operator, port)
    assert not may(scraper, operator, 9091)
    assert may(operator, api_server, 443) and may(operator, api_server, 6443) and not may(operator, api_server, 80)
    assert may(operator, dns, 53, "UDP") and may(operator, dns, 53, "TCP") and not may(operator, dns, 54, "UDP")
    prometheus_peer = Endpoint("prometheus", "monitoring", {"app.kubernetes.io/name": "prometheus"})
    assert may(operator, prometheus_peer, 9090) == (value_set == "default")  # custom: prometheus.to is empty
    for pool in operator_render.POOLS:
        assert may(operator, pods[pool], operator_render.METRICS_PORT), pool
        assert not may(operator, pods[pool], operator_render.GRPC_PORT), pool
    assert not may(operator, pods["router"], operator_render.ROUTER_METRICS_PORT)
    stranger = Endpoint("other", pods["prefill"].namespace, {"app": "debug"})
    assert not may(operator, stranger, operator_render.METRICS_PORT)
    if watched:
        unwatched = Endpoint("prefill", "team-z", pods["prefill"].labels)
        assert not may(operator, unwatched, operator_render.METRICS_PORT)
    off = render(chart, {"operator": {"networkPolicy": {"enabled": False}}})
    assert not of_kind(off, "NetworkPolicy")
