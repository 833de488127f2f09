"""The InferenceService CRD: generated from the typed spec, valid as a Kubernetes object, and its
own schema accepts the examples and rejects broken specs, naming the field."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tandem.operator import crd
from tandem.operator.schema import SpecError, to_wire
from tandem.operator.spec import parse_spec

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def test_crd_files_are_exactly_what_the_typed_spec_generates():
    expected = crd.crd_yaml()
    for path in crd.CRD_PATHS:
        assert path.read_text() == expected, f"{path} is stale: run `tandem operator crd --write`"


def test_crd_is_a_valid_kubernetes_object_with_printer_columns():
    doc = yaml.safe_load(crd.CRD_PATHS[0].read_text())
    kubernetes_validate.validate(doc, "1.33", strict=True)
    version = doc["spec"]["versions"][0]
    assert doc["spec"]["names"]["shortNames"] == ["tisvc"] and doc["spec"]["scope"] == "Namespaced"
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == ["Ready", "Phase", "Prefill", "Decode",
                                                                         "Model", "Age"]
    jsonschema.Draft4Validator.check_schema(version["schema"]["openAPIV3Schema"])


def _structural(schema: dict) -> dict:
    """The schema as the API server enforces it: unknown fields are errors (the server prunes
    them silently, which would let a typo through), `nullable` admits null."""
    s = copy.deepcopy(schema)
    if s.get("nullable") and "type" in s:
        s["type"] = [s["type"], "null"]
    if s.get("type") == "object" and "properties" in s and not s.get("x-kubernetes-preserve-unknown-fields"):
        s.setdefault("additionalProperties", False)
    if "properties" in s:
        s["properties"] = {k: _structural(v) for k, v in s["properties"].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(s.get(key), dict):
            s[key] = _structural(s[key])
    if "anyOf" in s:
        s["anyOf"] = [_structural(v) for v in s["anyOf"]]
    return s


def _apply_defaults(obj, schema: dict):
    """Structural defaulting, top-down, as the API server does it."""
    if isinstance(obj, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in obj and "default" in sub:
                obj[key] = copy.deepcopy(sub["default"])
            if key in obj:
                _apply_defaults(obj[key], sub)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for item in obj:
            _apply_defaults(item, schema["items"])
    return obj


SCHEMA = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
VALIDATOR = jsonschema.Draft4Validator(_structural(SCHEMA), format_checker=jsonschema.Draft4Validator.FORMAT_CHECKER)


def schema_errors(body: dict) -> list[str]:
    return sorted(".".join(map(str, e.path)) + ": " + e.message for e in VALIDATOR.iter_errors(body))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate_against_the_crd_schema_and_parse(path):
    body = yaml.safe_load(path.read_text())
    assert body["apiVersion"] == "tandem.dev/v1alpha1" and body["kind"] == "InferenceService"
    assert schema_errors(body) == []
    parse_spec(body["metadata"]["name"], body["spec"])


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_schema_defaults_are_the_typed_spec_defaults(path):
    """What the API server stores after defaulting is what the operator parses."""
    body = yaml.safe_load(path.read_text())
    defaulted = _apply_defaults(copy.deepcopy(body), SCHEMA)
    assert defaulted["spec"] == to_wire(parse_spec(body["metadata"]["name"], body["spec"]))


def _minimal() -> dict:
    return yaml.safe_load((REPO / "examples" / "minimal.yaml").read_text())


def _with(path: str, value) -> dict:
    body = _minimal()
    node = body
    *parents, leaf = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return body


def _without(path: str) -> dict:
    body = _minimal()
    *parents, leaf = path.split(".")
    node = body
    for key in parents:
        node = node[key]
    del node[leaf]
    return body


INVALID = [
    # (body, the field the schema names, the error's words)
    (_without("spec.image"), "spec", "'image' is a required property"),
    (_without("spec.model.name"), "spec.model", "'name' is a required property"),
    (_with("spec.model.source", "s3"), "spec.model.source", "is not one of"),
    (_with("spec.kvTransfer.protocol", "udp"), "spec.kvTransfer.protocol", "is not one of"),
    (_with("spec.kvTransfer.backend", "nixl"), "spec.kvTransfer.backend", "is not one of"),
    (_with("spec.kvTransfer.bootstrapPort", 80), "spec.kvTransfer.bootstrapPort", "less than the minimum"),
    (_with("spec.prefill.replicas", -1), "spec.prefill.replicas", "less than the minimum"),
    (_with("spec.decode.replicas", "two"), "spec.decode.replicas", "is not of type 'integer'"),
    (_with("spec.decode.replica", 2), "spec.decode", "'replica' was unexpected"),
    (_with("spec.prefill.terminationGracePeriodSeconds", 5), "spec.prefill.terminationGracePeriodSeconds",
     "less than the minimum"),
    (_with("spec.router.service.type", "Ingress"), "spec.router.service.type", "is not one of"),
    (_with("spec.router.service.port", 70000), "spec.router.service.port", "greater than the maximum"),
    (_with("spec.router.prefillPolicy", "fastest"), "spec.router.prefillPolicy", "is not one of"),
    (_with("spec.autoscaling.decode.kvUsagePerReplica", 1.5), "spec.autoscaling.decode.kvUsagePerReplica",
     "greater than the maximum"),
    (_with("spec.autoscaling.prometheus.url", "prometheus:9090"), "spec.autoscaling.prometheus.url", "does not match"),
    (_with("spec.autoscaling.prefill.tolerance", 0.9), "spec.autoscaling.prefill.tolerance",
     "greater than the maximum"),
    (_with("spec.monitoring.interval", "often"), "spec.monitoring.interval", "does not match"),
    (_with("spec.prefill.tolerations", [{"key": "gpu", "operator": "Maybe"}]), "spec.prefill.tolerations.0.operator",
     "is not one of"),
    (_with("spec.prefill.engineArgs", "--max-total-tokens 4096"), "spec.prefill.engineArgs", "is not of type 'array'"),
    (_with("spec.model.huggingfaceId", "no-slash"), "spec.model.huggingfaceId", "does not match"),
    (_with("spec.networkPolicy.enabled", "no"), "spec.networkPolicy.enabled", "is not of type 'boolean'"),
    (_with("spec.networkPolicy.metricsFrom", [{"cidr": "monitoring"}]), "spec.networkPolicy.metricsFrom.0.cidr",
     "does not match"),
    (_with("spec.networkPolicy.routerFrom", [{"podLabels": {"app": 1}}]),
     "spec.networkPolicy.routerFrom.0.podLabels.app", "is not of type 'string'"),
]


@pytest.mark.parametrize("body,field,words", INVALID, ids=[i[1] + ":" + i[2] for i in INVALID])
def test_schema_rejects_invalid_specs_naming_the_field(body, field, words):
    errors = schema_errors(body)
    assert any(e.startswith(field + ":") and words in e for e in errors), errors
    # The operator's parser, which runs wherever the schema is not enforced, refuses it as well.
    with pytest.raises(SpecError) as e:
        parse_spec(body["metadata"]["name"], body["spec"])
    named = field.replace(".0.", "[0].")
    assert named in str(e.value) or field == "spec" and "spec.image" in str(e.value), str(e.value)


CROSS_FIELD = [
    # What the schema cannot express: the operator's checks, each naming the field to fix.
    (_with("spec.decode", {"replicas": 1, "minReplicas": 3, "maxReplicas": 2}), "spec.decode.minReplicas"),
    (_with("spec.prefill", {"replicas": 9}), "spec.prefill.replicas"),
    (_with("spec.decode.resources", {"limits": {"nvidia.com/gpu": 2}}), "spec.decode.resources.limits.nvidia.com/gpu"),
    (_with("spec.kvTransfer.protocol", "rdma"), "spec.kvTransfer.ibDevices"),
    (_with("spec.model.source", "pvc"), "spec.model.claimName"),
    (_with("spec.model", {"name": "m", "source": "gguf", "path": "relative.gguf"}), "spec.model.path"),
    (_with("spec.prefill.engineArgs", ["--port", "1"]), "spec.prefill.engineArgs[0]"),
    (_with("spec.router.extraArgs", ["--discovery-provider=kubernetes"]), "spec.router.extraArgs[0]"),
    (_with("spec.monitoring", {"serviceMonitor": True, "podMonitor": True}), "spec.monitoring"),
    (_with("metadata.name", "x" * 45), "metadata.name"),
    (_with("metadata.name", "1st-model"), "metadata.name"),
    (_with("spec.kvTransfer.ibDevices", ["mlx5_0"]), "spec.kvTransfer.ibDevices"),
    (_with("spec.decode.engineArgs", ["--metrics-p", "9"]), "spec.decode.engineArgs[0]"),
    (_with("spec.router.extraArgs", ["--service-discovery"]), "spec.router.extraArgs[0]"),
    (_with("spec.prefill.tolerations", [{"effect": "NoSchedule"}]), "spec.prefill.tolerations[0].key"),
    (_with("spec.router.tolerations", [{"operator": "Exists", "value": "x"}]), "spec.router.tolerations[0].value"),
    (_with("spec.decode.tolerations", [{"key": "k", "value": "v", "effect": "NoSchedule", "tolerationSeconds": 5}]),
     "spec.decode.tolerations[0].tolerationSeconds"),
    (_with("spec.networkPolicy.routerFrom", [{"cidr": "10.0.0.0/8", "podLabels": {"app": "lb"}}]),
     "spec.networkPolicy.routerFrom[0].cidr"),
    (_with("spec.networkPolicy.metricsFrom", [{"cidr": "10.0.0.0/40"}]), "spec.networkPolicy.metricsFrom[0].cidr"),
]


@pytest.mark.parametrize("body,field", CROSS_FIELD, ids=[c[1] for c in CROSS_FIELD])
def test_operator_rejects_specs_that_can_never_work(body, field):
    with pytest.raises(SpecError) as e:
        parse_spec(body["metadata"]["name"], body["spec"])
    assert e.value.path == field, str(e.value)
