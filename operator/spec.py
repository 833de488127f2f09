"""The InferenceService API (tandem.dev/v1alpha1): spec and status, declared once.

`crd.py` generates `crds/inferenceservices.tandem.dev.yaml` from these classes; the operator
parses every custom resource with `parse_spec`, which applies the same defaults and then the
checks a schema cannot express (min <= replicas <= max, a model source's required field, ...).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from tandem.operator.schema import FreeForm, Quantity, SpecError, api_field, parse

GROUP = "tandem.dev"
VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SHORT_NAME = "tisvc"
POOLS = ("prefill", "decode")  # an InferenceService's two server pools, in this order everywhere

# Pod, Service and StatefulSet names are built from the InferenceService's name; a StatefulSet's
# pods carry a `controller-revision-hash` label of `<statefulset>-<10 chars>`, which must fit in 63.
MAX_NAME_LENGTH = 44
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
SECRET_KEY = r"^[-._a-zA-Z0-9]+$"
DURATION = r"^[0-9]+(ms|s|m|h)$"

MODEL_SOURCES = ("builtin", "gguf", "pvc", "huggingface")
DTYPES = ("bfloat16", "float16", "float32")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")
# smg's policies that need no further configuration; `bucket` exists for prefill only.
DECODE_POLICIES = ("power_of_two", "cache_aware", "round_robin", "random", "least_load", "prefix_hash")
PREFILL_POLICIES = (*DECODE_POLICIES, "bucket")
# Service names (DNS-1035): a letter first, no dots.
SERVICE_NAME = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
# The label Kubernetes (1.21+) puts on every namespace, holding its name: a namespace by name in a selector.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
MONITORING_NAMESPACE = "monitoring"
CIDR = r"^[0-9a-fA-F.:]+/[0-9]{1,3}$"


# --------------------------------------------------------------------------------------------- spec


@dataclass(frozen=True)
class ModelSpec:
    """The model every pod of this service loads, and the name clients ask for."""

    name: str = api_field(doc="Model id clients send (OpenAI `model`, gRPC served model name).",
                          pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")
    source: str = api_field("builtin", "Where the weights come from: `builtin` (shipped with the server "
                            "image), `gguf` (a .gguf file in the image), `pvc` (a .gguf file or a "
                            "safetensors directory on a PersistentVolumeClaim) or `huggingface` (a "
                            "Hugging Face id, read offline from a pre-populated cache on a claim).",
                            enum=MODEL_SOURCES)
    builtin: str = api_field("smollm2-135m", "source=builtin: which built-in model.",
                             pattern=r"^[a-z0-9][a-z0-9.-]*$")
    path: str | None = api_field(None, "source=gguf: absolute path of the .gguf file in the image. "
                                 "source=pvc: path of the file or directory inside the claim.")
    huggingface_id: str | None = api_field(None, "source=huggingface: the repository id, e.g. "
                                           "`HuggingFaceTB/SmolLM2-135M-Instruct`.",
                                           pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9._-]+$")
    claim_name: str | None = api_field(None, "source=pvc|huggingface: the PersistentVolumeClaim, "
                                       "mounted read-only (the Hugging Face cache for huggingface).",
                                       pattern=DNS_LABEL)
    dtype: str = api_field("bfloat16", "Weight and activation dtype.", enum=DTYPES)


@dataclass(frozen=True)
class Resources:
    """Container resources. GPUs are `nvidia.com/gpu` limits; the operator copies them to requests."""

    requests: dict[str, Quantity] = api_field({}, "Minimum resources, e.g. cpu: \"4\", memory: 16Gi.")
    limits: dict[str, Quantity] = api_field({}, "Maximum resources, e.g. nvidia.com/gpu: 1.")


@dataclass(frozen=True)
class Toleration:
    """A Kubernetes toleration."""

    key: str | None = api_field(None, "Taint key; empty with operator Exists matches every taint.")
    operator: str = api_field("Equal", "Equal or Exists.", enum=("Equal", "Exists"))
    value: str | None = api_field(None, "Taint value for operator Equal.")
    effect: str | None = api_field(None, "NoSchedule, PreferNoSchedule or NoExecute; empty matches all.",
                                   enum=("NoSchedule", "PreferNoSchedule", "NoExecute"))
    toleration_seconds: int | None = api_field(None, "How long a NoExecute taint is tolerated.", minimum=0)


@dataclass(frozen=True)
class DisruptionBudget:
    """A PodDisruptionBudget for the pool: voluntary evictions (drains, upgrades) take at most
    `maxUnavailable` pods at once."""

    enabled: bool = api_field(True, "Create the PodDisruptionBudget.")
    max_unavailable: int = api_field(1, "Pods that may be evicted at once.", minimum=1)


@dataclass(frozen=True)
class PoolSpec:
    """One pool of tandem servers (a StatefulSet): prefill or decode."""

    replicas: int = api_field(1, "Servers in the pool. With autoscaling on, the starting size.", minimum=0)
    min_replicas: int = api_field(1, "Lower bound for the autoscaler.", minimum=0)
    max_replicas: int = api_field(8, "Upper bound for the autoscaler.", minimum=1)
    resources: Resources = api_field(Resources(), "Per-server resources, including nvidia.com/gpu.")
    tensor_parallel_size: int = api_field(1, "Ranks one server shards the model over (`tandem serve "
                                          "--tp-size`): one GPU each where the pool has GPUs, whose "
                                          "nvidia.com/gpu must then equal it; CPU ranks otherwise. Must "
                                          "divide the model's query and KV heads.", minimum=1)
    engine_args: list[str] = api_field([], "Extra `tandem serve` flags, e.g. [--max-total-tokens, \"65536\"]. "
                                       "Flags the operator sets itself are refused.")
    env: dict[str, str] = api_field({}, "Extra environment variables for the server container.")
    node_selector: dict[str, str] = api_field({}, "Node labels the pods must match.")
    tolerations: list[Toleration] = api_field([], "Taints the pods tolerate (e.g. nvidia.com/gpu).")
    affinity: FreeForm = api_field({}, "A Kubernetes Affinity, passed through to the pods.")
    pod_disruption_budget: DisruptionBudget = api_field(DisruptionBudget(), "Eviction budget for the pool.")
    termination_grace_period_seconds: int = api_field(
        120, "Seconds a stopping server gets to finish in-flight requests before it is killed; the "
        "server drains for this long minus 10 s.", minimum=15)
    startup_timeout_seconds: int = api_field(
        1800, "Seconds a new server may take to load the model (and compile kernels) before it is "
        "restarted.", minimum=30)
    shm_size: Quantity = api_field(Quantity("1Gi"), "Size of the in-memory /dev/shm volume; GPU pools "
                                   "with tensorParallelSize > 1 get at least 2Gi per rank (NCCL's buffers).")


@dataclass(frozen=True)
class ServicePort:
    """How clients reach the router."""

    type: str = api_field("ClusterIP", "Service type.", enum=SERVICE_TYPES)
    port: int = api_field(8000, "Port of the OpenAI-compatible HTTP API.", minimum=1, maximum=65535)
    annotations: dict[str, str] = api_field({}, "Annotations on the Service (e.g. for a cloud load balancer).")


@dataclass(frozen=True)
class RouterApiKeys:
    """Client API keys the router requires (`Authorization: Bearer <key>`), from a Secret."""

    secret_name: str = api_field(doc="Secret in the InferenceService's namespace holding the keys.", pattern=DNS_SUBDOMAIN)
    keys: list[str] = api_field(["api-key"], "The Secret's keys whose values are accepted, each one key (and "
                                "the router's name for whoever holds it). Two during a rotation.")


@dataclass(frozen=True)
class RouterSpec:
    """The smg router in front of the pools: tokenizes, picks a prefill and a decode server, and
    serves OpenAI-compatible HTTP."""

    replicas: int = api_field(1, "Router pods.", minimum=1)
    image: str | None = api_field(None, "Router image (default: the operator's configured router image).")
    prefill_policy: str = api_field(
        "cache_aware", "How a prefill server is picked. cache_aware: where the prompt's prefix is cached, as the "
        "servers' KV events tell the router (tandem bench cache-routing), balanced against load.", enum=PREFILL_POLICIES)
    decode_policy: str = api_field(
        "cache_aware", "How a decode server is picked. cache_aware: where the prompt's prefix is cached, so that "
        "less KV moves from the prefill (decode-side prefix reuse; tandem bench cache-routing --pd).",
        enum=DECODE_POLICIES)
    service: ServicePort = api_field(ServicePort(), "The client Service.")
    resources: Resources = api_field(Resources(), "Router container resources.")
    extra_args: list[str] = api_field([], "Extra `smg launch` flags.")
    node_selector: dict[str, str] = api_field({}, "Node labels the router pods must match.")
    tolerations: list[Toleration] = api_field([], "Taints the router pods tolerate.")
    pod_disruption_budget: DisruptionBudget = api_field(DisruptionBudget(), "Eviction budget for the router.")
    api_keys: RouterApiKeys | None = api_field(
        None, "Client API keys: requests without one of them get 401 from the router. Unset: no key is asked.")


@dataclass(frozen=True)
class KVTransferSpec:
    """How prefill servers hand KV cache to decode servers."""

    backend: str = api_field("mooncake", "Transfer engine.", enum=("mooncake",))
    protocol: str = api_field("tcp", "Mooncake transport: rdma (InfiniBand/RoCE) or tcp.", enum=("tcp", "rdma"))
    ib_devices: list[str] = api_field([], "RDMA devices, e.g. [mlx5_0, mlx5_1]; required for rdma.")
    bootstrap_port: int = api_field(8998, "Port of each prefill server's bootstrap service.",
                                    minimum=1024, maximum=65535)
    bootstrap_timeout_seconds: int = api_field(
        30, "Seconds one leg of a request waits for the other; the router's PD admission wait stays "
        "below it.", minimum=5)


@dataclass(frozen=True)
class PoolAutoscaling:
    """Windows and limits shared by both pools. Load is counted in replica units: 1.0 is one
    server at its target."""

    stable_window_seconds: int = api_field(120, "Scale to ceil(mean load over this window).", minimum=1)
    panic_window_seconds: int = api_field(20, "When the mean load over this window reaches panicThreshold "
                                          "x replicas, scale up at once (at most doubling) and never down "
                                          "until a stable window passes without panic.", minimum=1)
    panic_threshold: float = api_field(2.0, "Panic when load >= this many times the current replicas.",
                                       minimum=1.0)
    tolerance: float = api_field(0.1, "Deadband: no change while load is within this fraction of the "
                                 "current replicas.", minimum=0.0, maximum=0.5)
    scale_down_window_seconds: int = api_field(300, "Scale down (one server at a time) only when every "
                                               "recommendation over this window allows it.", minimum=0)
    drain_timeout_seconds: int = api_field(120, "A server leaving the pool gets this long to finish its "
                                           "requests before its pod is removed.", minimum=0)


@dataclass(frozen=True)
class PrefillAutoscaling(PoolAutoscaling):
    """Prefill load: (waiting + bootstrap-queue requests) / waitingPerReplica, or, with
    queueSecondsPerReplica, queued prompt tokens / (queueSecondsPerReplica x measured prefill
    tokens/s of one server)."""

    waiting_per_replica: float = api_field(4.0, "Waiting + bootstrap-queue requests one server should hold.",
                                           minimum=0.001)
    queue_seconds_per_replica: float | None = api_field(
        None, "When set, size the pool by queued prompt tokens instead: seconds of prefill work one "
        "server may have queued.", minimum=0.001)


@dataclass(frozen=True)
class DecodeAutoscaling(PoolAutoscaling):
    """Decode load: max(KV usage / kvUsagePerReplica, (waiting + prealloc-queue requests) /
    waitingPerReplica), summed over the servers."""

    scale_down_window_seconds: int = api_field(600, "Scale down (one server at a time) only when every "
                                               "recommendation over this window allows it.", minimum=0)
    drain_timeout_seconds: int = api_field(600, "A server leaving the pool gets this long to finish its "
                                           "requests before its pod is removed.", minimum=0)
    kv_usage_per_replica: float = api_field(0.8, "Fraction of its KV pages one server should have in use.",
                                            minimum=0.001, maximum=1.0)
    waiting_per_replica: float = api_field(2.0, "Waiting + prealloc-queue requests one server should hold.",
                                           minimum=0.001)


@dataclass(frozen=True)
class PrometheusSpec:
    """Read the servers' signals from Prometheus instead of scraping each pod."""

    url: str | None = api_field(None, "Base URL of the Prometheus HTTP API, e.g. "
                                "http://prometheus-operated.monitoring:9090. Series must carry `namespace` "
                                "and `pod` labels (what ServiceMonitor/PodMonitor scrapes add).",
                                pattern=r"^https?://\S+$")


