"""Rendered pods run as Docker containers, the way a kubelet runs them: each container from its image
with exactly its rendered command, args (`$(VAR)` expanded from its env), env (fieldRef: the pod's
name, namespace and IP), volumes (emptyDir: a fresh folder, group-owned by the pod's fsGroup, or
tmpfs for `medium: Memory`; configMap: its files, read-only; secret: its files, read-only, with its
defaultMode and the pod's fsGroup as their group; the service account's token, CA and
namespace where the pod has one), securityContext (user, group, fsGroup, runAsNonRoot against the
image, read-only root filesystem, dropped capabilities, no privilege escalation), memory and CPU
limits, and termination grace period; and its probes, run from the host against the pod's IP, as
the kubelet runs them from the node.

Replaced, and only these: the pod network (a Docker network of the test's own, an address per pod)
and cluster DNS (each pod answers on that network to the DNS names the caller gives it: a
StatefulSet pod's stable name, a Service's name). A field this module cannot run as written is an
error (`check_fields`), never ignored; what matters only to a scheduler (requests, node selectors,
tolerations, affinity) is accepted and has no effect on one machine."""

from __future__ import annotations

import re
import shutil
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kubernetes.utils import parse_quantity

from support.docker import Docker, DockerError, Network

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# What a pod may hold, field by field, that this module runs (scheduling fields, which change nothing on
# one node, included: node selectors, tolerations, affinity, resource requests, pull secrets). Anything
# else is refused rather than ignored.
POD_FIELDS = {"containers", "volumes", "securityContext", "terminationGracePeriodSeconds", "enableServiceLinks",
              "serviceAccountName", "nodeSelector", "tolerations", "affinity", "imagePullSecrets"}
CONTAINER_FIELDS = {"name", "image", "imagePullPolicy", "command", "args", "env", "ports", "resources", "volumeMounts",
                    "securityContext", "startupProbe", "readinessProbe", "livenessProbe"}
POD_SECURITY = {"runAsUser", "runAsGroup", "runAsNonRoot", "fsGroup", "supplementalGroups", "seccompProfile"}
CONTAINER_SECURITY = {"runAsUser", "runAsGroup", "runAsNonRoot", "readOnlyRootFilesystem", "allowPrivilegeEscalation",
                      "capabilities", "seccompProfile"}
PROBE_TIMING = {"initialDelaySeconds", "periodSeconds", "timeoutSeconds", "failureThreshold", "successThreshold"}
FIELDS = {  # where in a pod -> the keys allowed there
    "env": {"name", "value", "valueFrom"}, "ports": {"name", "containerPort", "protocol"},
    "volumeMounts": {"name", "mountPath", "readOnly"}, "resources": {"requests", "limits"},
    "volumes": {"name", "emptyDir", "configMap", "secret"}, "emptyDir": {"medium", "sizeLimit"}, "configMap": {"name"},
    "secret": {"secretName", "defaultMode"},
}


class PodFailed(AssertionError):
    """The pod cannot run as written, or its container exited, or it never became ready."""


def check_fields(name: str, pod_spec: dict, container: dict) -> None:
    """PodFailed naming the first field of the pod this module would not run as written."""
    def refuse(where: str, keys) -> None:
        if keys:
            raise PodFailed(f"pod {name}: {where} {sorted(keys)} not run here")

    refuse("pod fields", set(pod_spec) - POD_FIELDS)
    if len(pod_spec["containers"]) != 1:
        raise PodFailed(f"pod {name}: one container per pod is run here")
    refuse("container fields", set(container) - CONTAINER_FIELDS)
    refuse("pod securityContext fields", set(pod_spec.get("securityContext", {})) - POD_SECURITY)
    refuse("container securityContext fields", set(container.get("securityContext", {})) - CONTAINER_SECURITY)
    for key in ("env", "ports", "volumeMounts"):
        for item in container.get(key, []):
            refuse(f"{key} fields", set(item) - FIELDS[key])
    refuse("port protocols", {p.get("protocol", "TCP") for p in container.get("ports", [])} - {"TCP"})
    refuse("resources fields", set(container.get("resources", {})) - FIELDS["resources"])
    for volume in pod_spec.get("volumes", []):
        refuse("volume sources", set(volume) - FIELDS["volumes"])
        for source in ("emptyDir", "configMap", "secret"):
            refuse(f"{source} fields", set(volume.get(source, {})) - FIELDS[source])
        if "sizeLimit" in volume.get("emptyDir", {}) and volume["emptyDir"].get("medium") != "Memory":
            raise PodFailed(f"pod {name}: a sizeLimit on a disk emptyDir ({volume['name']}) is not run here")
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container.get(kind, {})
        refuse(f"{kind} fields", set(probe) - PROBE_TIMING - {"grpc", "httpGet", "tcpSocket", "exec"})


