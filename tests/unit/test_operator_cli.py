"""`tandem operator render -f FILE`: what the operator would create for a manifest, as YAML, with no
cluster; and plain `tandem operator` still parses to the operator's run."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import yaml

from tandem.cli.main import build_parser
from tandem.operator import main as operator_main
from tandem.operator import render
from tandem.operator.main import PLACEHOLDER_UID
from tandem.operator.spec import parse_spec

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    args = build_parser().parse_args(argv)
    rc = args.func(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_render_prints_every_object_of_the_example(capsys):
    """Multi-document YAML: the header comment names the placeholder uid; the StatefulSets, Services,
    router Deployment, PodDisruptionBudgets, monitor, NetworkPolicies and bootstrap-token Secret of examples/full.yaml, in
    its namespace, each owned by the InferenceService."""
    rc, out, err = run(["operator", "render", "-f", str(EXAMPLES / "full.yaml")], capsys)
    assert rc == 0 and err == ""
    assert out.startswith("# `tandem operator render`") and PLACEHOLDER_UID in out.split("---", 1)[0]
    docs = list(yaml.safe_load_all(out))
    assert all(docs)
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {("StatefulSet", "smollm2-gpu-prefill"), ("StatefulSet", "smollm2-gpu-decode"),
            ("Service", "smollm2-gpu-prefill"), ("Service", "smollm2-gpu-decode"), ("Service", "smollm2-gpu-router"),
            ("Service", "smollm2-gpu-router-metrics"), ("Deployment", "smollm2-gpu-router"),
            ("ConfigMap", "smollm2-gpu-router-workers"), ("ServiceMonitor", "smollm2-gpu"),
            ("NetworkPolicy", "smollm2-gpu-prefill"), ("NetworkPolicy", "smollm2-gpu-decode"),
            ("NetworkPolicy", "smollm2-gpu-router"), ("Secret", "smollm2-gpu-bootstrap-token")} <= names
    assert len(names) == len(docs) == 16  # and three PodDisruptionBudgets
    (secret,) = [d for d in docs if d["kind"] == "Secret"]  # the token itself is never rendered
    assert secret["stringData"]["tokens"].startswith("<random, made by the operator")
    for doc in docs:
        assert doc["metadata"]["namespace"] == "inference"
        (owner,) = doc["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"]) == ("InferenceService", "smollm2-gpu", PLACEHOLDER_UID)


def test_render_is_what_the_operator_renders(capsys):
    """The same objects render_all gives for the same spec, namespace and operator flags, given before
    or after `render`, and the bootstrap-token Secret the operator creates once (its token left out);
    a manifest without a namespace takes --namespace."""
    rc, out, _ = run(["operator", "--router-image", "r:1", "render", "-f", str(EXAMPLES / "minimal.yaml"),
                      "-n", "team-a", "--operator-namespace", "ops"], capsys)
    assert rc == 0
    body = yaml.safe_load((EXAMPLES / "minimal.yaml").read_text())
    inst = render.Instance(name="smollm2", namespace="team-a", uid=PLACEHOLDER_UID,
                           spec=parse_spec("smollm2", body["spec"]),
                           defaults=render.Defaults(router_image="r:1", operator_namespace="ops"))
    assert list(yaml.safe_load_all(out)) == [*render.render_all(inst, monitoring_available=True),
                                             render.render_bootstrap_secret(inst, None)]


def test_render_reads_several_services_from_stdin(capsys, monkeypatch):
    """`-f -` reads stdin; every InferenceService of a multi-document manifest is rendered."""
    text = (EXAMPLES / "minimal.yaml").read_text() + "---\n" + (EXAMPLES / "full.yaml").read_text()
    monkeypatch.setattr("sys.stdin", io.StringIO(text))
    rc, out, _ = run(["operator", "render", "-f", "-"], capsys)
    policies = {(d["metadata"]["namespace"], d["metadata"]["name"]) for d in yaml.safe_load_all(out)
                if d["kind"] == "NetworkPolicy"}
    services = (("default", "smollm2"), ("inference", "smollm2-gpu"))
    assert rc == 0 and policies == {(ns, f"{name}-{c}") for ns, name in services for c in ("prefill", "decode", "router")}


def test_render_with_policies_off_prints_none(capsys, tmp_path):
    body = yaml.safe_load((EXAMPLES / "minimal.yaml").read_text())
    body["spec"]["networkPolicy"] = {"enabled": False}
    manifest = tmp_path / "open.yaml"
    manifest.write_text(yaml.safe_dump(body))
    rc, out, _ = run(["operator", "render", "-f", str(manifest)], capsys)
    kinds = [d["kind"] for d in yaml.safe_load_all(out)]
    assert rc == 0 and "StatefulSet" in kinds and "NetworkPolicy" not in kinds


@pytest.mark.parametrize(("change", "words"), [
    ({"spec": {"prefill": {"replicas": 9}}}, "spec.prefill.replicas: 9 is outside"),
    ({"spec": {"networkPolicy": {"routerFrom": [{"cidr": "10.0.0.0/8", "podLabels": {"a": "b"}}]}}},
     "spec.networkPolicy.routerFrom[0].cidr"),
    ({"spec": {"decode": {"replica": 2}}}, "spec.decode.replica: unknown field"),
    ({"kind": "Deployment"}, "document 1 is a Deployment, not a tandem.dev/v1alpha1 InferenceService"),
    ({"metadata": {"name": "x" * 45}}, "metadata.name"),
    ({"metadata": {"name": "smollm2", "namespace": "prod"}},
     "metadata.namespace 'prod' differs from --namespace 'team-a'"),
])
def test_render_refuses_a_bad_manifest_naming_the_field(capsys, tmp_path, change, words):
    """The operator's own parser: the same error it would put in the InferenceService's status."""
    body = yaml.safe_load((EXAMPLES / "minimal.yaml").read_text())
    for key, value in change.items():
        body[key] = {**body[key], **value} if isinstance(value, dict) else value
    manifest = tmp_path / "bad.yaml"
    manifest.write_text(yaml.safe_dump(body))
    rc, out, err = run(["operator", "render", "-f", str(manifest), "-n", "team-a"], capsys)
    assert rc == 2 and out == ""
    assert err.startswith("error: ") and words in err, err


def test_render_of_a_missing_empty_or_broken_file_is_an_error(capsys, tmp_path):
    rc, out, err = run(["operator", "render", "-f", str(tmp_path / "none.yaml")], capsys)
    assert rc == 2 and out == "" and "none.yaml" in err
    (tmp_path / "empty.yaml").write_text("# nothing\n")
    rc, out, err = run(["operator", "render", "-f", str(tmp_path / "empty.yaml")], capsys)
    assert rc == 2 and out == "" and "no InferenceService" in err
    (tmp_path / "list.yaml").write_text("apiVersion: tandem.dev/v1alpha1\nkind: InferenceService\n"
                                        "metadata: {name: m}\nspec: [1, 2]\n")
    rc, out, err = run(["operator", "render", "-f", str(tmp_path / "list.yaml")], capsys)
    assert rc == 2 and out == "" and "spec: expected an object" in err, err


def test_plain_operator_still_runs_the_operator(monkeypatch):
    """Without a subcommand `tandem operator` keeps its flags and runs the operator."""
    args = build_parser().parse_args(["operator", "--namespace", "a", "--namespace", "b", "--router-image", "r:2",
                                      "--cluster-domain", "corp.example", "--operator-namespace", "ops",
                                      "--liveness-port", "0", "--metrics-port", "0"])
    assert args.operator_command is None
    assert (args.namespace, args.router_image, args.cluster_domain) == (["a", "b"], "r:2", "corp.example")
    assert (args.operator_namespace, args.liveness_port, args.metrics_port, args.peering) == ("ops", 0, 0, None)
    defaults = build_parser().parse_args(["operator"])
    assert (defaults.router_image, defaults.cluster_domain, defaults.operator_namespace) == (
        render.Defaults.router_image, render.Defaults.cluster_domain, None)
    ran = []
    monkeypatch.setattr(operator_main, "run", lambda a: ran.append(a) or 0)
    assert args.func(args) == 0 and ran == [args]