@dataclass(frozen=True)
class AutoscalingSpec:
    """Queue-driven scaling of each pool, independently, between its minReplicas and maxReplicas."""

    enabled: bool = api_field(False, "Let the operator set each pool's replicas (spec replicas is then "
                              "the starting size).")
    interval_seconds: int = api_field(15, "Seconds between samples and decisions.", minimum=1)
    prometheus: PrometheusSpec = api_field(PrometheusSpec(), "Optional: where to read signals. "
                                         "Default: each ready server's /metrics.")
    router_settle_seconds: int = api_field(
        60, "A server taken out of the router's worker list keeps serving at least this long before its "
        "pod may be removed (kubelet ConfigMap sync plus the router's reread).", minimum=0)
    prefill: PrefillAutoscaling = api_field(PrefillAutoscaling(), "Prefill pool.")
    decode: DecodeAutoscaling = api_field(DecodeAutoscaling(), "Decode pool.")


@dataclass(frozen=True)
class MonitoringSpec:
    """Prometheus Operator scraping of the servers' and router's /metrics."""

    service_monitor: bool = api_field(False, "Create a ServiceMonitor (needs the monitoring.coreos.com CRDs).")
    pod_monitor: bool = api_field(False, "Create a PodMonitor instead (needs the monitoring.coreos.com CRDs).")
    interval: str = api_field("15s", "Scrape interval.", pattern=DURATION)
    labels: dict[str, str] = api_field({}, "Labels your Prometheus selects monitors by.")


