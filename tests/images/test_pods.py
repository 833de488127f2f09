"""What the operator renders for an InferenceService, run as written from the images: a prefill pod, a
decode pod and the router, each a container with exactly its rendered command, args, env, volumes,
security context and limits (support/kubelet.py), on a Docker network of the test's own, each with its
own address, KV moving between the two servers over Mooncake TCP. Each becomes ready by its own rendered
probes; a chat completion through the router is token-identical to the same request on a local stack of
processes; the servers size their KV pool and threads from the container's limits; they come back from
`docker restart`, the prefill's and then the decode's; and a misspelled rendered flag fails."""

from __future__ import annotations

import copy
import re
import time
import urllib.request
from dataclasses import dataclass

import pytest
import yaml

from support.docker import REPO, REPORT
from support.kubelet import Kubelet, Pod, PodFailed
from tandem.operator import render
from tandem.operator.spec import POOLS, parse_spec
from tandem.tools.client import stream_openai
from tandem.tools.stack import LocalStack, metric_value

NAME, NAMESPACE = "smollm2", "default"
CPUS, MEMORY = "1", "3Gi"
QUESTION = "Give me three tips for writing readable Python code."
NEW_TOKENS = 32


def instance(images: dict[str, str]) -> render.Instance:
    """examples/minimal.yaml on the server-cpu image, each server limited to one CPU and 3 GiB, in
    float32: the dtype whose tokens tandem keeps identical under any batching and prefix-cache hit (a
    restarted prefill computes from an empty cache what its predecessor took from its cache)."""
    body = yaml.safe_load((REPO / "examples" / "minimal.yaml").read_text())
    spec = body["spec"] | {"image": images["server-cpu"], "imagePullPolicy": "IfNotPresent"}
    spec["model"] = {**spec["model"], "dtype": "float32"}
    limits = {"cpu": CPUS, "memory": MEMORY}
    for pool in POOLS:
        spec[pool] = {**spec.get(pool, {}), "resources": {"requests": limits, "limits": limits}}
    return render.Instance(name=NAME, namespace=NAMESPACE, uid="uid", spec=parse_spec(NAME, spec),
                           defaults=render.Defaults(router_image=images["router"]))


def stream_chat(base: str, model: str) -> tuple[str, int, float]:
    """One greedy chat answer: (text, completion tokens, seconds to its first token)."""
    body = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": NEW_TOKENS,
            "temperature": 0, "stream_options": {"include_usage": True}}
    start, ttft, text, tokens = time.perf_counter(), None, "", None
    for event in stream_openai(base, "/v1/chat/completions", body):
        tokens = event["usage"]["completion_tokens"] if event.get("usage") else tokens
        for choice in event.get("choices", []):
            if piece := choice.get("delta", {}).get("content"):
                ttft = ttft if ttft is not None else time.perf_counter() - start
                text += piece
    return text, tokens, ttft


@dataclass
class Stack:
    inst: render.Instance
    objects: dict[tuple[str, str], dict]
    pods: dict[str, Pod]  # prefill, decode, router
    reference: tuple[str, int, float]  # the local stack's answer

    @property
    def router_url(self) -> str:
        return f"http://{self.pods['router'].ip}:{render.ROUTER_HTTP_PORT}"

    def chat(self) -> tuple[str, int, float]:
        return stream_chat(self.router_url, self.inst.spec.model.name)


def local_reference(inst: render.Instance, log_dir) -> tuple[str, int, float]:
    """The same request on a local stack of processes with the servers' dtype and one thread each, as
    the containers' CPU limit gives them."""
    stack = LocalStack(log_dir, ("--dtype", inst.spec.model.dtype, "--num-threads", CPUS), inst.spec.model.name)
    with stack:
        stack.start_servers(["prefill", "decode"])
        stack.wait()
        stream_chat(stack.start_router().url, stack.model_name)  # warm, as the containers are by their probes
        return stream_chat(stack.router_url, stack.model_name)


@pytest.fixture(scope="module")
def kubelet(docker, network, tmp_path_factory):
    kubelet = Kubelet(docker, network, tmp_path_factory.mktemp("pods"))
    yield kubelet
    kubelet.close()


@pytest.fixture(scope="module")
def stack(images, kubelet, tmp_path_factory) -> Stack:
    inst = instance(images)
    reference = local_reference(inst, tmp_path_factory.mktemp("local"))
    objects = {(o["kind"], o["metadata"]["name"]): o for o in render.render_all(inst)}
    kubelet.configmaps = {name: o["data"] for (kind, name), o in objects.items() if kind == "ConfigMap"}
    # what the operator creates once per InferenceService: the pools' bootstrap token
    kubelet.secrets = {inst.bootstrap_secret: render.render_bootstrap_secret(inst, "pods-test-token")["stringData"]}
    domain = inst.defaults.cluster_domain
    pods = {}
    for pool in POOLS:
        sts = objects["StatefulSet", inst.pool_name(pool)]
        assert sts["spec"]["replicas"] == 1
        name = f"{inst.pool_name(pool)}-0"
        service = sts["spec"]["serviceName"]
        pods[pool] = kubelet.run(sts["spec"]["template"]["spec"], name, NAMESPACE,
                                 dns_names=(inst.pod_host(pool, 0), f"{name}.{service}"))
    for pool in POOLS:
        REPORT[f"{pool} pod ready after"] = f"{pods[pool].wait_ready():.0f} s"
    router = objects["Deployment", inst.router_name]
    pods["router"] = kubelet.run(router["spec"]["template"]["spec"], f"{inst.router_name}-0", NAMESPACE,
                                 dns_names=(inst.router_name, f"{inst.router_name}.{NAMESPACE}.svc.{domain}"))
    REPORT["router pod ready after"] = f"{pods['router'].wait_ready():.0f} s"
    stack = Stack(inst, objects, pods, reference)
    stack.chat()  # warm, as the local stack was
    return stack


