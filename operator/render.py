"""Pure renderers: one `Instance` in, Kubernetes objects (plain dicts) out. No I/O.

For an InferenceService `NAME` in namespace `NS` the operator owns:

    StatefulSet  NAME-prefill, NAME-decode      tandem serve --role prefill|decode
    Service      NAME-prefill, NAME-decode      headless: pod DNS NAME-prefill-0.NAME-prefill.NS.svc...
    ConfigMap    NAME-router-workers            workers.json, the router's view of both pools
    Deployment   NAME-router                    smg launch --pd-disaggregation, file discovery
    Service      NAME-router                    clients: OpenAI HTTP on spec.router.service.port
    Service      NAME-router-metrics            the router's /metrics, in-cluster only
    PodDisruptionBudget NAME-prefill, NAME-decode, NAME-router (each unless disabled)
    ServiceMonitor or PodMonitor NAME           when spec.monitoring asks for one
    NetworkPolicy NAME-prefill, NAME-decode, NAME-router (ingress only; unless spec.networkPolicy is off)
    Secret       NAME-bootstrap-token           the pools' bootstrap token, made once (`render_bootstrap_secret`)

Every object carries the instance's labels and a controller owner reference to the
InferenceService, so a real cluster's garbage collector removes them with it. Each
NetworkPolicy opens a component's ports to exactly who uses them (`render_network_policy`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from tandem.operator.schema import to_wire
from tandem.operator.spec import (GROUP, KIND, NAMESPACE_NAME_LABEL, POOLS, VERSION, InferenceServiceSpec, NetworkPeer,
                                  PoolSpec, Toleration, gpu_count)

GRPC_PORT = 30000
METRICS_PORT = 30001
ROUTER_HTTP_PORT = 8000
ROUTER_HEALTH_PORT = 8081
ROUTER_METRICS_PORT = 29000
SERVER_UID = 10001

BOOTSTRAP_TOKEN_DIR = "/etc/tandem/bootstrap"  # the bootstrap-token Secret's mount in server pods
BOOTSTRAP_TOKEN_KEY = "tokens"  # one token per line: `tandem serve --bootstrap-token-file`
WORKERS_FILE = "workers.json"
WORKERS_DIR = "/etc/tandem/router"
MODEL_DIR = "/models"
CACHE_DIR = "/cache"
MANAGED_BY = "tandem-operator"


@dataclass(frozen=True)
class Defaults:
    """Operator-wide settings the spec does not carry (set by the operator's flags)."""

    router_image: str = "ghcr.io/tandem-serving/tandem-router:0.1.0"
    cluster_domain: str = "cluster.local"
    # Where the operator's own pods run (label app.kubernetes.io/component=operator): the servers'
    # NetworkPolicies admit them to the metrics port, which the autoscaler reads. None when unknown
    # (an operator outside the cluster reaches no pod IP through a policy anyway).
    operator_namespace: str | None = None


@dataclass(frozen=True)
class Instance:
    """One InferenceService as the renderers see it: identity, typed spec, operator defaults, and
    the replicas each pool should run (the spec's, or the autoscaler's decision), and the pools
    whose highest-ordinal pod is draining: still running, no longer in the router's worker list."""

    name: str
    namespace: str
    uid: str
    spec: InferenceServiceSpec
    defaults: Defaults = Defaults()
    replicas: dict[str, int] = field(default_factory=dict)
    draining: frozenset[str] = frozenset()

    def pool(self, pool: str) -> PoolSpec:
        return getattr(self.spec, pool)

    def pool_replicas(self, pool: str) -> int:
        """Servers the router routes to."""
        return self.replicas.get(pool, self.pool(pool).replicas)

    def statefulset_replicas(self, pool: str) -> int:
        """Pods that run: the routed servers plus a draining one."""
        return self.pool_replicas(pool) + (pool in self.draining)

    def pool_name(self, pool: str) -> str:
        return f"{self.name}-{pool}"

    @property
    def router_name(self) -> str:
        return f"{self.name}-router"

    @property
    def workers_configmap(self) -> str:
        return f"{self.name}-router-workers"

    @property
    def bootstrap_secret(self) -> str:
        """The Secret of the token every bootstrap call between the pools carries."""
        return f"{self.name}-bootstrap-token"

    def pod_host(self, pool: str, ordinal: int) -> str:
        """Stable DNS name of a pool's pod (the headless Service publishes it even while not ready)."""
        sts = self.pool_name(pool)
        return f"{sts}-{ordinal}.{sts}.{self.namespace}.svc.{self.defaults.cluster_domain}"

    @property
    def router_endpoint(self) -> str:
        svc = self.spec.router.service
        return f"http://{self.router_name}.{self.namespace}.svc.{self.defaults.cluster_domain}:{svc.port}"


# --------------------------------------------------------------------------------------------- common


def selector_labels(inst: Instance, component: str) -> dict[str, str]:
    """Immutable selector labels (never the image or version)."""
    return {"app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": inst.name,
            "app.kubernetes.io/component": component}


def labels(inst: Instance, component: str) -> dict[str, str]:
    return {**selector_labels(inst, component), "app.kubernetes.io/managed-by": MANAGED_BY,
            "app.kubernetes.io/part-of": "tandem", f"{GROUP}/inference-service": inst.name}


def _metadata(inst: Instance, name: str, component: str) -> dict:
    return {
        "name": name,
        "namespace": inst.namespace,
        "labels": labels(inst, component),
        "ownerReferences": [{"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": inst.name,
                             "uid": inst.uid, "controller": True, "blockOwnerDeletion": True}],
    }


def _resources(resources) -> dict:
    """Container resources; extended resources (GPUs) must be requested as much as limited."""
    limits = {k: str(v) for k, v in resources.limits.items()}
    requests = {k: str(v) for k, v in resources.requests.items()}
    for key, value in limits.items():
        if "/" in key and not key.startswith("kubernetes.io/"):
            requests[key] = value
    return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}