@dataclass(frozen=True)
class NetworkPeer:
    """Who may connect, as a NetworkPolicy peer: the pods carrying `podLabels` in the namespaces
    carrying `namespaceLabels`, or the addresses in `cidr`."""

    namespace_labels: dict[str, str] | None = api_field(
        None, "Labels of the namespaces the pods run in, e.g. {kubernetes.io/metadata.name: monitoring}. Left "
        "out: the InferenceService's own namespace; {}: every namespace.")
    pod_labels: dict[str, str] = api_field({}, "Labels the pods carry; {}: every pod of those namespaces.")
    cidr: str | None = api_field(None, "Instead of pods: an IP range, e.g. 10.0.0.0/8 (0.0.0.0/0: every IPv4 "
                                 "address); leave namespaceLabels and podLabels out.", pattern=CIDR)


@dataclass(frozen=True)
class NetworkPolicySpec:
    """NetworkPolicies that admit to each pod only the traffic the service needs (ingress only;
    egress is not restricted). They take effect where the cluster's network plugin enforces
    NetworkPolicy (Calico, Cilium, ...)."""

    enabled: bool = api_field(True, "Create the NetworkPolicies. Turn off where the network plugin does not "
                              "enforce them, or to write your own.")
    router_from: list[NetworkPeer] | None = api_field(
        None, "Who may call the router's HTTP API (and its health port); [] admits nobody. Left out: every "
        "pod of the InferenceService's namespace for a ClusterIP Service, every source for a NodePort or "
        "LoadBalancer Service (which exists to be reached from outside the cluster).")
    metrics_from: list[NetworkPeer] = api_field(
        [NetworkPeer(namespace_labels={NAMESPACE_NAME_LABEL: MONITORING_NAMESPACE})],
        "Who may scrape the servers' and the router's /metrics (the operator's own pods always may read the "
        "servers'); [] admits nobody else. Default: every pod of the namespace named monitoring.")


