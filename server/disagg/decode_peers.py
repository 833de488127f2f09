"""A decode server's prefill peers: the state machine of its registration with each prefill
process, the counterpart of prefill_rooms.py on the prefill side. Pure: no I/O, no threads.
decode_links.py makes the calls and feeds in what they answered (instance ids, `leaving`,
`known`), how they failed (unreachable, connection refused) and the time.

A `PrefillPeer` is this decode's registration with one prefill *process* (its instance id, read at the
handshake and in every answer) at one bootstrap address:

    state       what it means                                   rooms
    CONNECTING  the handshake is in flight                      new rooms wait for it
    FAILED      the handshake failed                            new rooms fail, until RETRY_S passed
    READY       registered with `instance`; heartbeats          new rooms register here
    LEAVING     the prefill shuts down (SIGTERM)                no new rooms; rooms in flight finish
    LOST        the registration is void; the process may       rooms in flight end; their pages
                still write (it forgot us, or went silent)      stay quarantined
    GONE        the process can write nothing more (another     rooms in flight end; their pages
                instance holds its address, nothing listens)    are free at once

Transitions (`TRANSITIONS`; an event a state has no entry for changes nothing):

    CONNECTING  --connected-->        READY     the handshake registered us
    CONNECTING  --handshake_failed--> FAILED    layout mismatch, refused, unreachable
    READY       --leaving-->          LEAVING   an answer, or a refused registration, says it is leaving
    READY       --forgotten-->        LOST      a heartbeat says it does not know us; a registration
    LEAVING     --forgotten-->        LOST        is refused as from an unknown peer, by the same instance
    READY       --offline-->          LOST      HEARTBEAT_MISSES heartbeats missed in a row, or
    LEAVING     --offline-->          LOST        unreachable for --peer-timeout while rooms wait on it
    READY       --replaced-->         GONE      an answer from another instance at its address, or a
    LEAVING     --replaced-->         GONE        new handshake there met another instance (a restart
    LOST        --replaced-->         GONE        at the same address)
    LOST        --nothing_listens-->  GONE      a call found the port closed: a prefill closes its
                                                bootstrap service only after its last write

A peer that goes offline while its last call was refused goes on to GONE at once. FAILED, LOST
and GONE are final for a registration: the next room at the address handshakes again (`PeerBook`),
at once after `forgotten` or `replaced` (the connector asks the book for a new peer), otherwise
with the next request.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

RETRY_S = 1.0  # a failed handshake is retried for rooms arriving this much later
HEARTBEAT_MISSES = 2  # heartbeats missed in a row that take a prefill offline


class PeerState(enum.Enum):
    CONNECTING = "connecting"
    FAILED = "failed"
    READY = "ready"
    LEAVING = "leaving"
    LOST = "lost"
    GONE = "gone"

    @property
    def retired(self) -> bool:
        """New rooms go to the address's next registration: this one takes none any more."""
        return self in (PeerState.LEAVING, PeerState.LOST, PeerState.GONE)

    @property
    def void(self) -> bool:
        """The registration is over: rooms in flight through it will get no KV."""
        return self in (PeerState.LOST, PeerState.GONE)


class PeerEvent(enum.Enum):
    CONNECTED = "connected"
    HANDSHAKE_FAILED = "handshake_failed"
    LEAVING = "leaving"
    FORGOTTEN = "forgotten"
    OFFLINE = "offline"
    REPLACED = "replaced"
    NOTHING_LISTENS = "nothing_listens"


S, E = PeerState, PeerEvent
TRANSITIONS: dict[tuple[PeerState, PeerEvent], PeerState] = {
    (S.CONNECTING, E.CONNECTED): S.READY,
    (S.CONNECTING, E.HANDSHAKE_FAILED): S.FAILED,
    (S.READY, E.LEAVING): S.LEAVING,
    (S.READY, E.FORGOTTEN): S.LOST,
    (S.LEAVING, E.FORGOTTEN): S.LOST,
    (S.READY, E.OFFLINE): S.LOST,
    (S.LEAVING, E.OFFLINE): S.LOST,
    (S.READY, E.REPLACED): S.GONE,
    (S.LEAVING, E.REPLACED): S.GONE,
    (S.LOST, E.REPLACED): S.GONE,
    (S.LOST, E.NOTHING_LISTENS): S.GONE,
}
del S, E


