"""A decode's calls to its prefill peers: the handshake with each prefill process, room-status
polls while requests wait on it, heartbeats every --peer-heartbeat-interval, room cancels, and the
goodbye on shutdown. The answers go to decode_peers.py's state machine; its transitions are acted
on here (counted, logged, the registration retired, a new handshake started). The connector
(decode.py) asks which registration a new room goes through and says which rooms wait on which peer.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable

from tandem.server.config import DisaggConfig
from tandem.server.disagg.bootstrap import BootstrapClient, BootstrapError
from tandem.server.disagg.layout import LayoutMismatch
from tandem.server.disagg.decode_peers import Moved, PeerBook, PeerEvent, PeerState, PrefillPeer

log = logging.getLogger("tandem.decode")

STATUS_INTERVAL_S = 0.1  # room-state polls per prefill peer while requests wait on it
LEAVE_TIMEOUT_S = 2.0  # on shutdown, how long telling the prefills may take


@dataclass(eq=False, kw_only=True)
class PrefillLink(PrefillPeer):
    """A registration (decode_peers.py) and the calls to its prefill's bootstrap service."""

    client: BootstrapClient
    handshake: Future  # -> the prefill's answer to our registration
    status_call: Future | None = None
    last_poll: float = 0.0
    heartbeat: Future | None = None


