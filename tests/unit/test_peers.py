"""The decode's prefill peers (server/disagg/decode_peers.py), driven with a fake clock: every (state,
event) pair against the transition table, then the paths the e2e roll tests take through real
servers (restart at the same address, SIGTERM leave, missed heartbeats, quarantine release)."""

from __future__ import annotations

import re

import pytest

from tandem.server.disagg import decode_peers as peers_module
from tandem.server.disagg.decode_peers import HEARTBEAT_MISSES, RETRY_S, TRANSITIONS, Moved, PeerBook, PeerEvent, PeerState, PrefillPeer

pytestmark = pytest.mark.unit

ADDRESS = ("10.0.0.1", 8998)
INTERVAL, TIMEOUT = 5.0, 10.0  # --peer-heartbeat-interval, --peer-timeout


def new_peer(address=ADDRESS) -> PrefillPeer:
    return PrefillPeer(address, INTERVAL, TIMEOUT)


def ready_peer(instance="A", now=0.0, address=ADDRESS) -> PrefillPeer:
    peer = new_peer(address)
    assert peer.on_connected(instance, head_major=False, skips_pages=True, now=now) == [
        Moved(PeerEvent.CONNECTED, PeerState.CONNECTING, PeerState.READY)]
    return peer


def peer_in(state: PeerState) -> PrefillPeer:
    """A peer brought to `state` the way the connector brings it there."""
    if state is PeerState.CONNECTING:
        return new_peer()
    if state is PeerState.FAILED:
        peer = new_peer()
        peer.on_handshake_failed("handshake failed: connection refused", "unavailable", now=0.0)
        return peer
    peer = ready_peer()
    if state is PeerState.LEAVING:
        peer.on_answer("A", leaving=True)
    elif state is PeerState.LOST:
        peer.on_heartbeat("A", leaving=False, known=False)
    elif state is PeerState.GONE:
        peer.on_answer("B", leaving=False)
    assert peer.state is state
    return peer


def fire(peer: PrefillPeer, event: PeerEvent, now: float = 1.0) -> list[Moved]:
    """`event`, and nothing else, through the peer's public calls."""
    if event is PeerEvent.CONNECTED:
        return peer.on_connected("C", head_major=False, skips_pages=False, now=now)
    if event is PeerEvent.HANDSHAKE_FAILED:
        return peer.on_handshake_failed("handshake failed", "unavailable", now)
    if event is PeerEvent.LEAVING:
        return peer.on_answer(peer.instance, leaving=True)
    if event is PeerEvent.FORGOTTEN:
        return peer.on_heartbeat(peer.instance, leaving=False, known=False)
    if event is PeerEvent.OFFLINE:
        return [m for _ in range(HEARTBEAT_MISSES) for m in peer.on_heartbeat_missed(True, False, "timed out", now)]
    if event is PeerEvent.REPLACED:
        return peer.on_answer(peer.instance + "-successor", leaving=False)
    if event is PeerEvent.NOTHING_LISTENS:
        return peer.on_no_answer(unreachable=True, refused=True, now=now)
    raise AssertionError(event)


@pytest.mark.parametrize("event", list(PeerEvent), ids=lambda e: e.value)
@pytest.mark.parametrize("state", list(PeerState), ids=lambda s: s.value)
def test_every_state_and_event_follows_the_table(state, event):
    peer = peer_in(state)
    after = TRANSITIONS.get((state, event))
    moved = fire(peer, event)
    if after is None:
        assert moved == [] and peer.state is state
    else:
        assert moved == [Moved(event, state, after)] and peer.state is after


def test_the_docstring_table_is_the_transition_table():
    doc = peers_module.__doc__
    arrows = re.findall(r"^\s+([A-Z]+)\s+--(\w+)-->\s+([A-Z]+)", doc, re.MULTILINE)
    table = {(PeerState[a], PeerEvent(e)): PeerState[b] for a, e, b in arrows}
    assert table == TRANSITIONS


def test_states_that_retire_a_registration_and_void_its_rooms():
    assert {s for s in PeerState if s.retired} == {PeerState.LEAVING, PeerState.LOST, PeerState.GONE}
    assert {s for s in PeerState if s.void} == {PeerState.LOST, PeerState.GONE}
    assert [m.event for m in [Moved(e, PeerState.READY, PeerState.LOST) for e in PeerEvent] if m.rehandshake] == [
        PeerEvent.FORGOTTEN, PeerEvent.REPLACED]


