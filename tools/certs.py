"""Certificates for local TLS (tests, `tandem bench pd --tls`), made with `cryptography` (a
development dependency): a CA, and server or client certificates it signs, as PEM files valid for a
day."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

try:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
except ImportError as e:  # pragma: no cover - the dev extras install it
    raise ImportError("making local certificates needs the `cryptography` package: pip install cryptography") from e


@dataclass
class Issued:
    cert: Path
    key: Path
    _cert: x509.Certificate
    _key: ec.EllipticCurvePrivateKey


def _write(folder: Path, name: str, cert: x509.Certificate, key) -> Issued:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    return Issued(folder / f"{name}.crt", folder / f"{name}.key", cert, key)


def _builder(subject: str, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(issuer).public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1)))


def make_ca(folder: Path, name: str = "ca") -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    builder = _builder(name, x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]), key.public_key())
    cert = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(key, hashes.SHA256())
    return _write(folder, name, cert, key)


def issue(ca: Issued, folder: Path, name: str, client: bool = False) -> Issued:
    """A certificate for 127.0.0.1 and localhost (server), or a client certificate named `name`."""
    key = ec.generate_private_key(ec.SECP256R1())
    usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
    builder = (_builder(name, ca._cert.subject, key.public_key())
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
    if not client:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return _write(folder, name, builder.sign(ca._key, hashes.SHA256()), key)


@dataclass
class MutualTLS:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all under one folder."""

    ca: Issued
    server: Issued
    client: Issued

    def serve_flags(self) -> list[str]:
        """`tandem serve`'s flags for gRPC over mutual TLS."""
        return ["--tls-cert", str(self.server.cert), "--tls-key", str(self.server.key), "--tls-ca", str(self.ca.cert)]

    def client_credentials(self):
        import grpc

        return grpc.ssl_channel_credentials(self.ca.cert.read_bytes(), self.client.key.read_bytes(),
                                            self.client.cert.read_bytes())


def mutual_tls(folder: Path) -> MutualTLS:
    ca = make_ca(folder / "ca", "tandem-ca")
    return MutualTLS(ca, issue(ca, folder / "server", "server"), issue(ca, folder / "client", "client", client=True))
