"""The operator's renderers as pure functions: every object validates against the Kubernetes
OpenAPI schemas, and the fields that decide whether the service works are what they must be."""

from __future__ import annotations

import json
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from support.examples import UID, instance
from tandem.cli.main import build_parser
from tandem.operator import render
from tandem.operator.schema import SpecError

REPO = Path(__file__).resolve().parents[2]
K8S_VERSION = "1.33"


def by_kind(objects: list[dict]) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def container(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("example", ["minimal", "full"])
def test_every_rendered_object_validates_and_is_owned(example):
    inst = instance(example)
    objects = render.render_all(inst)
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # not a built-in kind: checked field by field below
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    for obj in objects:
        meta = obj["metadata"]
        assert meta["namespace"] == inst.namespace
        assert len(meta["name"]) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", meta["name"])
        assert meta["ownerReferences"] == [{"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService",
                                            "name": inst.name, "uid": UID, "controller": True,
                                            "blockOwnerDeletion": True}]
        assert all(len(v) <= 63 for v in meta["labels"].values())
    kinds = sorted(o["kind"] for o in objects)
    expected = ["ConfigMap", "Deployment", "NetworkPolicy", "NetworkPolicy", "NetworkPolicy", "PodDisruptionBudget",
                "PodDisruptionBudget", "PodDisruptionBudget", "Service", "Service", "Service", "Service", "StatefulSet",
                "StatefulSet"]
    assert kinds == sorted(expected + (["ServiceMonitor"] if example == "full" else []))


@pytest.mark.parametrize("example", ["minimal", "full"])
def test_selectors_match_the_pods_they_select(example):
    inst = instance(example)
    objects = by_kind(render.render_all(inst))
    for pool in ("prefill", "decode"):
        sts = objects["StatefulSet", inst.pool_name(pool)]
        pod_labels = sts["spec"]["template"]["metadata"]["labels"]
        assert sts["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        svc = objects["Service", sts["spec"]["serviceName"]]
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
        assert svc["spec"]["selector"].items() <= pod_labels.items()
        pdb = objects["PodDisruptionBudget", sts["metadata"]["name"]]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        other = "decode" if pool == "prefill" else "prefill"
        other_labels = objects["StatefulSet", inst.pool_name(other)]["spec"]["template"]["metadata"]["labels"]
        assert not svc["spec"]["selector"].items() <= other_labels.items(), "a pool's Service must not select the other pool"
        policy = objects["NetworkPolicy", sts["metadata"]["name"]]
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
        assert not policy["spec"]["podSelector"]["matchLabels"].items() <= other_labels.items()
    router = next(o for o in objects.values() if o["kind"] == "Deployment")
    router_labels = router["spec"]["template"]["metadata"]["labels"]
    assert objects["Service", router["metadata"]["name"]]["spec"]["selector"].items() <= router_labels.items()
    policy = objects["NetworkPolicy", router["metadata"]["name"]]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= router_labels.items()


def test_minimal_pools_run_tandem_serve_with_probes_and_ports():
    inst = instance("minimal")
    objects = by_kind(render.render_all(inst))
    for pool in ("prefill", "decode"):
        sts = objects["StatefulSet", f"smollm2-{pool}"]
        c = container(sts)
        assert c["image"] == "ghcr.io/tandem-serving/tandem-server-cpu:0.1.0" and c["command"] == ["tandem"]
        # The arguments are real `tandem serve` flags with the values the spec asks for.
        args = build_parser().parse_args([a.replace("$(POD_IP)", "10.0.0.7") for a in c["args"]])
        assert (args.role, args.host, args.port, args.metrics_port) == (pool, "0.0.0.0", 30000, 30001)
        assert (args.model, args.served_model_name, args.dtype, args.device) == (
            "builtin:smollm2-135m", "smollm2-135m-instruct", "bfloat16", "cpu")
        assert args.advertise_host == "10.0.0.7" and args.kv_transfer_protocol == "tcp"
        assert args.drain_grace_seconds == sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] - 10
        assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in c["env"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports == ({"grpc": 30000, "metrics": 30001} | ({"bootstrap": 8998} if pool == "prefill" else {}))
        assert c["readinessProbe"]["grpc"] == {"port": 30000} and c["startupProbe"]["grpc"] == {"port": 30000}
        assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] == 1800
        assert c["livenessProbe"]["tcpSocket"] == {"port": "metrics"}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
        assert "resources" not in c and sts["spec"]["replicas"] == 1
        assert sts["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    prefill_args = container(objects["StatefulSet", "smollm2-prefill"])["args"]
    assert prefill_args[prefill_args.index("--bootstrap-port") + 1] == "8998"
    assert "--bootstrap-port" not in container(objects["StatefulSet", "smollm2-decode"])["args"]


def test_full_example_gpus_scheduling_rdma_and_model_claim():
    inst = instance("full")
    objects = by_kind(render.render_all(inst))
    prefill = objects["StatefulSet", "smollm2-gpu-prefill"]
    c, pod = container(prefill), prefill["spec"]["template"]["spec"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "3" and c["resources"]["requests"]["nvidia.com/gpu"] == "3"
    args = build_parser().parse_args(c["args"])
    assert args.device == "cuda" and args.model == "/models/smollm2/SmolLM2-135M-Instruct.gguf"
    assert args.tp_size == 3  # a prefill server over 3 GPUs; the decode pool's servers use one each
    assert build_parser().parse_args(container(objects["StatefulSet", "smollm2-gpu-decode"])["args"]).tp_size == 1
    assert args.kv_transfer_protocol == "rdma" and args.ib_device == "mlx5_0,mlx5_1"
    assert (args.max_prefill_tokens, args.chunked_prefill_size) == (16384, 4096)
    assert c["resources"]["requests"]["rdma/rdma_shared_device_a"] == "1"  # device plugin resources are requested
    assert {"mountPath": "/models", "name": "model", "readOnly": True} in c["volumeMounts"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod["volumes"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["weight"] == 100
    assert pod["terminationGracePeriodSeconds"] == 180 and args.drain_grace_seconds == 170
    assert pod["imagePullSecrets"] == [{"name": "ghcr-pull"}]
    assert {"name": "TANDEM_LOG_LEVEL", "value": "info"} in c["env"]
    assert objects["StatefulSet", "smollm2-gpu-decode"]["spec"]["replicas"] == 3
    monitor = objects["ServiceMonitor", "smollm2-gpu"]
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s"}]
    # The monitor selects the Services that carry a `metrics` port: both pools' and the router's own.
    scraped = [o for o in objects.values() if o["kind"] == "Service" and "metrics" in {p["name"] for p in o["spec"]["ports"]}]
    assert sorted(o["metadata"]["name"] for o in scraped) == ["smollm2-gpu-decode", "smollm2-gpu-prefill",
                                                              "smollm2-gpu-router-metrics"]
    sel = monitor["spec"]["selector"]
    for svc in scraped:
        labels = svc["metadata"]["labels"]
        assert sel["matchLabels"].items() <= labels.items()
        assert labels["app.kubernetes.io/component"] in sel["matchExpressions"][0]["values"]
    # The client Service (a LoadBalancer here) exposes the API only.
    assert [p["name"] for p in objects["Service", "smollm2-gpu-router"]["spec"]["ports"]] == ["http"]


@pytest.mark.parametrize("shm, expected", [("1Gi", "4Gi"), ("8Gi", "8Gi")])
def test_tensor_parallel_pools_request_a_gpu_per_rank_and_shm_for_nccl(shm, expected):
    body = yaml.safe_load((REPO / "examples" / "full.yaml").read_text())
    decode = {**body["spec"]["decode"], "tensorParallelSize": 2, "shmSize": shm,
              "resources": {"limits": {"memory": "32Gi", "nvidia.com/gpu": 2}}}
    objects = by_kind(render.render_all(instance("full", decode=decode)))
    sts = objects["StatefulSet", "smollm2-gpu-decode"]
    kubernetes_validate.validate(sts, K8S_VERSION, strict=True)
    c, pod = container(sts), sts["spec"]["template"]["spec"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2" and c["resources"]["requests"]["nvidia.com/gpu"] == "2"
    assert build_parser().parse_args(c["args"]).tp_size == 2
    dshm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": expected}
    # GPUs and ranks that disagree are refused, naming both.
    with pytest.raises(SpecError, match=r"spec.decode.resources.limits.nvidia.com/gpu: 2: a server uses one GPU per "
                                        "tensor-parallel rank, and tensorParallelSize is 3"):
        instance("full", decode={**decode, "tensorParallelSize": 3})
    # The operator sets --tp-size itself.
    with pytest.raises(SpecError, match=r"spec.decode.engineArgs\[0\]: --tp-size sets --tp-size"):
        instance("full", decode={**decode, "engineArgs": ["--tp-size", "2"]})


def test_huggingface_model_reads_the_cache_claim_offline():
    inst = instance("minimal", model={"name": "smol", "source": "huggingface", "claimName": "hf-cache",
                                      "huggingfaceId": "HuggingFaceTB/SmolLM2-135M-Instruct"})
    c = container(render.render_statefulset(inst, "decode"))
    assert build_parser().parse_args(c["args"]).model == "hf:HuggingFaceTB/SmolLM2-135M-Instruct"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["HF_HOME"] == "/models" and env["HF_HUB_OFFLINE"] == "1"


def test_router_sees_every_pod_by_stable_dns_name():
    inst = instance("full")
    objects = by_kind(render.render_all(inst))
    manifest = json.loads(objects["ConfigMap", "smollm2-gpu-router-workers"]["data"]["workers.json"])
    assert manifest["version"] == 1
    by_type = {}
    for worker in manifest["workers"]:
        by_type.setdefault(worker["worker_type"], []).append(worker)
    for pool, replicas in (("prefill", 2), ("decode", 3)):
        sts = objects["StatefulSet", f"smollm2-gpu-{pool}"]
        assert len(by_type[pool]) == sts["spec"]["replicas"] == replicas
        for i, worker in enumerate(by_type[pool]):
            pod = f"{sts['metadata']['name']}-{i}"
            host = f"{pod}.{sts['spec']['serviceName']}.inference.svc.cluster.local"
            assert worker["id"] == pod and worker["url"] == f"grpc://{host}:30000"
            bootstrap = {p["name"]: p["containerPort"] for p in container(sts)["ports"]}.get("bootstrap")
            assert worker.get("bootstrap_port") == bootstrap  # prefill: 8998, decode: none
    router = objects["Deployment", "smollm2-gpu-router"]
    c, pod = container(router), router["spec"]["template"]["spec"]
    assert c["image"] == "ghcr.io/tandem-serving/tandem-router:0.1.0" and c["command"] == ["smg"]
    mount = next(m for m in c["volumeMounts"] if m["name"] == "workers")
    volume = next(v for v in pod["volumes"] if v["name"] == "workers")
    assert volume["configMap"]["name"] == "smollm2-gpu-router-workers" and "subPath" not in mount
    assert f"{mount['mountPath']}/workers.json" == c["args"][c["args"].index("--discovery-file") + 1]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readiness" and c["livenessProbe"]["httpGet"]["path"] == "/liveness"
    assert router["spec"]["replicas"] == 2 and pod["terminationGracePeriodSeconds"] == 300
    svc = objects["Service", "smollm2-gpu-router"]
    assert svc["spec"]["type"] == "LoadBalancer" and svc["spec"]["ports"][0]["port"] == 80
    assert svc["spec"]["ports"][0]["targetPort"] == "http"


def test_disabled_parts_are_not_rendered():
    inst = instance("minimal", prefill={"podDisruptionBudget": {"enabled": False}})
    kinds = by_kind(render.render_all(inst))
    assert ("PodDisruptionBudget", "smollm2-prefill") not in kinds and ("PodDisruptionBudget", "smollm2-decode") in kinds
    monitored = instance("full")
    assert not any(o["kind"] == "ServiceMonitor" for o in render.render_all(monitored, monitoring_available=False))
    open_network = instance("minimal", networkPolicy={"enabled": False})
    assert not any(o["kind"] == "NetworkPolicy" for o in render.render_all(open_network))


def test_router_picks_servers_by_cached_prefix_unless_told_otherwise():
    """cache_aware for both pools: the servers' KV events tell the router where each prefix is
    cached (measured by `tandem bench cache-routing`, and with `--pd` for the decodes, whose cache
    spares KV transfer)."""
    def policies(inst):
        args = container(by_kind(render.render_all(inst))["Deployment", f"{inst.name}-router"])["args"]
        return args[args.index("--prefill-policy") + 1], args[args.index("--decode-policy") + 1]

    assert policies(instance("minimal")) == ("cache_aware", "cache_aware")
    assert policies(instance("minimal", router={"prefillPolicy": "round_robin", "decodePolicy": "power_of_two"})) == (
        "round_robin", "power_of_two")


def test_both_pools_mount_the_bootstrap_token_secret_the_operator_creates_once():
    inst = instance("minimal")
    objects = by_kind(render.render_all(inst))
    for pool in ("prefill", "decode"):
        sts = objects["StatefulSet", f"smollm2-{pool}"]
        args = container(sts)["args"]
        assert args[args.index("--bootstrap-token-file") + 1] == "/etc/tandem/bootstrap/tokens"
        (volume,) = [v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "bootstrap-token"]
        assert volume["secret"] == {"secretName": "smollm2-bootstrap-token", "defaultMode": 0o440}  # fsGroup reads it
        (mount,) = [m for m in container(sts)["volumeMounts"] if m["name"] == "bootstrap-token"]
        assert mount == {"name": "bootstrap-token", "mountPath": "/etc/tandem/bootstrap", "readOnly": True}
    assert "Secret" not in {kind for kind, _ in objects}  # applied objects never carry the token
    secret = render.render_bootstrap_secret(inst, "t0ken")
    assert secret["stringData"] == {"tokens": "t0ken\n"} and secret["metadata"]["ownerReferences"][0]["uid"] == UID
    kubernetes_validate.validate(secret, "1.33", strict=True)


class FakeKube:
    def __init__(self, existing: bool):
        self.existing, self.created = existing, []

    def exists(self, api_version, kind, namespace, name):
        assert (api_version, kind, namespace, name) == ("v1", "Secret", "default", "smollm2-bootstrap-token")
        return self.existing

    def create(self, obj):
        self.created.append(obj)
        return True


def test_the_operator_creates_the_token_once_and_never_rewrites_it(monkeypatch):
    from tandem.operator import handlers

    monkeypatch.setattr(handlers.kopf, "info", lambda *a, **k: None)
    inst = instance("minimal")
    fresh, kept = FakeKube(existing=False), FakeKube(existing=True)
    handlers._ensure_bootstrap_secret(fresh, {}, inst)
    handlers._ensure_bootstrap_secret(kept, {}, inst)
    assert kept.created == []
    (secret,) = fresh.created
    token = secret["stringData"]["tokens"].strip()
    assert len(token) >= 40 and token != render.render_bootstrap_secret(instance("minimal"), None)["stringData"]["tokens"]


def test_router_api_keys_come_from_the_named_secret_as_tenant_keys():
    inst = instance("minimal", router={"apiKeys": {"secretName": "client-keys", "keys": ["current", "next"]}})
    deployment = render.render_router_deployment(inst)
    kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
    c = container(deployment)
    assert c["args"][-4:] == ["--tenant-api-key", "current:$(TANDEM_ROUTER_API_KEY_0)",
                              "--tenant-api-key", "next:$(TANDEM_ROUTER_API_KEY_1)"]
    assert [e for e in c["env"] if "valueFrom" in e] == [
        {"name": "TANDEM_ROUTER_API_KEY_0", "valueFrom": {"secretKeyRef": {"name": "client-keys", "key": "current"}}},
        {"name": "TANDEM_ROUTER_API_KEY_1", "valueFrom": {"secretKeyRef": {"name": "client-keys", "key": "next"}}}]
    assert "--tenant-api-key" not in container(render.render_router_deployment(instance("minimal")))["args"]


@pytest.mark.parametrize("api_keys, field", [
    ({"secretName": "k", "keys": []}, "spec.router.apiKeys.keys"),
    ({"secretName": "k", "keys": ["a", "a"]}, "spec.router.apiKeys.keys"),
    ({"secretName": "k", "keys": ["a b"]}, "spec.router.apiKeys.keys[0]"),
    ({"keys": ["a"]}, "spec.router.apiKeys.secretName"),
])
def test_router_api_keys_refused_by_field(api_keys, field):
    with pytest.raises(SpecError) as e:
        instance("minimal", router={"apiKeys": api_keys})
    assert e.value.path == field


def test_key_flags_are_the_specs_not_extra_args():
    with pytest.raises(SpecError) as e:
        instance("minimal", router={"extraArgs": ["--api-key", "x"]})
    assert e.value.path == "spec.router.extraArgs[0]"


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_servers_record_engine_failures_on_the_cache_volume(pool):
    """TANDEM_CRASH_LOG lies on an emptyDir, so a restarted container still counts the failure that
    restarted it (tandem_engine_crashes_total, the TandemEngineCrashed alert)."""
    sts = render.render_statefulset(instance("minimal"), pool)
    c = container(sts)
    path = {e["name"]: e.get("value") for e in c["env"]}["TANDEM_CRASH_LOG"]
    mount = next(m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    volume = next(v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    assert "emptyDir" in volume and not mount.get("readOnly")
