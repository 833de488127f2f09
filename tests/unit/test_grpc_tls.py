"""The gRPC port over TLS (`tandem.server.edge.tls`): a real grpc server with the health service,
bound as `tandem serve` binds it, called by clients with and without certificates. Mutual TLS
refuses a client without a certificate, or with one another CA signed, at the handshake; renewed
files serve new handshakes without a restart; files that do not load keep the old certificate."""

from __future__ import annotations

import shutil
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tandem.tools.certs import issue, make_ca
from tandem.server.config import ServeConfig
from tandem.server.edge.tls import ServerCertificates, bind
from tandem.tools.stack import free_port


@pytest.fixture
def pki(tmp_path):
    ca = make_ca(tmp_path / "ca", "tandem-ca")
    server = issue(ca, tmp_path / "server", "server")
    client = issue(ca, tmp_path / "client", "router", client=True)
    other_ca = make_ca(tmp_path / "other", "other-ca")
    stranger = issue(other_ca, tmp_path / "other", "stranger", client=True)
    return dict(ca=ca, server=server, client=client, other_ca=other_ca, stranger=stranger, dir=tmp_path)


def serve(certificates: ServerCertificates | None) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = bind(server, "127.0.0.1", free_port(), certificates)
    assert port
    server.start()
    return server, port


def check(port: int, ca=None, client=None, plaintext: bool = False) -> str:
    """SERVING, or the status code's name of a failed call."""
    target = f"127.0.0.1:{port}"
    if plaintext:
        channel = grpc.insecure_channel(target)
    else:
        creds = grpc.ssl_channel_credentials(
            root_certificates=ca.cert.read_bytes() if ca else None,
            private_key=client.key.read_bytes() if client else None,
            certificate_chain=client.cert.read_bytes() if client else None)
        channel = grpc.secure_channel(target, creds)
    with channel:
        try:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        except grpc.RpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)


def test_mutual_tls_admits_only_clients_the_ca_signed(pki):
    server, port = serve(ServerCertificates(str(pki["server"].cert), str(pki["server"].key), str(pki["ca"].cert)))
    try:
        assert check(port, pki["ca"], pki["client"]) == "SERVING"
        assert check(port, pki["ca"]) == "UNAVAILABLE"  # no client certificate
        assert check(port, pki["ca"], pki["stranger"]) == "UNAVAILABLE"  # another CA's
        assert check(port, plaintext=True) == "UNAVAILABLE"
        assert check(port, pki["other_ca"], pki["client"]) == "UNAVAILABLE"  # the client does not trust the server
    finally:
        server.stop(0)


def test_tls_without_a_ca_asks_no_client_certificate(pki):
    server, port = serve(ServerCertificates(str(pki["server"].cert), str(pki["server"].key)))
    try:
        assert check(port, pki["ca"]) == "SERVING"
        assert check(port, plaintext=True) == "UNAVAILABLE"
    finally:
        server.stop(0)


def test_renewed_files_serve_new_handshakes_without_a_restart(pki):
    """The files are replaced as a mounted Secret's are: a new server certificate and CA bundle,
    from another CA. New connections then need the new CA; broken files keep the last good ones."""
    live = pki["dir"] / "live"
    live.mkdir()
    for name, src in (("tls.crt", pki["server"].cert), ("tls.key", pki["server"].key), ("ca.crt", pki["ca"].cert)):
        shutil.copy(src, live / name)
    certificates = ServerCertificates(str(live / "tls.crt"), str(live / "tls.key"), str(live / "ca.crt"),
                                      recheck_seconds=0)
    server, port = serve(certificates)
    try:
        assert check(port, pki["ca"], pki["client"]) == "SERVING"
        (live / "tls.crt").write_text("not a certificate")  # half-written: the previous one stays
        assert check(port, pki["ca"], pki["client"]) == "SERVING" and certificates.reloads == 0
        renewed = issue(pki["other_ca"], pki["dir"] / "renewed", "server")
        shutil.copy(renewed.cert, live / "tls.crt")
        shutil.copy(renewed.key, live / "tls.key")
        shutil.copy(pki["other_ca"].cert, live / "ca.crt")
        assert check(port, pki["other_ca"], pki["stranger"]) == "SERVING"
        assert certificates.reloads == 1
        assert check(port, pki["ca"], pki["client"]) == "UNAVAILABLE"  # the old CA no longer
    finally:
        server.stop(0)


def test_flags_go_together_and_name_themselves(tmp_path):
    (tmp_path / "c").write_text("x")
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        ServeConfig(tls_cert=str(tmp_path / "c")).validate()
    with pytest.raises(ValueError, match="--tls-ca=.* needs --tls-cert"):
        ServeConfig(tls_ca=str(tmp_path / "c")).validate()
    with pytest.raises(ValueError, match="--tls-key=.* cannot be read"):
        ServeConfig(tls_cert=str(tmp_path / "c"), tls_key=str(tmp_path / "absent")).validate()
