"""`tandem serve` with mutual TLS on its gRPC port (--tls-cert, --tls-key, --tls-ca), as a real
process: a client with a certificate the CA signed generates; one without a certificate, or
plaintext, is refused at the handshake; the startup log says what the port speaks."""

from __future__ import annotations

import grpc
import pytest

from support.certs import issue, make_ca
from support.serving import ServerProcess
from tandem.server.scheduling.sampling_params import SamplingParams
from tandem.tools.client import Client, request_message
from tandem.tools.stack import wait_healthy


def test_a_server_with_mutual_tls_serves_certified_clients_only(tmp_path):
    ca = make_ca(tmp_path / "ca", "tandem-ca")
    cert = issue(ca, tmp_path / "server", "server")
    router = issue(ca, tmp_path / "client", "router", client=True)
    server = ServerProcess("--tls-cert", str(cert.cert), "--tls-key", str(cert.key), "--tls-ca", str(ca.cert),
                           log_path=tmp_path / "server.log", wait=False)
    trusted = grpc.ssl_channel_credentials(ca.cert.read_bytes(), router.key.read_bytes(), router.cert.read_bytes())
    try:
        wait_healthy(server.target, server.proc, server.log_path, credentials=trusted)
        message = request_message(list(range(100, 140)), SamplingParams(max_new_tokens=6, temperature=0.0))
        client = Client(server.target, trusted)
        try:
            assert len(client.stream(message, timeout=60).output_ids) == 6
        finally:
            client.close()
        for credentials in (grpc.ssl_channel_credentials(ca.cert.read_bytes()), None):  # no certificate; plaintext
            client = Client(server.target, credentials)
            try:
                with pytest.raises(grpc.RpcError) as e:
                    client.stream(message, timeout=10)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            finally:
                client.close()
    finally:
        server.stop()
    assert "(gRPC, mutual TLS;" in server.log_path.read_text()