def test_a_handshake_records_the_prefill_and_schedules_heartbeats():
    peer = new_peer()
    assert not peer.heartbeat_due(100.0)  # no heartbeat before the handshake
    peer.on_connected("A", head_major=True, skips_pages=True, now=3.0)
    assert (peer.instance, peer.head_major, peer.skips_pages) == ("A", True, True)
    assert str(peer) == "prefill 10.0.0.1:8998 (instance A)"
    assert not peer.heartbeat_due(3.0 + INTERVAL - 0.01)
    assert peer.heartbeat_due(3.0 + INTERVAL)
    peer.heartbeat_sent(8.0)
    assert not peer.heartbeat_due(8.0 + INTERVAL - 0.01) and peer.heartbeat_due(8.0 + INTERVAL)


def test_a_failed_handshake_keeps_its_reason_and_is_retried_after_retry_s():
    book = PeerBook()
    peer = new_peer()
    book.add(peer)
    peer.on_handshake_failed("handshake with prefill 10.0.0.1:8998 failed: layouts differ", "failed_precondition", now=10.0)
    assert (peer.error, peer.code) == ("handshake with prefill 10.0.0.1:8998 failed: layouts differ", "failed_precondition")
    assert book.for_new_room(ADDRESS, 10.0 + RETRY_S) is peer  # rooms fail fast meanwhile
    assert book.for_new_room(ADDRESS, 10.0 + RETRY_S + 0.01) is None  # the next room handshakes again


def test_missed_heartbeats_in_a_row_take_a_peer_offline():
    peer = ready_peer()
    assert peer.on_heartbeat_missed(True, False, "timed out", now=5.0) == []
    assert peer.on_heartbeat("A", leaving=False, known=True) == []  # an answer resets the count
    assert peer.missed == 0
    moved = []
    for i in range(HEARTBEAT_MISSES):
        assert peer.state is PeerState.READY
        moved += peer.on_heartbeat_missed(True, False, "timed out", now=10.0 + i * INTERVAL)
    assert moved == [Moved(PeerEvent.OFFLINE, PeerState.READY, PeerState.LOST)]
    assert peer.error == f"prefill 10.0.0.1:8998 (instance A) is offline: {HEARTBEAT_MISSES} heartbeats in a row unanswered (timed out)"
    assert peer.code == "unavailable"
    assert not peer.heartbeat_due(1e9)


def test_an_offline_peer_whose_port_is_closed_is_gone_at_once():
    """Its pages are released at once: a prefill closes its bootstrap service after its last write."""
    peer = ready_peer()
    moved = [m for i in range(HEARTBEAT_MISSES) for m in peer.on_heartbeat_missed(True, True, "connection refused", float(i))]
    assert [(m.event, m.after) for m in moved] == [(PeerEvent.OFFLINE, PeerState.LOST),
                                                  (PeerEvent.NOTHING_LISTENS, PeerState.GONE)]
    assert "offline" in peer.error  # the first reason stays


def test_silence_counts_toward_the_peer_timeout_only_while_rooms_wait():
    peer = ready_peer()
    peer.on_no_answer(unreachable=True, refused=False, now=1.0)
    assert peer.on_tick(waited_on=True, now=1.0 + TIMEOUT) == []  # not yet past the timeout
    assert peer.on_tick(waited_on=False, now=1.0 + TIMEOUT + 5) == []  # no rooms: the silence is forgotten
    assert peer.unreachable_since is None
    peer.on_no_answer(unreachable=True, refused=False, now=20.0)
    peer.on_no_answer(unreachable=True, refused=False, now=25.0)  # the first silent call counts
    assert peer.on_tick(waited_on=True, now=20.0 + TIMEOUT + 0.01) == [
        Moved(PeerEvent.OFFLINE, PeerState.READY, PeerState.LOST)]
    assert peer.error.endswith(f"unreachable for {TIMEOUT:g}s (--peer-timeout)")


def test_an_answer_ends_the_silence_and_an_error_answer_is_not_silence():
    peer = ready_peer()
    peer.on_no_answer(unreachable=True, refused=False, now=1.0)
    peer.on_status("A", leaving=False, rooms={7: {"state": "registered"}})
    assert peer.unreachable_since is None and peer.statuses == {7: {"state": "registered"}}
    assert peer.on_no_answer(unreachable=False, refused=False, now=2.0) == []  # it answered, with an error
    assert peer.unreachable_since is None
    assert peer.on_tick(waited_on=True, now=100.0) == []