def _tolerations(tolerations: list[Toleration]) -> list[dict]:
    return [to_wire(t) for t in tolerations]


def _pod_security() -> dict:
    return {"runAsNonRoot": True, "runAsUser": SERVER_UID, "runAsGroup": SERVER_UID, "fsGroup": SERVER_UID,
            "seccompProfile": {"type": "RuntimeDefault"}}


def _pod_spec(inst: Instance, container: dict, resources, volumes: list[dict], grace_seconds: int,
              node_selector: dict, tolerations: list[Toleration], affinity: dict | None = None) -> dict:
    """A non-root pod of one container; empty optional parts are left out."""
    container_resources = _resources(resources)
    if container_resources:
        container["resources"] = container_resources
    spec = {"containers": [container], "volumes": volumes, "terminationGracePeriodSeconds": grace_seconds,
            "securityContext": _pod_security(), "enableServiceLinks": False}
    if node_selector:
        spec["nodeSelector"] = dict(node_selector)
    if tolerations:
        spec["tolerations"] = _tolerations(tolerations)
    if affinity:
        spec["affinity"] = dict(affinity)
    if inst.spec.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": s} for s in inst.spec.image_pull_secrets]
    return spec


# --------------------------------------------------------------------------------------------- pools


def model_arg(inst: Instance) -> str:
    model = inst.spec.model
    return {
        "builtin": lambda: f"builtin:{model.builtin}",
        "gguf": lambda: model.path,
        "pvc": lambda: f"{MODEL_DIR}/{model.path}",
        "huggingface": lambda: f"hf:{model.huggingface_id}",
    }[model.source]()


def drain_seconds(pool: PoolSpec) -> int:
    """The server drains for its grace period minus 10 s, leaving time to exit before SIGKILL."""
    return pool.termination_grace_period_seconds - 10