@dataclass(frozen=True)
class InferenceServiceSpec:
    """A model served by a prefill pool, a decode pool and a router."""

    model: ModelSpec = api_field(doc="The model.")
    image: str = api_field(doc="tandem server image for both pools.", pattern=r"^\S+$")
    image_pull_policy: str = api_field("IfNotPresent", "Pull policy for every image.", enum=PULL_POLICIES)
    image_pull_secrets: list[str] = api_field([], "Secrets for private registries.")
    prefill: PoolSpec = api_field(PoolSpec(), "The prefill pool.")
    decode: PoolSpec = api_field(PoolSpec(), "The decode pool.")
    router: RouterSpec = api_field(RouterSpec(), "The router.")
    kv_transfer: KVTransferSpec = api_field(KVTransferSpec(), "KV cache transfer between the pools.")
    autoscaling: AutoscalingSpec = api_field(AutoscalingSpec(), "Pool autoscaling.")
    monitoring: MonitoringSpec = api_field(MonitoringSpec(), "Prometheus Operator monitors.")
    network_policy: NetworkPolicySpec = api_field(NetworkPolicySpec(), "NetworkPolicies around the pods.")


# --------------------------------------------------------------------------------------------- status


@dataclass(frozen=True)
class Condition:
    """A standard Kubernetes condition."""

    type: str = api_field(doc="Ready, PrefillReady, DecodeReady, RouterReady, Progressing, Degraded "
                          "or AutoscalerHealthy.")
    status: str = api_field(doc="True, False or Unknown.", enum=("True", "False", "Unknown"))
    reason: str = api_field("", "One CamelCase word.")
    message: str = api_field("", "What happened, for people.")
    last_transition_time: str | None = api_field(None, "When status last changed.", fmt="date-time")
    observed_generation: int | None = api_field(None, "The spec generation this condition describes.")


