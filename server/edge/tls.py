"""gRPC over TLS for `tandem serve` (`--tls-cert`, `--tls-key`, `--tls-ca`).

With a certificate and key the gRPC port speaks TLS; with a CA bundle too, every client must
present a certificate that CA signed (mutual TLS), and a client without one fails its handshake
before any call reaches the server. The Prometheus port stays plain HTTP.

Certificates are renewed without a restart: the files are looked at again (at most every
`recheck_seconds`) when a client connects, and a new certificate, key or CA bundle, as cert-manager
or the kubelet writes them into a mounted Secret, serves every handshake from then on. Connections
already open keep the certificate they were made with. Files that fail to load (a half-written
renewal) leave the previous certificate in place, and the failure is logged.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time

import grpc

log = logging.getLogger("tandem.serve")


class ServerCertificates:
    """The PEM files of a TLS gRPC port: `cert` (chain) and `key`, and `ca` (client CAs; None: no
    client certificate asked)."""

    def __init__(self, cert: str, key: str, ca: str | None = None, recheck_seconds: float = 10.0):
        self.paths = [p for p in (cert, key, ca) if p is not None]
        self.cert, self.key, self.ca = cert, key, ca
        self.recheck_seconds = recheck_seconds
        self._lock = threading.Lock()
        self._checked = time.monotonic()
        self._stamp = self._stat()
        self.reloads = 0

    def _stat(self) -> tuple:
        """What changes when a file is replaced (a mounted Secret swaps a symlink; stat follows it)."""
        stamps = []
        for path in self.paths:
            st = os.stat(path)
            stamps.append((st.st_ino, st.st_mtime_ns, st.st_size))
        return tuple(stamps)

    def _configuration(self):
        """The files as gRPC takes them, once Python's own TLS has loaded them (gRPC checks them
        only at a handshake, and then quietly keeps what it had): the key must match the
        certificate, the CA bundle must parse."""
        check = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        check.load_cert_chain(self.cert, self.key)
        if self.ca:
            check.load_verify_locations(self.ca)

        def read(path: str) -> bytes:
            with open(path, "rb") as f:
                return f.read()

        return grpc.ssl_server_certificate_configuration(
            [(read(self.key), read(self.cert))], root_certificates=read(self.ca) if self.ca else None)

    def fetch(self):
        """gRPC's question at a handshake: a new configuration, or None to keep the current one."""
        with self._lock:
            now = time.monotonic()
            if now - self._checked < self.recheck_seconds:
                return None
            self._checked = now
            try:
                stamp = self._stat()
                if stamp == self._stamp:
                    return None
                configuration = self._configuration()
            except (OSError, ValueError, RuntimeError) as e:
                log.warning("TLS files changed but do not load (%s); serving the previous certificate", e)
                return None
            self._stamp = stamp
            self.reloads += 1
            log.info("TLS certificate files changed: new handshakes use them (reload %d)", self.reloads)
            return configuration

    def credentials(self) -> grpc.ServerCredentials:
        try:
            initial = self._configuration()
        except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
            raise ValueError(f"--tls-cert={self.cert!r} / --tls-key={self.key!r} / --tls-ca={self.ca!r} do not "
                             f"load: {e}") from None
        return grpc.dynamic_ssl_server_credentials(initial, self.fetch, require_client_authentication=self.ca is not None)


def bind(server: grpc.Server, host: str, port: int, certificates: ServerCertificates | None) -> int:
    """Listen on host:port, over TLS with `certificates`; the port bound (0: could not)."""
    if certificates is None:
        return server.add_insecure_port(f"{host}:{port}")
    return server.add_secure_port(f"{host}:{port}", certificates.credentials())