def test_sigterm_leave_then_exit_with_rooms_in_flight():
    """A rolled prefill: it says it is leaving (no new rooms, its rooms finish), then exits. While
    a quarantined room still waits on it, its closed port makes it GONE after --peer-timeout."""
    book = PeerBook()
    peer = ready_peer()
    book.add(peer)
    assert peer.on_status("A", leaving=True, rooms={1: {"state": "transferring"}}) == [
        Moved(PeerEvent.LEAVING, PeerState.READY, PeerState.LEAVING)]
    assert peer.state.retired and not peer.state.void  # rooms in flight still deliver
    assert not peer.heartbeat_due(1e9)  # a leaving prefill gets no heartbeats
    assert peer.statuses == {1: {"state": "transferring"}}
    book.retire(peer)
    assert book.for_new_room(ADDRESS, 1.0) is None  # new rooms handshake with its successor
    assert peer.on_no_answer(unreachable=True, refused=True, now=2.0) == []  # LEAVING: wait for the timeout
    assert [(m.event, m.after) for m in peer.on_tick(waited_on=True, now=2.0 + TIMEOUT + 0.01)] == [
        (PeerEvent.OFFLINE, PeerState.LOST), (PeerEvent.NOTHING_LISTENS, PeerState.GONE)]


def test_a_restart_at_the_same_address_makes_the_old_process_gone():
    """The prefill was killed and came back at its address: the next handshake meets another
    instance, and every older registration there is GONE (its quarantined pages are free)."""
    book = PeerBook()
    old = ready_peer("A")
    book.add(old)
    assert book.connected(old, [old]) == (None, [])
    # The old process stopped answering; the registration went offline and was retired.
    for i in range(HEARTBEAT_MISSES):
        old.on_heartbeat_missed(True, False, "timed out", float(i))
    assert old.state is PeerState.LOST
    book.retire(old)
    assert book.for_new_room(ADDRESS, 20.0) is None
    new = ready_peer("B", now=20.0)
    book.add(new)
    other_address = ready_peer("Z", address=("10.0.0.2", 8998))
    before, replaced = book.connected(new, [old, new, other_address])
    assert before == "A"
    assert replaced == [(old, [Moved(PeerEvent.REPLACED, PeerState.LOST, PeerState.GONE)])]
    assert old.state is PeerState.GONE and other_address.state is PeerState.READY
    assert book.for_new_room(ADDRESS, 20.0) is new
    assert book.connected(new, [old, new]) == (None, [])  # the same instance again: nothing replaced


def test_an_answer_from_another_instance_replaces_the_registration():
    peer = ready_peer("A")
    assert peer.on_status("B", leaving=False, rooms={3: {"state": "done"}}) == [
        Moved(PeerEvent.REPLACED, PeerState.READY, PeerState.GONE)]
    assert peer.statuses == {}  # another process's rooms are not ours
    assert peer.error == "prefill 10.0.0.1:8998 (instance A) was replaced by instance B"


def test_a_prefill_that_forgot_this_decode():
    peer = ready_peer("A")
    assert peer.on_heartbeat("A", leaving=False, known=False) == [
        Moved(PeerEvent.FORGOTTEN, PeerState.READY, PeerState.LOST)]
    assert peer.error == "prefill 10.0.0.1:8998 (instance A) no longer knows this decode"
    # the same process may still write: only a closed port or another instance proves otherwise
    assert peer.on_no_answer(unreachable=True, refused=False, now=1.0) == []
    assert peer.state is PeerState.LOST
    assert peer.on_no_answer(unreachable=True, refused=True, now=2.0) == [
        Moved(PeerEvent.NOTHING_LISTENS, PeerState.LOST, PeerState.GONE)]
    assert "no longer knows" in peer.error


@pytest.mark.parametrize("reason, instance, event, after", [
    ("leaving", "A", PeerEvent.LEAVING, PeerState.LEAVING),
    ("unknown_peer", "A", PeerEvent.FORGOTTEN, PeerState.LOST),
    ("unknown_peer", "B", PeerEvent.REPLACED, PeerState.GONE),
])
def test_a_refused_registration(reason, instance, event, after):
    peer = ready_peer("A")
    assert peer.on_refused_registration(reason, instance, "refused bootstrap_room 9") == [
        Moved(event, PeerState.READY, after)]
    if after.void:
        assert peer.error == "refused bootstrap_room 9"