def server_args(inst: Instance, pool: str) -> list[str]:
    """`tandem serve` arguments for a pool's pods. `$(POD_IP)` is expanded by the kubelet."""
    spec, p = inst.spec, inst.pool(pool)
    kv = spec.kv_transfer
    args = ["serve", "--role", pool, "--host", "0.0.0.0", "--port", str(GRPC_PORT),
            "--metrics-port", str(METRICS_PORT), "--model", model_arg(inst),
            "--served-model-name", spec.model.name, "--dtype", spec.model.dtype,
            "--device", "cuda" if gpu_count(p.resources) else "cpu",
            "--advertise-host", "$(POD_IP)", "--kv-transfer-protocol", kv.protocol,
            "--bootstrap-timeout", str(kv.bootstrap_timeout_seconds),
            "--drain-grace-seconds", str(drain_seconds(p)), "--tp-size", str(p.tensor_parallel_size),
            "--bootstrap-token-file", f"{BOOTSTRAP_TOKEN_DIR}/{BOOTSTRAP_TOKEN_KEY}"]
    if pool == "prefill":
        args += ["--bootstrap-port", str(kv.bootstrap_port)]
    if kv.ib_devices:
        args += ["--ib-device", ",".join(kv.ib_devices)]
    return args + list(p.engine_args)


def _server_container(inst: Instance, pool: str) -> dict:
    spec, p = inst.spec, inst.pool(pool)
    ports = [{"name": "grpc", "containerPort": GRPC_PORT}, {"name": "metrics", "containerPort": METRICS_PORT}]
    if pool == "prefill":
        ports.append({"name": "bootstrap", "containerPort": spec.kv_transfer.bootstrap_port})
    env = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": "HOME", "value": CACHE_DIR}, {"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
           {"name": "HF_HUB_OFFLINE", "value": "1"},
           # On the cache emptyDir, which outlives the container restarts an engine failure causes.
           {"name": "TANDEM_CRASH_LOG", "value": f"{CACHE_DIR}/engine-crashes.log"}]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "cache", "mountPath": CACHE_DIR},
              {"name": "tmp", "mountPath": "/tmp"},
              {"name": "bootstrap-token", "mountPath": BOOTSTRAP_TOKEN_DIR, "readOnly": True}]
    if spec.model.source in ("pvc", "huggingface"):
        mounts.append({"name": "model", "mountPath": MODEL_DIR, "readOnly": True})
    if spec.model.source == "huggingface":
        env.append({"name": "HF_HOME", "value": MODEL_DIR})
    env += [{"name": k, "value": v} for k, v in sorted(p.env.items())]
    container = {
        "name": "server",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["tandem"],
        "args": server_args(inst, pool),
        "ports": ports,
        "env": env,
        # The gRPC health service answers SERVING once the model is loaded, NOT_SERVING while
        # draining: readiness takes a draining server out of rotation at once.
        "startupProbe": {"grpc": {"port": GRPC_PORT}, "periodSeconds": 10,
                         "failureThreshold": max(1, p.startup_timeout_seconds // 10)},
        "readinessProbe": {"grpc": {"port": GRPC_PORT}, "periodSeconds": 5, "failureThreshold": 2},
        # Liveness asks only whether the process answers: a draining server must not be restarted.
        "livenessProbe": {"tcpSocket": {"port": "metrics"}, "periodSeconds": 10, "failureThreshold": 6},
        "volumeMounts": mounts,
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    return container


def shm_size(pool: PoolSpec) -> str:
    """/dev/shm of a pool's pods: as asked, but at least 2Gi per rank for NCCL between GPUs."""
    from kubernetes.utils import parse_quantity  # here: `tandem serve`'s flags parse without the Kubernetes client

    floor = 2 * pool.tensor_parallel_size
    if pool.tensor_parallel_size > 1 and gpu_count(pool.resources) and parse_quantity(pool.shm_size) < floor * 2**30:
        return f"{floor}Gi"
    return str(pool.shm_size)


def _server_volumes(inst: Instance, pool: str) -> list[dict]:
    model = inst.spec.model
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size(inst.pool(pool))}},
               {"name": "cache", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}},
               # readable by the server's group (the pod's fsGroup) alone
               {"name": "bootstrap-token", "secret": {"secretName": inst.bootstrap_secret, "defaultMode": 0o440}}]
    if model.source in ("pvc", "huggingface"):
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": model.claim_name, "readOnly": True}})
    return volumes