def test_every_pod_runs_as_rendered_and_is_ready_and_live(stack, docker):
    """Docker ran each container with exactly its rendered command and args (the kubelet's override of
    the image's entry point and command, `$(POD_IP)` expanded), as the rendered user, and its probes
    pass."""
    for role, pod in stack.pods.items():
        assert pod.probe(pod.container["readinessProbe"]) and pod.alive(), role
        assert int(docker("exec", pod.docker_name, "id", "-u")) == render.SERVER_UID, role
        ran = docker.inspect("container", pod.docker_name)
        rendered = pod.container["command"] + [a.replace("$(POD_IP)", pod.ip) for a in pod.container["args"]]
        assert [ran["Path"], *ran["Args"]] == rendered, role


def kv_bytes_sent(pod: Pod) -> float:
    with urllib.request.urlopen(f"http://{pod.ip}:{render.METRICS_PORT}/metrics", timeout=10) as r:
        return metric_value(r.read().decode(), "tandem_kv_transfer_bytes_total")


def test_chat_through_the_router_is_token_identical_to_the_local_stack(stack):
    """The KV moved from the prefill's container to the decode's over Mooncake TCP, each at its own
    address."""
    sent = kv_bytes_sent(stack.pods["prefill"])
    text, tokens, ttft = stack.chat()
    ref_text, ref_tokens, ref_ttft = stack.reference
    REPORT["TTFT, one chat (containers / local stack)"] = f"{ttft * 1000:.0f} ms / {ref_ttft * 1000:.0f} ms"
    assert (text, tokens) == (ref_text, ref_tokens) and tokens == NEW_TOKENS
    assert kv_bytes_sent(stack.pods["prefill"]) > sent
    for role in POOLS:
        assert re.search(rf"Mooncake session {re.escape(stack.pods[role].ip)}:\d+ \(tcp\)", stack.pods[role].logs()), role


def test_servers_size_themselves_from_the_container_limits(stack):
    """One torch thread (the CPU limit, of the host's cores), and a KV pool from what the memory limit
    leaves, not from the host's free memory."""
    limit = 3 * 2**30
    for pool in POOLS:
        log = stack.pods[pool].logs()
        assert re.search(r"1 torch threads \(cgroup v\d CPU quota 1 of the \d+ CPUs", log), log[-3000:]
        found = re.search(r"KV pool (\d+) tokens: --kv-memory-fraction ([\d.]+) of the free memory, cgroup v\d memory "
                          r"limit 3\.00 GiB, ([\d.]+) GiB in use: ([\d.]+) GiB available \(the host has ([\d.]+) GiB\)", log)
        assert found, log[-3000:]
        tokens, (fraction, used, available, host) = int(found[1]), map(float, found.groups()[1:])
        assert available < limit / 2**30 < host and abs(available + used - 3) < 0.02
        per_token = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M: 30 layers, K and V, 3 KV heads of 64, float32
        expected = fraction * available * 2**30 / per_token
        assert expected * 0.98 - 16 <= tokens <= expected * 1.02, (tokens, expected)
        REPORT[f"{pool} KV pool"] = f"{tokens} tokens from {available:.2f} GiB left by the {MEMORY} limit (host: {host:.1f} GiB)"


def test_servers_run_on_tcmalloc(stack):
    """The image installs libtcmalloc-minimal4 and `tandem serve` preloads it (--allocator auto, a CPU)."""
    for pool in POOLS:
        log = stack.pods[pool].logs()
        assert re.search(r"memory allocator: tcmalloc \(/usr/lib/\S+/libtcmalloc_minimal\.so\.4; auto: ", log), log[-3000:]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_restarted_server_serves_again(stack, role):
    pod = stack.pods[role]
    started = time.monotonic()
    pod.restart()
    pod.wait_ready()
    stack.pods["router"].wait_ready()
    REPORT[f"{role} back after docker restart"] = f"{time.monotonic() - started:.0f} s"
    text, tokens, _ = stack.chat()
    assert (text, tokens) == stack.reference[:2]


def test_a_misspelled_rendered_flag_fails(stack, kubelet):
    """The same prefill pod with one flag misspelled never becomes ready: the server refuses the flag."""
    spec = copy.deepcopy(stack.objects["StatefulSet", stack.inst.pool_name("prefill")]["spec"]["template"]["spec"])
    args = spec["containers"][0]["args"]
    args[args.index("--metrics-port")] = "--metrics-prot"
    pod = kubelet.run(spec, f"{stack.inst.pool_name('prefill')}-9", NAMESPACE)
    with pytest.raises(PodFailed, match=r"exited with 2") as failed:
        pod.wait_ready(timeout=120)
    assert "unrecognized arguments: --metrics-prot" in str(failed.value)