@dataclass(frozen=True)
class APIServer:
    """What a pod with a service account is given to reach the Kubernetes API: its address (the env
    KUBERNETES_SERVICE_HOST/PORT) and the files of its token volume."""

    host: str
    port: int
    ca_file: Path
    token: str = "tandem-test-token"


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's `$(VAR)` expansion: known variables replaced, `$$` an escaped `$`, unknown
    references left as written."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), text)


@dataclass
class Pod:
    docker: Docker
    name: str
    namespace: str
    ip: str
    container: dict  # the rendered container
    spec: dict  # the rendered pod spec
    docker_name: str
    folders: list[Path] = field(default_factory=list)

    # ---------------------------------------------------------------- state

    def logs(self) -> str:
        proc = self.docker.run("logs", self.docker_name, check=False, timeout=30)
        return proc.stdout + proc.stderr

    def state(self) -> dict:
        return self.docker.inspect("container", self.docker_name)["State"]

    def exited(self) -> int | None:
        """The container's exit code once it has stopped, else None."""
        state = self.state()
        return None if state["Running"] or state.get("Restarting") else state["ExitCode"]

    def fail(self, why: str) -> PodFailed:
        return PodFailed(f"pod {self.name}: {why}\n--- its log ---\n{self.logs()[-4000:]}")

    # ---------------------------------------------------------------- probes

    def port(self, port: int | str) -> int:
        """A probe's port: a number, or the name of one of the container's ports."""
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        named = {p["name"]: p["containerPort"] for p in self.container.get("ports", []) if "name" in p}
        if port not in named:
            raise self.fail(f"probe port {port!r} names none of the container's ports {sorted(named)}")
        return named[port]

    def probe(self, probe: dict) -> bool:
        """Run one probe once, as the kubelet does: from the host, against the pod's IP."""
        timeout = probe.get("timeoutSeconds", 1)
        if "grpc" in probe:
            import grpc
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            with grpc.insecure_channel(f"{self.ip}:{self.port(probe['grpc']['port'])}") as channel:
                try:
                    reply = health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(service=probe["grpc"].get("service", "")), timeout=timeout)
                except grpc.RpcError:
                    return False
                return reply.status == health_pb2.HealthCheckResponse.SERVING
        if "httpGet" in probe:
            get = probe["httpGet"]
            if get.get("scheme", "HTTP") != "HTTP" or get.get("httpHeaders") or get.get("host"):
                raise self.fail(f"httpGet probe {get}: only plain HTTP to the pod is run here")
            try:
                with urllib.request.urlopen(f"http://{self.ip}:{self.port(get['port'])}{get.get('path', '/')}",
                                            timeout=timeout) as r:
                    return 200 <= r.status < 400
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                return False
        if "tcpSocket" in probe:
            try:
                socket.create_connection((self.ip, self.port(probe["tcpSocket"]["port"])), timeout=timeout).close()
                return True
            except OSError:
                return False
        if "exec" in probe:
            return self.docker.run("exec", self.docker_name, *probe["exec"]["command"], check=False,
                                   timeout=timeout + 5).returncode == 0
        raise self.fail(f"probe {probe}: no handler this module runs")

    def wait_ready(self, timeout: float = 300) -> float:
        """Until the pod is ready by its own probes, as the kubelet decides it: the startup probe (or,
        without one, the liveness probe) must pass within the time the kubelet gives it
        (initialDelaySeconds + failureThreshold x periodSeconds) or the kubelet would restart the
        container; then the readiness probe must pass (a container without one is ready once started).
        Probes run every second, not every periodSeconds: what is tested is what they ask. Returns the
        seconds it took; PodFailed if the container exits, outlives its probe's budget, or is not ready
        after `timeout`."""
        start = time.monotonic()
        kind = "startupProbe" if "startupProbe" in self.container else "livenessProbe"
        first, readiness = self.container.get(kind), self.container.get("readinessProbe")
        budget = first and first.get("initialDelaySeconds", 0) + first.get("failureThreshold", 3) * first.get("periodSeconds", 10)
        while True:
            if (code := self.exited()) is not None:
                raise self.fail(f"its container exited with {code} before it was ready")
            elapsed = time.monotonic() - start
            if first is not None:
                if self.probe(first):
                    first = None
                elif elapsed > budget:
                    raise self.fail(f"its {kind} failed for {budget} s: the kubelet would restart it")
            if first is None and (readiness is None or self.probe(readiness)):
                return time.monotonic() - start
            if elapsed > timeout:
                raise self.fail(f"not ready after {timeout:.0f} s")
            time.sleep(1)

    def alive(self) -> bool:
        """The liveness probe passes (True where there is none)."""
        probe = self.container.get("livenessProbe")
        return probe is None or self.probe(probe)

    # ---------------------------------------------------------------- lifecycle

    def restart(self) -> None:
        """`docker restart`: the container stops (SIGTERM, then SIGKILL after the pod's grace period)
        and starts again with the same address, env and volumes, as a container restart in a pod."""
        grace = self.spec.get("terminationGracePeriodSeconds", 30)
        self.docker("restart", "-t", str(grace), self.docker_name, timeout=grace + 60)

    def remove(self) -> None:
        self.docker.run("rm", "-f", self.docker_name, check=False, timeout=60)
        for folder in self.folders:
            shutil.rmtree(folder, ignore_errors=True)