def render_statefulset(inst: Instance, pool: str) -> dict:
    p = inst.pool(pool)
    pod_spec = _pod_spec(inst, _server_container(inst, pool), p.resources, _server_volumes(inst, pool),
                         p.termination_grace_period_seconds, p.node_selector, p.tolerations, p.affinity)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _metadata(inst, inst.pool_name(pool), pool),
        "spec": {
            "serviceName": inst.pool_name(pool),
            "replicas": inst.statefulset_replicas(pool),
            # Servers are independent: start and stop them together, not one by one.
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate"},
            "selector": {"matchLabels": selector_labels(inst, pool)},
            "template": {"metadata": {"labels": labels(inst, pool)}, "spec": pod_spec},
        },
    }


def render_headless_service(inst: Instance, pool: str) -> dict:
    ports = [{"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc", "appProtocol": "grpc"},
             {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics"}]
    if pool == "prefill":
        port = inst.spec.kv_transfer.bootstrap_port
        ports.append({"name": "bootstrap", "port": port, "targetPort": "bootstrap"})
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(inst, inst.pool_name(pool), pool),
        "spec": {
            "clusterIP": "None",
            # Decode servers reach a prefill's bootstrap service by its pod DNS name even while
            # that pod is not ready (e.g. draining): keep the names published.
            "publishNotReadyAddresses": True,
            "selector": selector_labels(inst, pool),
            "ports": ports,
        },
    }


def render_pdb(inst: Instance, component: str) -> dict | None:
    budget = inst.spec.router.pod_disruption_budget if component == "router" else inst.pool(component).pod_disruption_budget
    if not budget.enabled:
        return None
    name = inst.router_name if component == "router" else inst.pool_name(component)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(inst, name, component),
        "spec": {"maxUnavailable": budget.max_unavailable,
                 "selector": {"matchLabels": selector_labels(inst, component)}},
    }


# --------------------------------------------------------------------------------------------- router


def worker_manifest(inst: Instance) -> dict:
    """smg's discovery manifest: every pod of both pools (ordinals below the pool's replicas) by
    stable DNS name. Pods that are still loading are listed too; the router retries them until
    they answer."""
    workers = []
    for pool in POOLS:
        for i in range(inst.pool_replicas(pool)):
            worker = {"id": f"{inst.pool_name(pool)}-{i}", "url": f"grpc://{inst.pod_host(pool, i)}:{GRPC_PORT}",
                      "worker_type": pool}
            if pool == "prefill":
                worker["bootstrap_port"] = inst.spec.kv_transfer.bootstrap_port
            workers.append(worker)
    return {"version": 1, "workers": workers}


def render_workers_configmap(inst: Instance) -> dict:
    text = json.dumps(worker_manifest(inst), indent=2, sort_keys=True) + "\n"
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(inst, inst.workers_configmap, "router"),
            "data": {WORKERS_FILE: text}}


