"""The bootstrap service's tokens (`--bootstrap-token-file`): a real BootstrapService on 127.0.0.1
over a PrefillRoomTable, called with and without tokens. A refused call gets 401 with its reason, is
counted, and leaves the table as it was; a token-less prefill still answers a decode that sends
one (a rolling upgrade)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tandem.server.config import DisaggConfig
from tandem.server.disagg.bootstrap import BootstrapClient, BootstrapError, BootstrapService, is_loopback
from tandem.server.disagg.layout import KVBuffer, KVLayout
from tandem.server.disagg.prefill_rooms import PrefillRoomTable, RoomState
from tandem.server.edge.metrics import Metrics, exported_metric_names
from tandem.server.loop.stats import EngineSnapshot
from tandem.tools.stack import free_port

LAYOUT = KVLayout(model="llama:m", kv_dtype="float32", page_size=4, num_layers=2, num_kv_heads=1, head_dim=2, page_bytes=32)
ME = {"decode": "decode-0", "decode_instance": "d1"}


@pytest.fixture
def service():
    """A prefill's bootstrap service accepting "new-token" and "old-token" (mid-rotation)."""
    table = PrefillRoomTable(LAYOUT, "127.0.0.1:1")
    port = free_port()
    svc = BootstrapService(table, "127.0.0.1", port, ["new-token", "old-token"])
    yield table, port
    svc.close()


def raw(port: int, path: str, body: dict | None = None, headers: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data, {"Content-Type": "application/json",
                                                                         **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        assert e.code != 401 or e.headers["WWW-Authenticate"] == "Bearer"
        return e.code, json.load(e)


def peer_body() -> dict:
    return {**ME, "session": "127.0.0.1:2", "layout": LAYOUT.to_json(),
            "kv_parts": [KVBuffer(0x1000, 1024, 0, 1).to_json()], "record_base": 0x9000}


def test_calls_without_a_token_or_with_a_wrong_one_are_refused_and_touch_nothing(service):
    table, port = service
    assert raw(port, "/v1/layout") == (401, {"error": "the call carried no bootstrap token: this prefill requires one "
                                                      "(--bootstrap-token-file)", "reason": "missing_token"})
    code, answer = raw(port, "/v1/peers", peer_body(), {"Authorization": "Bearer guessed"})
    assert (code, answer["reason"]) == (401, "wrong_token") and "instance" not in answer
    code, answer = raw(port, "/v1/rooms", {**ME, "room": 7, "request_id": "r", "prompt_len": 4, "digest": 0,
                                           "pages": [1], "record_slot": 0}, {"Authorization": "Basic new-token"})
    assert (code, answer["reason"]) == (401, "missing_token")
    assert raw(port, "/v1/peers/leave", ME, {"Authorization": "Bearer "})[0] == 401
    assert table.peers() == [] and table.status([7])["rooms"]["7"]["state"] == RoomState.UNKNOWN.value
    assert table.refusals() == (("missing_token", 3), ("wrong_token", 1))
    assert raw(port, "/health") == (200, {"ok": True, "instance": table.instance})  # open: it tells nothing


def test_either_accepted_token_works(service):
    table, port = service
    for token in ("new-token", "old-token"):
        answer = BootstrapClient("127.0.0.1", port, token=token).layout()
        assert answer["instance"] == table.instance and answer["layout"] == LAYOUT
    BootstrapClient("127.0.0.1", port, token="new-token").add_peer(ME, "127.0.0.1:2", LAYOUT,
                                                                    [KVBuffer(0x1000, 1024, 0, 1)], 0x9000)
    assert [p["decode"] for p in table.peers()] == ["decode-0"]
    assert table.refusals() == ()


@pytest.mark.parametrize("token, reason, says", [(None, "missing_token", "carried no bootstrap token"),
                                                 ("stale", "wrong_token", "does not accept")])
def test_a_decode_without_the_prefills_token_fails_for_good_saying_which_side_lacks_it(service, token, reason, says):
    _, port = service
    with pytest.raises(BootstrapError) as e:
        BootstrapClient("127.0.0.1", port, token=token).layout()
    assert e.value.reason == reason and e.value.conflict and not e.value.unreachable  # no retry can help
    assert says in str(e.value) and "--bootstrap-token-file" in str(e.value)


def test_a_prefill_without_tokens_answers_a_decode_that_sends_one():
    table = PrefillRoomTable(LAYOUT, "127.0.0.1:1")
    port = free_port()
    svc = BootstrapService(table, "127.0.0.1", port)
    try:
        assert BootstrapClient("127.0.0.1", port, token="new-token").layout()["instance"] == table.instance
    finally:
        svc.close()


def test_token_file_lines_and_its_errors_name_the_flag(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("\n  first \n\nsecond\n")
    assert DisaggConfig(bootstrap_token_file=str(path)).bootstrap_tokens() == ["first", "second"]
    assert DisaggConfig().bootstrap_tokens() == []
    path.write_text("\n \n")
    with pytest.raises(ValueError, match=r"--bootstrap-token-file=.* holds no token"):
        DisaggConfig(role="prefill", bootstrap_token_file=str(path)).validate()
    with pytest.raises(ValueError, match=r"--bootstrap-token-file=.* cannot be read"):
        DisaggConfig(role="decode", bootstrap_token_file=str(tmp_path / "absent")).validate()


def test_loopback_hosts():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.5") and not is_loopback("prefill-0.svc")


def test_refusals_are_a_counter_by_reason_with_every_reason_exported_from_the_start():
    metrics = Metrics("prefill", "m")
    text = lambda: __import__("prometheus_client").generate_latest(metrics.registry).decode()  # noqa: E731
    assert 'tandem_bootstrap_refused_total{model="m",reason="missing_token",role="prefill"} 0.0' in text()
    metrics.bind(lambda: EngineSnapshot(bootstrap_refused=(("wrong_token", 3),)))
    assert 'tandem_bootstrap_refused_total{model="m",reason="wrong_token",role="prefill"} 3.0' in text()
    assert 'tandem_bootstrap_refused_total{model="m",reason="missing_token",role="prefill"} 0.0' in text()
    assert "tandem_bootstrap_refused_total" in exported_metric_names()
