"""The decode's bootstrap client against a peer that dies: no answer, or half of one, is a
BootstrapError the decode's peer state machine takes (`unreachable`, `refused`), never an
exception that escapes into the engine loop."""

from __future__ import annotations

import socket
import threading

import pytest

from tandem.server.disagg.bootstrap import BootstrapClient, BootstrapError


def one_answer(raw: bytes) -> tuple[int, threading.Thread]:
    """A port on 127.0.0.1 whose first connection gets `raw` after the request, then a close."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def serve():
        with server:
            conn, _ = server.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(raw)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return port, thread


@pytest.mark.parametrize("raw", [
    b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: 249\r\n\r\n",  # killed after the headers
    b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n{\"instance\": \"a",  # a body cut short
    b"",  # closed before any answer
], ids=["incomplete-read", "truncated-json", "no-answer"])
def test_half_an_answer_is_an_unreachable_peer(raw):
    port, thread = one_answer(raw)
    with pytest.raises(BootstrapError) as err:
        BootstrapClient("127.0.0.1", port, timeout=5).heartbeat({"decode": "d", "decode_instance": "i"})
    thread.join(5)
    assert err.value.unreachable and not err.value.refused
    assert f"bootstrap service 127.0.0.1:{port} unreachable" in str(err.value)


def test_a_closed_port_is_refused():
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]  # closed again below: nothing listens there
    with pytest.raises(BootstrapError) as err:
        BootstrapClient("127.0.0.1", port, timeout=5).heartbeat({"decode": "d", "decode_instance": "i"})
    assert err.value.unreachable and err.value.refused
