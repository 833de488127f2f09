"""`tandem serve` with mutual TLS on its gRPC port (--tls-cert, --tls-key, --tls-ca), as a real
process: a client with a certificate the CA signed generates; one without a certificate, or
plaintext, is refused at the handshake; the startup log says what the port speaks. A prefill +
decode pair serves over it too."""

from __future__ import annotations

import grpc
import pytest

from tandem.tools.certs import issue, make_ca
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


def test_a_prefill_decode_pair_over_mutual_tls(tmp_path):
    """Both servers of a pair with mutual TLS (LocalStack(tls=...)): both legs of each request, sent
    as the router sends them (`tandem bench pd --tls`'s runner), complete; nothing stays held; and
    the decode refuses a plaintext client."""
    from support.serving import assert_all_freed, float32
    from tandem.tools.bench_serve import pd_grpc_runner
    from tandem.tools.certs import mutual_tls
    from tandem.tools.stack import LocalStack

    with LocalStack(tmp_path, float32(()), tls=mutual_tls(tmp_path / "certs")) as stack:
        prefill, decode = stack.start_servers(["prefill", "decode"])
        stack.wait()
        run_one, close = pd_grpc_runner(prefill.target, prefill.bootstrap_port, decode.target, prefill.credentials)
        try:
            samples = [run_one(list(range(100 + 40 * i, 140 + 50 * i)), 5 + i) for i in range(3)]
        finally:
            close()
        assert [s.output_tokens for s in samples] == [5, 6, 7]
        assert_all_freed(stack.servers)
        plaintext = Client(decode.target)
        try:
            with pytest.raises(grpc.RpcError) as e:
                plaintext.stream(request_message([1, 2, 3], SamplingParams(max_new_tokens=2)), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            plaintext.close()
        for server in stack.servers:
            assert "(gRPC, mutual TLS;" in server.log_path.read_text()