def router_args(inst: Instance) -> list[str]:
    """`smg` arguments. The router reads its workers from the mounted ConfigMap and rereads it on
    change, so scaling a pool never restarts the router."""
    router, kv = inst.spec.router, inst.spec.kv_transfer
    grace = router_grace_seconds(inst)
    return ["launch", "--host", "0.0.0.0", "--port", str(ROUTER_HTTP_PORT), "--pd-disaggregation",
            "--discovery-provider", "file", "--discovery-file", f"{WORKERS_DIR}/{WORKERS_FILE}",
            "--discovery-check-interval-secs", "10",
            "--prefill-policy", router.prefill_policy, "--decode-policy", router.decode_policy,
            "--health-check-port", str(ROUTER_HEALTH_PORT),
            "--prometheus-host", "0.0.0.0", "--prometheus-port", str(ROUTER_METRICS_PORT),
            # A long prompt keeps a prefill server silent for seconds: not a wedged worker.
            "--worker-wedge-secs", "120", "--worker-startup-check-interval", "2",
            "--health-check-interval-secs", "10",
            # Rolling restarts: a pod between two processes is excluded once the router has had no
            # contact with it for 2 s and a load poll (each second) fails; until then retries, each
            # with a new prefill/decode pair and room (about 5 s in all), carry its requests.
            "--load-monitor-interval", "1", "--retry-max-retries", "10",
            "--retry-initial-backoff-ms", "100", "--retry-max-backoff-ms", "1000",
            # The router gives up on a PD pair before either tandem leg does.
            "--pd-admission-wait-secs", str(max(1, kv.bootstrap_timeout_seconds - 5)),
            "--shutdown-grace-period-secs", str(grace - 5),
            *_api_key_args(inst), *router.extra_args]


def _api_key_env(i: int) -> str:
    return f"TANDEM_ROUTER_API_KEY_{i}"


def _api_key_args(inst: Instance) -> list[str]:
    """One `--tenant-api-key NAME:$(VAR)` per accepted key (the kubelet expands the variable from the
    Secret). smg reads keys from its command line only; tenant keys, unlike its single `--api-key`,
    can be several (a rotation), and leave its admin routes closed to every caller."""
    keys = inst.spec.router.api_keys
    if keys is None:
        return []
    return [arg for i, key in enumerate(keys.keys) for arg in ("--tenant-api-key", f"{key}:$({_api_key_env(i)})")]


def _api_key_env_vars(inst: Instance) -> list[dict]:
    keys = inst.spec.router.api_keys
    if keys is None:
        return []
    return [{"name": _api_key_env(i), "valueFrom": {"secretKeyRef": {"name": keys.secret_name, "key": key}}}
            for i, key in enumerate(keys.keys)]


def router_grace_seconds(inst: Instance) -> int:
    """A stopping router waits for its in-flight requests, as long as the servers would."""
    return max(inst.pool(p).termination_grace_period_seconds for p in POOLS)


def render_router_deployment(inst: Instance) -> dict:
    router = inst.spec.router
    container = {
        "name": "router",
        "image": router.image or inst.defaults.router_image,
        "imagePullPolicy": inst.spec.image_pull_policy,
        "command": ["smg"],
        "args": router_args(inst),
        "env": [{"name": "HOME", "value": "/tmp"}, *_api_key_env_vars(inst)],
        "ports": [{"name": "http", "containerPort": ROUTER_HTTP_PORT},
                  {"name": "health", "containerPort": ROUTER_HEALTH_PORT},
                  {"name": "metrics", "containerPort": ROUTER_METRICS_PORT}],
        # /readiness needs a ready prefill and a ready decode; /liveness only a live process.
        "readinessProbe": {"httpGet": {"path": "/readiness", "port": "health"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/liveness", "port": "health"}, "periodSeconds": 10,
                          "failureThreshold": 6},
        # The router fetches the tokenizer from a worker and unpacks it under /tmp.
        "volumeMounts": [{"name": "workers", "mountPath": WORKERS_DIR, "readOnly": True},
                         {"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
    }
    # Mounted as a whole directory (never subPath): the kubelet then swaps in new contents.
    volumes = [{"name": "workers", "configMap": {"name": inst.workers_configmap}}, {"name": "tmp", "emptyDir": {}}]
    pod_spec = _pod_spec(inst, container, router.resources, volumes, router_grace_seconds(inst),
                         router.node_selector, router.tolerations)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(inst, inst.router_name, "router"),
        "spec": {
            "replicas": router.replicas,
            "selector": {"matchLabels": selector_labels(inst, "router")},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {"metadata": {"labels": labels(inst, "router")}, "spec": pod_spec},
        },
    }


def render_router_service(inst: Instance) -> dict:
    svc = inst.spec.router.service
    meta = _metadata(inst, inst.router_name, "router")
    if svc.annotations:
        meta["annotations"] = dict(svc.annotations)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "type": svc.type,
            "selector": selector_labels(inst, "router"),
            "ports": [{"name": "http", "port": svc.port, "targetPort": "http", "appProtocol": "http"}],
        },
    }