@dataclass
class Kubelet:
    """Starts pods on `network`; `configmaps` and `secrets` ({name: {key: text}}) and `api` serve
    their volumes and service accounts. Removes every container it started on close()."""

    docker: Docker
    network: Network
    workdir: Path
    configmaps: dict[str, dict[str, str]] = field(default_factory=dict)
    secrets: dict[str, dict[str, str]] = field(default_factory=dict)
    api: APIServer | None = None
    pods: list[Pod] = field(default_factory=list)

    def run(self, pod_spec: dict, name: str, namespace: str = "default", dns_names: tuple[str, ...] = ()) -> Pod:
        """Start the pod's one container (not waiting for it); `dns_names`: what else it answers to."""
        container = pod_spec["containers"][0]
        check_fields(name, pod_spec, container)
        image = container["image"]
        if self.docker.run("image", "inspect", image, check=False).returncode != 0:
            raise PodFailed(f"pod {name}: image {image} is not on this machine (nothing is pulled here)")
        ip = self.network.address()
        pod = Pod(self.docker, name, namespace, ip, container, pod_spec, f"{self.network.name}-{name}")
        args = ["run", "-d", "--name", pod.docker_name, "--hostname", name, "--network", self.network.name, "--ip", ip]
        for alias in dns_names:  # as cluster DNS would answer for it (its hostname is only its own)
            args += ["--network-alias", alias]
        env = self._env(pod, pod_spec)
        for key, value in env.items():
            args += ["--env", f"{key}={value}"]
        args += self._security(pod, pod_spec, container, image)
        args += self._resources(container)
        args += self._volumes(pod, pod_spec, container)
        args += ["--stop-timeout", str(pod_spec.get("terminationGracePeriodSeconds", 30))]
        command = [expand(a, env) for a in container.get("command", [])]
        if command:
            args += ["--entrypoint", command[0]]
        args += [image, *command[1:], *(expand(a, env) for a in container.get("args", []))]
        self.pods.append(pod)
        try:
            self.docker(*args)
        except DockerError as e:
            raise PodFailed(f"pod {name}: docker refused it: {e}") from e
        return pod

    def _env(self, pod: Pod, pod_spec: dict) -> dict[str, str]:
        env: dict[str, str] = {}
        if self.api is not None and pod_spec.get("serviceAccountName"):
            env |= {"KUBERNETES_SERVICE_HOST": self.api.host, "KUBERNETES_SERVICE_PORT": str(self.api.port)}
        fields = {"metadata.name": pod.name, "metadata.namespace": pod.namespace, "status.podIP": pod.ip,
                  "status.hostIP": self.network.gateway}
        for var in pod.container.get("env", []):
            if "value" in var:
                env[var["name"]] = expand(var["value"], env)
            elif (ref := var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")) in fields:
                env[var["name"]] = fields[ref]
            else:
                raise PodFailed(f"pod {pod.name}: env {var['name']}: {var.get('valueFrom')} is not run here")
        return env

    def _security(self, pod: Pod, pod_spec: dict, container: dict, image: str) -> list[str]:
        ctx = {**pod_spec.get("securityContext", {}), **container.get("securityContext", {})}
        image_user = self.docker.inspect("image", image)["Config"].get("User", "")
        uid = str(ctx.get("runAsUser", image_user.partition(":")[0] or "0"))
        if ctx.get("runAsNonRoot") and (not uid.isdigit() or int(uid) == 0):
            # The kubelet refuses such a container (CreateContainerConfigError): it cannot prove non-root.
            raise PodFailed(f"pod {pod.name}: runAsNonRoot, but the container would run as user {uid!r}")
        # Without runAsGroup the runtime takes the user's group from the image, as Docker does.
        args = ["--user", f"{uid}:{ctx['runAsGroup']}" if "runAsGroup" in ctx else uid]
        for group in [ctx.get("fsGroup"), *ctx.get("supplementalGroups", [])]:
            if group is not None:
                args += ["--group-add", str(group)]
        if ctx.get("readOnlyRootFilesystem"):
            args.append("--read-only")
        if ctx.get("allowPrivilegeEscalation") is False:
            args += ["--security-opt", "no-new-privileges"]
        for cap in ctx.get("capabilities", {}).get("drop", []):
            args += ["--cap-drop", cap]
        for cap in ctx.get("capabilities", {}).get("add", []):
            args += ["--cap-add", cap]
        seccomp = ctx.get("seccompProfile", {}).get("type", "RuntimeDefault")
        if seccomp != "RuntimeDefault":  # Docker's default profile is the runtime's default
            raise PodFailed(f"pod {pod.name}: seccompProfile {seccomp} is not run here")
        return args

    @staticmethod
    def _resources(container: dict) -> list[str]:
        limits = container.get("resources", {}).get("limits", {})
        args = []
        if "memory" in limits:  # no swap beyond the limit, as on a node
            memory = str(int(parse_quantity(limits["memory"])))
            args += ["--memory", memory, "--memory-swap", memory]
        if "cpu" in limits:
            args += ["--cpus", f"{float(parse_quantity(limits['cpu'])):g}"]
        extended = [k for k in limits if "/" in k]
        if extended:
            raise PodFailed(f"extended resources {extended} are not run here")
        return args

    def _volumes(self, pod: Pod, pod_spec: dict, container: dict) -> list[str]:
        fs_group = pod_spec.get("securityContext", {}).get("fsGroup")
        volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
        args = []
        mounts = list(container.get("volumeMounts", []))
        if self.api is not None and pod_spec.get("serviceAccountName"):
            volumes["kube-api-access"] = {"name": "kube-api-access", "serviceAccount": True}
            mounts.append({"name": "kube-api-access", "mountPath": SERVICE_ACCOUNT_DIR, "readOnly": True})
        for mount in mounts:
            volume = volumes.get(mount["name"])
            if volume is None:
                raise PodFailed(f"pod {pod.name}: volumeMount {mount['name']} names no volume")
            target, read_only = mount["mountPath"], mount.get("readOnly", False)
            if "emptyDir" in volume and volume["emptyDir"].get("medium") == "Memory":
                size = volume["emptyDir"].get("sizeLimit")
                options = f"type=tmpfs,destination={target},tmpfs-mode=1777"
                args += ["--mount", options + (f",tmpfs-size={int(parse_quantity(size))}" if size else "")]
                continue
            folder = self.workdir / pod.name / mount["name"]
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            pod.folders.append(folder)
            if "emptyDir" in volume:
                # The kubelet makes an emptyDir world-writable, group-owned by the pod's fsGroup.
                folder.chmod(0o777)
                if fs_group is not None:
                    shutil.chown(folder, group=fs_group)
                    folder.chmod(0o2777)
            elif "configMap" in volume:
                data = self.configmaps.get(volume["configMap"]["name"])
                if data is None:
                    raise PodFailed(f"pod {pod.name}: configMap {volume['configMap']['name']} was not given")
                for key, value in data.items():
                    (folder / key).write_text(value)
                    (folder / key).chmod(0o644)
                folder.chmod(0o755)
                read_only = True
            elif "secret" in volume:
                data = self.secrets.get(volume["secret"]["secretName"])
                if data is None:
                    raise PodFailed(f"pod {pod.name}: secret {volume['secret']['secretName']} was not given")
                for key, value in data.items():
                    (folder / key).write_text(value)
                    if fs_group is not None:
                        shutil.chown(folder / key, group=fs_group)
                    (folder / key).chmod(volume["secret"].get("defaultMode", 0o644))
                folder.chmod(0o755)
                read_only = True
            elif volume.get("serviceAccount"):
                (folder / "token").write_text(self.api.token)
                (folder / "namespace").write_text(pod.namespace)
                shutil.copyfile(self.api.ca_file, folder / "ca.crt")
                for f in folder.iterdir():
                    f.chmod(0o644)
                folder.chmod(0o755)
                read_only = True
            else:
                raise PodFailed(f"pod {pod.name}: volume {volume} is not run here")
            args += ["--mount", f"type=bind,source={folder},destination={target}" + (",readonly" if read_only else "")]
        return args

    def close(self) -> None:
        for pod in self.pods:
            pod.remove()
        self.pods.clear()
