"""The operator image, deployed as the Helm chart renders it (its Deployment's command, args, env,
security context and probe run as written by support/kubelet.py, its service account's token and CA
mounted as a kubelet mounts them), against the KMock API server the e2e tests use, here over TLS on
the test's Docker network as an API server is reached from a pod: it becomes live by its own probe and
reconciles an InferenceService into the objects the operator's renderer makes, StatefulSets first."""

from __future__ import annotations

import asyncio
import ssl
import subprocess

import aiohttp
import aiohttp.test_utils
import kmock
import pytest

from support.chart import render_chart
from support.docker import REPORT, TAG
from support.kube_emulator import (ISVC, NS, URL, StampingEmulator, declare_resources, eventually, example,
                                   owned_by)
from support.kubelet import APIServer, Kubelet
from tandem.operator import kube, render
from tandem.operator.spec import POOLS, parse_spec


def certificate(folder, ip: str):
    """A self-signed certificate for the API server's address: (cert, key); the cert is the pods' CA."""
    cert, key = folder / "ca.crt", folder / "server.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=kmock",
                    "-addext", f"subjectAltName=IP:{ip}", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


def tls_server(cert, key) -> type[aiohttp.test_utils.RawTestServer]:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)

    class TLSServer(aiohttp.test_utils.RawTestServer):
        async def start_server(self, **kwargs):
            await super().start_server(ssl=context, **kwargs)

    return TLSServer


def insecure_client(url):
    """The test's own client of KMock (the operator verifies the certificate; the test need not)."""
    return aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(ssl=False))


@pytest.mark.asyncio
async def test_the_charts_operator_reconciles_an_inference_service(docker, images, network, tmp_path):
    values = {"operator": {"image": {"repository": images["operator"].rpartition(":")[0], "tag": TAG,
                                     "pullPolicy": "IfNotPresent"}},
              "routerImage": {"repository": images["router"].rpartition(":")[0], "tag": TAG}}
    (deployment,) = [d for d in render_chart(values) if d["kind"] == "Deployment"]
    cert, key = certificate(tmp_path, network.gateway)
    async with StampingEmulator() as emulator, kmock.Server(emulator, host=network.gateway, port=0,
                                                            server_cls=tls_server(cert, key),
                                                            client_fct=insecure_client) as server:
        declare_resources(emulator, monitoring=False)
        kubelet = Kubelet(docker, network, tmp_path / "pods", api=APIServer(network.gateway, server.port, cert))
        pod = None
        try:
            pod = await asyncio.to_thread(kubelet.run, deployment["spec"]["template"]["spec"], "tandem-operator-0",
                                          "tandem-system")
            REPORT["operator pod live after"] = f"{await asyncio.to_thread(pod.wait_ready, 120):.0f} s"

            body = example("minimal")
            body["spec"]["image"] = images["server-cpu"]
            resp = await emulator.post(URL, json=body)
            assert resp.status == 200, await resp.text()
            uid = emulator.objects[ISVC, NS, "smollm2"]["metadata"]["uid"]
            operator_args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
            flag = {name: operator_args[operator_args.index(name) + 1]
                    for name in ("--router-image", "--operator-namespace")}
            defaults = render.Defaults(router_image=flag["--router-image"],
                                       operator_namespace=flag["--operator-namespace"])
            inst = render.Instance(name="smollm2", namespace=NS, uid=uid, spec=parse_spec("smollm2", body["spec"]),
                                   defaults=defaults)
            desired = {(o["kind"], o["metadata"]["name"]): o for o in render.render_all(inst, monitoring_available=False)}
            plural = {kind: name for (_, kind), name in kube.PLURALS.items()}

            def reconciled():
                owned = owned_by(emulator, uid)
                return all((plural[kind], name) in owned for kind, name in desired) and owned

            owned = await eventually(reconciled, timeout=120, what=f"{sorted(desired)}")
            assert pod.alive() and pod.exited() is None
        finally:
            logs = pod.logs() if pod is not None else ""
            await asyncio.to_thread(kubelet.close)
        for (kind, name), obj in desired.items():
            assert kube.up_to_date(obj, owned[plural[kind], name].raw), (kind, name, logs[-3000:])
        for pool in POOLS:
            assert owned["statefulsets", inst.pool_name(pool)]["spec"]["template"]["spec"]["containers"][0]["image"] == images["server-cpu"]