def render_router_metrics_service(inst: Instance) -> dict:
    """The router's /metrics (per-worker series, no auth) on a ClusterIP Service of its own, so a
    LoadBalancer client Service never exposes it."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(inst, f"{inst.router_name}-metrics", "router"),
        "spec": {"type": "ClusterIP", "selector": selector_labels(inst, "router"),
                 "ports": [{"name": "metrics", "port": ROUTER_METRICS_PORT, "targetPort": "metrics"}]},
    }


# --------------------------------------------------------------------------------------------- monitoring


def render_monitor(inst: Instance) -> dict | None:
    """A ServiceMonitor over the pools' and the router's metrics Services, or a PodMonitor over
    all pods: port `metrics`."""
    mon = inst.spec.monitoring
    if not (mon.service_monitor or mon.pod_monitor):
        return None
    meta = _metadata(inst, inst.name, "monitoring")
    meta["labels"].update(mon.labels)
    selector = {"matchLabels": {"app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": inst.name},
                "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "In",
                                      "values": [*POOLS, "router"]}]}
    endpoint = {"port": "metrics", "path": "/metrics", "interval": mon.interval}
    if mon.service_monitor:
        return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": meta,
                "spec": {"selector": selector, "endpoints": [endpoint]}}
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": meta,
            "spec": {"selector": selector, "podMetricsEndpoints": [endpoint]}}


# --------------------------------------------------------------------------------------------- network policies

# The label the chart puts on the operator's pods (and on no InferenceService pod).
OPERATOR_POD_LABELS = {"app.kubernetes.io/component": "operator"}


def _peer(peer: NetworkPeer) -> dict:
    """A spec peer as a NetworkPolicy peer. No namespaceSelector means the policy's own namespace;
    an empty one means every namespace."""
    if peer.cidr is not None:
        return {"ipBlock": {"cidr": peer.cidr}}
    out = {}
    if peer.namespace_labels is not None:
        out["namespaceSelector"] = {"matchLabels": dict(peer.namespace_labels)} if peer.namespace_labels else {}
    out["podSelector"] = {"matchLabels": dict(peer.pod_labels)} if peer.pod_labels else {}
    return out


def _pods_of(inst: Instance, component: str) -> dict:
    """This InferenceService's pods of one component (a peer without namespaceSelector: its own namespace)."""
    return {"podSelector": {"matchLabels": selector_labels(inst, component)}}