@dataclass(frozen=True)
class Moved:
    """One transition taken, for the connector to act on (log, count, retire, handshake again)."""

    event: PeerEvent
    before: PeerState
    after: PeerState

    @property
    def rehandshake(self) -> bool:
        """The address has a live prefill that lost us: handshake again now, not with the next room."""
        return self.event in (PeerEvent.FORGOTTEN, PeerEvent.REPLACED)


@dataclass(eq=False)
class PrefillPeer:
    """This decode's registration with one prefill process at `address` (host, port). Each
    `on_*` method takes what a call answered and the time, and returns the transitions taken."""

    address: tuple[str, int]
    heartbeat_interval: float  # --peer-heartbeat-interval
    peer_timeout: float  # --peer-timeout
    state: PeerState = PeerState.CONNECTING
    instance: str = ""  # the prefill process we registered with
    head_major: bool = False  # it splits the KV heads unlike us: its pages arrive head-major
    skips_pages: bool = False  # it can leave out the prompt pages our prefix cache holds
    error: str = ""  # why it failed, or why the registration is void
    code: str = ""  # the gRPC status code requests that fail through it get
    failed_at: float = 0.0
    next_heartbeat: float = 0.0
    missed: int = 0  # heartbeats missed in a row
    unreachable_since: float | None = None  # the first of the calls in a row that reached nothing
    refused: bool = False  # the last call that reached nothing found the port closed
    statuses: dict[int, dict] = field(default_factory=dict)  # room -> latest {"state", "message", "code"}

    def __str__(self) -> str:
        host, port = self.address
        return f"prefill {host}:{port}" + (f" (instance {self.instance})" if self.instance else "")

    # -- the handshake -------------------------------------------------------------------------------
    def on_connected(self, instance: str, head_major: bool, skips_pages: bool, now: float) -> list[Moved]:
        moved = self._move(PeerEvent.CONNECTED)
        if moved:
            self.instance, self.head_major, self.skips_pages = instance, head_major, skips_pages
            self.next_heartbeat = now + self.heartbeat_interval
        return moved

    def on_handshake_failed(self, message: str, code: str, now: float) -> list[Moved]:
        moved = self._move(PeerEvent.HANDSHAKE_FAILED, message, code)
        if moved:
            self.failed_at = now
        return moved

    def retry_due(self, now: float) -> bool:
        """A failed handshake may be tried again for a new room."""
        return self.state is PeerState.FAILED and now - self.failed_at > RETRY_S

    # -- answers -------------------------------------------------------------------------------------
    def on_answer(self, instance: str, leaving: bool) -> list[Moved]:
        """Any answer from the address (status, heartbeat, registration). Another instance means
        ours is gone; `leaving`, that ours takes no new rooms."""
        if instance != self.instance:
            return self._move(PeerEvent.REPLACED, f"{self} was replaced by instance {instance}")
        return self._move(PeerEvent.LEAVING) if leaving else []

    def on_status(self, instance: str, leaving: bool, rooms: dict[int, dict]) -> list[Moved]:
        self.unreachable_since = None
        moved = self.on_answer(instance, leaving)
        if instance == self.instance:
            self.statuses.update(rooms)
        return moved

    def on_heartbeat(self, instance: str, leaving: bool, known: bool) -> list[Moved]:
        self.missed = 0
        moved = self.on_answer(instance, leaving)
        if instance == self.instance and not known:
            moved += self._move(PeerEvent.FORGOTTEN, f"{self} no longer knows this decode")
        return moved

    def on_refused_registration(self, reason: str, instance: str, message: str) -> list[Moved]:
        """The bootstrap service refused to register a room (`reason`: "leaving" or "unknown_peer")."""
        if reason == "leaving":
            return self._move(PeerEvent.LEAVING)
        event = PeerEvent.FORGOTTEN if instance == self.instance else PeerEvent.REPLACED
        return self._move(event, message)

    # -- silence -------------------------------------------------------------------------------------
    def on_no_answer(self, unreachable: bool, refused: bool, now: float) -> list[Moved]:
        """A status poll got no answer (`unreachable`: none came; `refused`: the port is closed)."""
        if not unreachable:
            return []
        self.refused = refused
        if self.unreachable_since is None:
            self.unreachable_since = now
        return self._move(PeerEvent.NOTHING_LISTENS) if refused else []

    def on_heartbeat_missed(self, unreachable: bool, refused: bool, why: str, now: float) -> list[Moved]:
        self.missed += 1
        moved = self.on_no_answer(unreachable, refused, now)
        if self.missed >= HEARTBEAT_MISSES:
            moved += self._offline(f"{self.missed} heartbeats in a row unanswered ({why})")
        return moved

    def on_tick(self, waited_on: bool, now: float) -> list[Moved]:
        """The clock: silence counts only while rooms (requests, quarantined pages) wait on the
        peer; after --peer-timeout of it, the peer is offline."""
        if not waited_on:
            self.unreachable_since = None
        if self.unreachable_since is not None and now - self.unreachable_since > self.peer_timeout:
            return self._offline(f"unreachable for {self.peer_timeout:g}s (--peer-timeout)")
        return []

    def heartbeat_due(self, now: float) -> bool:
        return self.state is PeerState.READY and now >= self.next_heartbeat

    def heartbeat_sent(self, now: float) -> None:
        self.next_heartbeat = now + self.heartbeat_interval

    # -- transitions ---------------------------------------------------------------------------------
    def _offline(self, why: str) -> list[Moved]:
        moved = self._move(PeerEvent.OFFLINE, f"{self} is offline: {why}")
        if moved and self.refused:
            moved += self._move(PeerEvent.NOTHING_LISTENS)
        return moved

    def _move(self, event: PeerEvent, error: str = "", code: str = "unavailable") -> list[Moved]:
        after = TRANSITIONS.get((self.state, event))
        if after is None:
            return []
        moved = Moved(event, self.state, after)
        self.state = after
        if error and (after is PeerState.FAILED or not self.error):  # the first reason stays
            self.error, self.code = error, code
        return [moved]