@dataclass(frozen=True)
class ScalingDecision:
    """The autoscaler's last change to a pool."""

    time: str = api_field(doc="When it was made.", fmt="date-time")
    from_replicas: int = api_field(doc="Replicas before.")
    to_replicas: int = api_field(doc="Replicas after.")
    reason: str = api_field(doc="Why, with the numbers.")


@dataclass(frozen=True)
class PoolSignals:
    """The autoscaler's last sample of a pool."""

    time: str = api_field(doc="When the servers were sampled.", fmt="date-time")
    load: float = api_field(doc="Load in replica units (1.0 = one server at its target).")
    servers: int = api_field(doc="Ready servers whose metrics were read.")
    values: dict[str, float] = api_field({}, "The signals summed over those servers (waiting, kvUsage, ...).")


@dataclass(frozen=True)
class Drain:
    """A server leaving the pool: out of the router's worker list, finishing its requests."""

    pod: str = api_field(doc="The pod being drained (the pool's highest ordinal).")
    since: str = api_field(doc="When it left the router's worker list.", fmt="date-time")


@dataclass(frozen=True)
class PoolStatus:
    """What a pool's StatefulSet reports."""

    desired_replicas: int = api_field(0, "Replicas the operator asks for.")
    replicas: int = api_field(0, "Pods that exist.")
    ready_replicas: int = api_field(0, "Pods that pass their readiness probe.")
    ready: str = api_field("0/0", "ready/desired, for `kubectl get`.")
    last_scaling: ScalingDecision | None = api_field(None, "The autoscaler's last decision.")
    signals: PoolSignals | None = api_field(None, "The autoscaler's last sample.")
    draining: Drain | None = api_field(None, "The server being drained before its pod is removed.")


@dataclass(frozen=True)
class RouterStatus:
    """What the router Deployment reports."""

    replicas: int = api_field(0, "Router pods that exist.")
    ready_replicas: int = api_field(0, "Router pods with at least one ready prefill and decode server.")
    endpoint: str = api_field("", "In-cluster URL of the OpenAI-compatible API.")