def _operator_peers(inst: Instance) -> list[dict]:
    namespace = inst.defaults.operator_namespace
    if namespace is None:
        return []
    return [{"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: namespace}},
             "podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)}}]


def _tcp(*ports: int) -> list[dict]:
    return [{"protocol": "TCP", "port": port} for port in ports]


def _ingress(ports: list[dict], peers: list[dict] | None) -> list[dict]:
    """One ingress rule admitting `peers` to `ports`, as a list of zero or one rule. `peers` None
    admits every source (a rule without `from`); an empty list admits nobody, so no rule is
    rendered: a rule with an empty `from` would admit every source too."""
    if peers is None:
        return [{"ports": ports}]
    return [{"from": peers, "ports": ports}] if peers else []


def router_peers(inst: Instance) -> list[dict] | None:
    """Who may call the router: spec.networkPolicy.routerFrom; by default every pod of the
    namespace behind a ClusterIP Service, and every source behind a NodePort or LoadBalancer (the
    clients of those come from outside the cluster, often through a node's address)."""
    router_from = inst.spec.network_policy.router_from
    if router_from is not None:
        return [_peer(p) for p in router_from]
    return [{"podSelector": {}}] if inst.spec.router.service.type == "ClusterIP" else None


def render_network_policy(inst: Instance, component: str) -> dict | None:
    """Ingress of one component's pods; every port not named here is closed to every source.

    - servers' gRPC (GRPC_PORT): this service's router pods;
    - between this service's prefill and decode pods, every TCP port, both ways: the bootstrap
      port (decode -> prefill) and Mooncake's transfer engine, whose RPC and data ports are
      chosen at random when it starts (P2P handshake), so no fixed port can be named. RDMA
      traffic does not pass through the kernel's IP stack, which is where policies apply;
    - servers' and router's metrics: spec.networkPolicy.metricsFrom, and the servers' also the
      operator's pods (the autoscaler scrapes each server unless it reads Prometheus);
    - router's HTTP and health ports: `router_peers`.

    Assumed: the kubelet's probes (gRPC, TCP and HTTP on these ports) pass, because traffic from
    a pod's own node is always admitted, as the Kubernetes documentation states and Calico and
    Cilium do; under a plugin that does not, routerFrom and metricsFrom need the nodes' CIDRs.
    Egress is not restricted (policyTypes: [Ingress]), so these pods may still open connections
    anywhere: restricting it would have to open DNS, Mooncake's unfixed ports to the other pool
    and the router's calls to every server again, and is left to the cluster's own policies."""
    net = inst.spec.network_policy
    if not net.enabled:
        return None
    metrics = [_peer(p) for p in net.metrics_from]
    if component == "router":
        name = inst.router_name
        rules = (_ingress(_tcp(ROUTER_HTTP_PORT, ROUTER_HEALTH_PORT), router_peers(inst))
                 + _ingress(_tcp(ROUTER_METRICS_PORT), metrics))
    else:
        name = inst.pool_name(component)
        other = "decode" if component == "prefill" else "prefill"
        rules = (_ingress(_tcp(GRPC_PORT), [_pods_of(inst, "router")])
                 # Every TCP port (a port entry without `port`): Mooncake's ports are not fixed.
                 + _ingress([{"protocol": "TCP"}], [_pods_of(inst, other)])
                 + _ingress(_tcp(METRICS_PORT), metrics + _operator_peers(inst)))
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(inst, name, component),
        "spec": {"podSelector": {"matchLabels": selector_labels(inst, component)}, "policyTypes": ["Ingress"],
                 "ingress": rules},
    }


# --------------------------------------------------------------------------------------------- bootstrap token


def render_bootstrap_secret(inst: Instance, token: str | None) -> dict:
    """The Secret both pools mount for their bootstrap calls (`--bootstrap-token-file`). Not in
    `render_all`: the operator creates it once, with a fresh random `token`, and never writes it
    again, so that a reconcile does not change the token under running pods (an edit of the Secret,
    e.g. a second line to rotate, is left alone). `token` None renders a placeholder for review."""
    value = token if token is not None else "<random, made by the operator when it creates this Secret>"
    meta = _metadata(inst, inst.bootstrap_secret, "bootstrap")
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque",
            "stringData": {BOOTSTRAP_TOKEN_KEY: value + "\n"}}


# --------------------------------------------------------------------------------------------- all


def render_all(inst: Instance, *, monitoring_available: bool = True) -> list[dict]:
    """Every object the instance should own, in apply order: the router's worker list first (a
    pool that shrinks leaves the router's view before its pods go), then the pools, the router,
    and the NetworkPolicies (their place does not matter: they admit pods by label, whenever the
    pods come). The monitor is left out when the cluster has no monitoring CRDs."""
    objects = [render_workers_configmap(inst)]
    for pool in POOLS:
        objects += [render_headless_service(inst, pool), render_statefulset(inst, pool)]
    objects += [render_router_deployment(inst), render_router_service(inst), render_router_metrics_service(inst)]
    objects += [pdb for c in (*POOLS, "router") if (pdb := render_pdb(inst, c))]
    if monitoring_available and (monitor := render_monitor(inst)):
        objects.append(monitor)
    objects += [policy for c in (*POOLS, "router") if (policy := render_network_policy(inst, c))]
    return objects