class PrefillLinks:
    """`me`: who this decode is to the prefills; `handshake(client)`, on a client thread: check the
    prefill's layout and register our KV pool with it (its answer, with the prefill's `kv_heads`
    and `features`); `kv_heads`: ours, per tensor-parallel rank; `wake`: make the loop poll now."""

    def __init__(self, config: DisaggConfig, me: dict, handshake: Callable[[BootstrapClient], dict],
                 kv_heads: list[list[int]], wake: Callable[[], None]):
        self.config, self.me, self._handshake, self.kv_heads, self.wake = config, me, handshake, kv_heads, wake
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tandem-bootstrap-client")
        self.book = PeerBook()  # the current registration per address
        self.counters = {"peer_handshakes": 0, "peer_rehandshakes": 0, "peers_offline": 0}
        tokens = config.bootstrap_tokens()
        self.token = tokens[0] if tokens else None  # presented on every call to a prefill

    def for_room(self, address: tuple[str, int]) -> PrefillLink:
        """The registration a new room at a bootstrap address goes through, handshaking if there is none."""
        peer = self.book.for_new_room(address, time.monotonic())
        if peer is None:
            client = BootstrapClient(*address, token=self.token)
            peer = PrefillLink(address, self.config.peer_heartbeat_interval, self.config.peer_timeout, client=client,
                               handshake=self.pool.submit(self._handshake, client))
            self.book.add(peer)
            peer.handshake.add_done_callback(lambda _: self.wake())
        return peer

    def update(self, now: float, retired: list[PrefillLink], rooms_of: Callable[[PrefillLink], list[int]]) -> None:
        """Every current registration, and the `retired` ones requests or quarantined pages still
        wait on: take the answers of their calls that ended, start the calls that are due
        (`rooms_of(peer)`: the rooms whose state to poll), let the clock tick."""
        peers = {id(p): p for p in [*self.book.current.values(), *retired]}
        known = list(peers.values())
        for peer in known:
            if peer.state is PeerState.CONNECTING and peer.handshake.done():
                self.apply(peer, self._take_handshake(peer, now), known)
            if peer.status_call is not None and peer.status_call.done():
                self.apply(peer, self._take_status(peer, now), known)
            if peer.heartbeat is not None and peer.heartbeat.done():
                self.apply(peer, self._take_heartbeat(peer, now), known)
            rooms = rooms_of(peer)
            if rooms and peer.status_call is None and now - peer.last_poll >= STATUS_INTERVAL_S:
                peer.last_poll = now
                peer.status_call = self.pool.submit(peer.client.status, self.me, rooms)
            if peer.heartbeat is None and peer.heartbeat_due(now):
                peer.heartbeat_sent(now)
                peer.heartbeat = self.pool.submit(peer.client.heartbeat, self.me)
                peer.heartbeat.add_done_callback(lambda _: self.wake())
            self.apply(peer, peer.on_tick(bool(rooms), now), known)

    def _take_handshake(self, peer: PrefillLink, now: float) -> list[Moved]:
        error = peer.handshake.exception()
        if error is None:
            answer = peer.handshake.result()
            head_major = [list(h) for h in answer["kv_heads"]] != self.kv_heads
            return peer.on_connected(answer["instance"], head_major, "skip_pages" in answer["features"], now)
        mismatch = isinstance(error, LayoutMismatch) or getattr(error, "conflict", False)
        return peer.on_handshake_failed(f"handshake with prefill {peer.client.address} failed: {error}",
                                        "failed_precondition" if mismatch else "unavailable", now)

    def _take_status(self, peer: PrefillLink, now: float) -> list[Moved]:
        call, peer.status_call = peer.status_call, None
        try:
            answer = call.result()
        except BootstrapError as e:
            return peer.on_no_answer(e.unreachable, e.refused, now)
        return peer.on_status(answer["instance"], bool(answer.get("leaving")), answer["rooms"])

    def _take_heartbeat(self, peer: PrefillLink, now: float) -> list[Moved]:
        call, peer.heartbeat = peer.heartbeat, None
        try:
            answer = call.result()
        except BootstrapError as e:
            return peer.on_heartbeat_missed(e.unreachable, e.refused, str(e), now)
        return peer.on_heartbeat(answer["instance"], bool(answer.get("leaving")), answer["known"])

    def apply(self, peer: PrefillLink, moved: list[Moved], known: list[PrefillLink] = ()) -> None:
        """Act on a peer's transitions: count, log, retire the registration, handshake again.
        `known`: the registrations a new handshake may have replaced."""
        for m in moved:
            if m.after is PeerState.READY:
                self._connected(peer, known)
            elif m.after is PeerState.FAILED:
                log.warning("%s", peer.error)
            elif m.after is PeerState.LEAVING:
                self.book.retire(peer)
                log.info("%s is leaving: new rooms wait for its successor, its rooms in flight finish", peer)
            elif not m.before.void:  # LOST or GONE: the registration is void from now on
                self.counters["peers_offline"] += m.event is PeerEvent.OFFLINE
                self.book.retire(peer)
                log.warning("%s", peer.error)
                if m.rehandshake:
                    self.for_room(peer.address)

    def _connected(self, peer: PrefillLink, known: list[PrefillLink]) -> None:
        self.counters["peer_handshakes"] += 1
        before, replaced = self.book.connected(peer, known)
        if before is None:
            log.info("handshake with %s: registered as %s (instance %s)", peer, self.me["decode"], self.me["decode_instance"])
            return
        self.counters["peer_rehandshakes"] += 1
        log.info("re-handshake with %s: it replaced instance %s", peer, before)
        for old, moved in replaced:  # the predecessor is gone: a new process holds its address
            self.apply(old, moved)

    def cancel(self, peer: PrefillLink, room: int, message: str) -> None:
        """Ask `peer` to end `room` (if it can hear): the room-status polls decide what happens to
        the pages registered there."""
        self.pool.submit(self._cancel, peer.client, room, message)

    @staticmethod
    def _cancel(client: BootstrapClient, room: int, message: str) -> None:
        try:
            client.cancel(room, message)
        except BootstrapError as e:
            log.info("cancelling bootstrap_room %d: %s", room, e)

    def next_heartbeat(self) -> float | None:
        """Seconds until a ready peer's next heartbeat is due (None: no heartbeats to send)."""
        beats = [p.next_heartbeat for p in self.book.current.values() if p.state is PeerState.READY and p.heartbeat is None]
        return max(0.0, min(beats) - time.monotonic()) if beats else None

    def close(self) -> None:
        """Tell every prefill we hold a registration with that we are leaving: it forgets this
        decode and fails the rooms we registered that it has not started writing."""
        peers = [p for p in self.book.current.values() if p.state is PeerState.READY]
        self.pool.shutdown(wait=False, cancel_futures=True)
        if not peers:
            return
        with ThreadPoolExecutor(max_workers=len(peers), thread_name_prefix="tandem-bootstrap-leave") as goodbye:
            calls = {goodbye.submit(p.client.leave, self.me, LEAVE_TIMEOUT_S): p for p in peers}
            wait(calls, timeout=LEAVE_TIMEOUT_S + 1)
        for call, peer in calls.items():
            error = call.exception() if call.done() else TimeoutError("no answer")
            if error is None:
                log.info("left %s: %d of our rooms there ended", peer, call.result()["failed_rooms"])
            else:
                log.info("could not tell %s we are leaving: %s", peer, error)