class PeerBook:
    """The current registration per bootstrap address, and the last prefill instance registered
    with there (a new one means the old process is gone)."""

    def __init__(self):
        self.current: dict[tuple[str, int], PrefillPeer] = {}
        self.instances: dict[tuple[str, int], str] = {}

    def for_new_room(self, address: tuple[str, int], now: float) -> PrefillPeer | None:
        """The registration a new room at `address` goes through; None: handshake a new one (and `add` it)."""
        peer = self.current.get(address)
        if peer is None or peer.retry_due(now):
            return None
        return peer

    def add(self, peer: PrefillPeer) -> None:
        self.current[peer.address] = peer

    def retire(self, peer: PrefillPeer) -> None:
        """New rooms at its address no longer go through `peer`."""
        if self.current.get(peer.address) is peer:
            del self.current[peer.address]

    def connected(self, peer: PrefillPeer, others: list[PrefillPeer]) -> tuple[str | None, list[tuple[PrefillPeer, list[Moved]]]]:
        """`peer` registered with its instance: the instance the address had before (None: the
        first, or the same), and each of `others` (earlier registrations there) it replaced."""
        before = self.instances.get(peer.address)
        self.instances[peer.address] = peer.instance
        if before is None or before == peer.instance:
            return None, []
        replaced = [(old, old.on_answer(peer.instance, leaving=False)) for old in others
                    if old is not peer and old.address == peer.address and old.instance not in ("", peer.instance)]
        return before, replaced