@dataclass(frozen=True)
class InferenceServiceStatus:
    """Observed state, written by the operator."""

    observed_generation: int = api_field(0, "The spec generation last acted on.")
    phase: str = api_field("Pending", "Pending, Progressing, Ready or Failed (a spec that can never work).",
                           enum=("Pending", "Progressing", "Ready", "Failed"))
    conditions: list[Condition] = api_field([], "Ready, PrefillReady, DecodeReady, RouterReady, "
                                            "Progressing, Degraded, AutoscalerHealthy.")
    prefill: PoolStatus = api_field(PoolStatus(), "The prefill pool.")
    decode: PoolStatus = api_field(PoolStatus(), "The decode pool.")
    router: RouterStatus = api_field(RouterStatus(), "The router.")


# --------------------------------------------------------------------------------------------- checks


# Flags the operator derives from the spec; engineArgs may not override them.
RESERVED_SERVER_FLAGS = ("--role", "--host", "--port", "--metrics-port", "--model", "--served-model-name",
                         "--dtype", "--device", "--bootstrap-port", "--advertise-host", "--kv-transfer-protocol",
                         "--ib-device", "--drain-grace-seconds", "--bootstrap-timeout", "--tp-size")
RESERVED_ROUTER_FLAGS = ("--host", "--port", "--pd-disaggregation", "--discovery-provider", "--discovery-file",
                         "--service-discovery", "--prefill-policy", "--decode-policy", "--health-check-port",
                         "--prometheus-port", "--prometheus-host", "--api-key", "--tenant-api-key")


def parse_spec(name: str, spec: dict) -> InferenceServiceSpec:
    """The typed spec of InferenceService `name`, or SpecError naming the field to fix."""
    if len(name) > MAX_NAME_LENGTH:
        raise SpecError("metadata.name", f"{name!r} is {len(name)} characters; at most {MAX_NAME_LENGTH} "
                        "(pod names and labels are built from it)")
    if not re.match(SERVICE_NAME, name):
        raise SpecError("metadata.name", f"{name!r}: Service names are built from it, so it must start with a "
                        "letter and hold only lowercase letters, digits and '-'")
    parsed = parse(InferenceServiceSpec, spec)
    _check_model(parsed.model)
    for pool_name in ("prefill", "decode"):
        _check_pool(pool_name, getattr(parsed, pool_name))
    kv = parsed.kv_transfer
    if kv.protocol == "rdma" and not kv.ib_devices:
        raise SpecError("spec.kvTransfer.ibDevices", "protocol rdma needs at least one RDMA device, e.g. [mlx5_0]")
    if kv.protocol == "tcp" and kv.ib_devices:
        raise SpecError("spec.kvTransfer.ibDevices", "RDMA devices apply only to protocol rdma; remove them or "
                        "set protocol: rdma")
    _check_tolerations("spec.router.tolerations", parsed.router.tolerations)
    _check_flags("spec.router.extraArgs", parsed.router.extra_args, RESERVED_ROUTER_FLAGS)
    keys = parsed.router.api_keys
    if keys is not None:
        if not keys.keys or len(set(keys.keys)) != len(keys.keys):
            raise SpecError("spec.router.apiKeys.keys", f"{keys.keys}: name at least one key of Secret "
                            f"{keys.secret_name!r}, each once")
        for i, key in enumerate(keys.keys):
            if not re.search(SECRET_KEY, key):
                raise SpecError(f"spec.router.apiKeys.keys[{i}]", f"{key!r} is not a Secret key (letters, digits, -._)")
    mon = parsed.monitoring
    if mon.service_monitor and mon.pod_monitor:
        raise SpecError("spec.monitoring", "enable serviceMonitor or podMonitor, not both (each would scrape every pod)")
    net = parsed.network_policy
    for field, peers in (("routerFrom", net.router_from or []), ("metricsFrom", net.metrics_from)):
        for i, peer in enumerate(peers):
            _check_peer(f"spec.networkPolicy.{field}[{i}]", peer)
    return parsed


def _check_model(model: ModelSpec) -> None:
    needs = {"gguf": (("path", model.path),), "pvc": (("claimName", model.claim_name), ("path", model.path)),
             "huggingface": (("huggingfaceId", model.huggingface_id), ("claimName", model.claim_name))}
    for field, value in needs.get(model.source, ()):
        if not value:
            raise SpecError(f"spec.model.{field}", f"required when source is {model.source}")
    if model.source == "gguf" and not (model.path.startswith("/") and model.path.endswith(".gguf")):
        raise SpecError("spec.model.path", f"{model.path!r}: source gguf needs an absolute path to a .gguf file")
    if model.source == "pvc" and model.path.startswith("/"):
        raise SpecError("spec.model.path", f"{model.path!r}: source pvc needs a path relative to the claim's root")


def _check_pool(pool_name: str, pool: PoolSpec) -> None:
    where = f"spec.{pool_name}"
    if pool.min_replicas > pool.max_replicas:
        raise SpecError(f"{where}.minReplicas", f"{pool.min_replicas} is above maxReplicas {pool.max_replicas}")
    if not pool.min_replicas <= pool.replicas <= pool.max_replicas:
        raise SpecError(f"{where}.replicas", f"{pool.replicas} is outside [minReplicas, maxReplicas] = "
                        f"[{pool.min_replicas}, {pool.max_replicas}]")
    try:
        gpus = gpu_count(pool.resources)
    except SpecError as e:
        raise SpecError(f"{where}.{e.path}", str(e).split(": ", 1)[1]) from None
    if gpus and gpus != pool.tensor_parallel_size:
        raise SpecError(f"{where}.resources.limits.nvidia.com/gpu", f"{gpus}: a server uses one GPU per "
                        f"tensor-parallel rank, and tensorParallelSize is {pool.tensor_parallel_size}; set both "
                        "alike (scale with replicas)")
    _check_flags(f"{where}.engineArgs", pool.engine_args, RESERVED_SERVER_FLAGS)
    _check_tolerations(f"{where}.tolerations", pool.tolerations)


def _check_flags(where: str, args: list[str], reserved: tuple[str, ...]) -> None:
    """Refuse reserved flags, also abbreviated (argparse accepts unique prefixes)."""
    for i, arg in enumerate(args):
        flag = arg.split("=", 1)[0]
        owned = [r for r in reserved if flag.startswith("--") and len(flag) > 2 and r.startswith(flag)]
        if owned:
            raise SpecError(f"{where}[{i}]", f"{flag} sets {owned[0]}, which the operator sets from the spec; "
                            "set the spec field instead")


def _check_tolerations(where: str, tolerations: list[Toleration]) -> None:
    """The rules the API server applies to a pod's tolerations."""
    for i, t in enumerate(tolerations):
        if t.operator == "Exists" and t.value:
            raise SpecError(f"{where}[{i}].value", "must be empty when operator is Exists")
        if t.operator == "Equal" and not t.key:
            raise SpecError(f"{where}[{i}].key", "required when operator is Equal (use Exists to match every taint)")
        if t.toleration_seconds is not None and t.effect != "NoExecute":
            raise SpecError(f"{where}[{i}].tolerationSeconds", "applies only to effect NoExecute")


def _check_peer(where: str, peer: NetworkPeer) -> None:
    """A peer is pods or an IP range, never both (a NetworkPolicy peer with an ipBlock takes no selector)."""
    if peer.cidr is None:
        return
    if peer.namespace_labels is not None or peer.pod_labels:
        raise SpecError(f"{where}.cidr", "an IP range stands alone: leave namespaceLabels and podLabels out")
    try:
        ipaddress.ip_network(peer.cidr)
    except ValueError as e:
        raise SpecError(f"{where}.cidr", f"{peer.cidr!r} is not a network address with its prefix length "
                        f"({e})") from None


def gpu_count(resources: Resources) -> int:
    """GPUs in a pool's limits (or requests); SpecError if the value is not a whole number."""
    raw = resources.limits.get("nvidia.com/gpu", resources.requests.get("nvidia.com/gpu", 0))
    try:
        return int(str(raw))
    except ValueError:
        raise SpecError("resources.limits.nvidia.com/gpu", f"{raw!r} must be a whole number of GPUs") from None
