"""The rooms and decode peers of a prefill server: the bootstrap service's state machine, with
no I/O (bootstrap.py serves it over HTTP; the prefill connector drives the prefill side).

A decode peer is known by its stable name (its advertised gRPC address) and its instance (new on
every start), so a decode restarted at the same address replaces its predecessor, whose rooms
fail. A refusal carries its `reason`: `unknown_peer` (handshake again), `leaving` (this prefill
is shutting down), `layout` (the two sides can never exchange KV).

Leaving (SIGTERM): the table refuses new peers and rooms no prefill leg has claimed yet, keeps
answering for the rooms it still serves, and says `leaving: true` in its status and heartbeat
answers; each registered decode that has had one has been told.

Room states (RoomState), as the decode side sees them:
    registered    the decode's pages are known, the prefill leg has not arrived
    claimed       the prefill leg arrived, the decode has not registered
    queued        both legs are here; the prefill leg is waiting for (or in) its forward pass
    transferring  KV is being written; the decode's pages must not be reused
    done          KV and the arrival record are written
    failed        final; `message` says why and `code` is the gRPC status both legs end with
    unknown       no such room (never registered, or long finished)
"""

from __future__ import annotations

import enum
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from tandem.server.disagg.layout import KVBuffer, KVLayout, check_split

log = logging.getLogger("tandem.bootstrap")


class RoomState(str, enum.Enum):
    """A room's state; its value is what the bootstrap service's answers carry."""

    REGISTERED = "registered"
    CLAIMED = "claimed"
    QUEUED = "queued"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"
    UNKNOWN = "unknown"

    @property
    def finished(self) -> bool:
        """No write to the decode's pages can be in flight or still come."""
        return self in (RoomState.DONE, RoomState.FAILED, RoomState.UNKNOWN)


# Finished rooms stay queryable this long, so a decode polling late still learns the outcome.
FINISHED_ROOM_RETENTION_S = 120.0


def new_instance_id() -> str:
    """A process's identity for its peers: new on every start."""
    return uuid.uuid4().hex[:12]


class PeerRefused(Exception):
    """A call this service refuses for a reason the caller acts on (`reason`, see the module doc)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class DecodePeer:
    name: str  # stable across restarts: the decode's advertised gRPC address
    instance: str  # new on each start of the decode process
    session: str  # Mooncake session host:rpc_port of its rank 0, which holds the arrival records
    parts: tuple[KVBuffer, ...]  # its KV pool, one buffer per tensor-parallel rank
    record_base: int  # address of arrival-record slot 0

    @classmethod
    def from_json(cls, body: dict, layout: KVLayout) -> DecodePeer:
        """A decode's handshake, checked against this prefill's `layout` (LayoutMismatch: the two
        can never exchange KV)."""
        theirs = KVLayout.from_json(body["layout"])
        layout.check_compatible(theirs, here="on prefill", there="on decode")
        parts = tuple(KVBuffer.from_json(part) for part in body["kv_parts"])
        check_split(theirs, list(parts), f"of decode {body['decode']}")
        return cls(body["decode"], body["decode_instance"], body["session"], parts, body["record_base"])

    @property
    def num_pages(self) -> int:
        return self.parts[0].num_pages

    def __str__(self) -> str:
        return f"{self.name} (instance {self.instance})"


@dataclass(frozen=True)
class Registration:
    """What a decode registered for one room."""

    peer: DecodePeer
    request_id: str
    prompt_len: int
    digest: int
    pages: list[int]  # destinations of the prompt's pages from `skip_pages` on
    record_slot: int
    skip_pages: int = 0  # leading prompt pages the decode holds already (its prefix cache): not sent

    @classmethod
    def from_json(cls, body: dict, peer: DecodePeer, page_size: int) -> Registration:
        """`peer`'s destination for one room; ValueError for pages that do not fit its prompt or pool."""
        pages, prompt_len, skip = list(body["pages"]), int(body["prompt_len"]), int(body.get("skip_pages", 0))
        need = -(-prompt_len // page_size)
        if not 0 <= skip < need:
            raise ValueError(f"skip_pages {skip} for {prompt_len} prompt tokens: must be in [0, {need}) "
                             "(the last prompt page always moves)")
        if len(pages) != need - skip or not all(0 <= p < peer.num_pages for p in pages):
            raise ValueError(f"{len(pages)} destination pages for {prompt_len} prompt tokens with skip_pages {skip}; "
                             f"need {need - skip} in [0, {peer.num_pages})")
        return cls(peer, body["request_id"], prompt_len, int(body["digest"]), pages, int(body["record_slot"]), skip)


@dataclass
class Room:
    room: int
    created: float = field(default_factory=time.monotonic)
    registration: Registration | None = None
    claimed_by: str | None = None  # the prefill leg's engine request id
    digest: int | None = None  # the prefill leg's prompt fingerprint
    prompt_len: int = 0
    state: RoomState = RoomState.REGISTERED
    message: str = ""
    code: str = ""  # on failure: the gRPC status name (deadline_exceeded, unavailable, ...)
    cancelled: bool = False  # the decode side asked to stop
    finished_at: float | None = None

    def fail(self, message: str, code: str) -> None:
        """Final: both legs end with `message` and the gRPC status `code`."""
        self.state, self.message, self.code, self.finished_at = RoomState.FAILED, message, code or "aborted", time.monotonic()

    def check_same_request(self) -> None:
        """Both legs are here: fail the room if they carry different prompts."""
        reg = self.registration
        if reg.prompt_len != self.prompt_len or reg.digest != self.digest:
            self.fail(
                f"wrong bootstrap_room {self.room}: the decode registered request {reg.request_id!r} "
                f"({reg.prompt_len} prompt tokens), the prefill holds a different prompt ({self.prompt_len} tokens)",
                "failed_precondition",
            )


class PrefillRoomTable:
    """Rooms and decode peers, shared by the HTTP threads and the prefill loop (one lock)."""

    def __init__(self, layout: KVLayout, session: str, wake: Callable[[], None] = lambda: None,
                 kv_heads: list[tuple[int, int]] | None = None):
        self.layout = layout
        self.session = session
        # How this prefill splits the KV heads over its ranks: (first head, heads) per rank.
        self.kv_heads = kv_heads or [(0, layout.num_kv_heads)]
        self.wake = wake
        self.instance = new_instance_id()
        self._lock = threading.Lock()
        self._rooms: dict[int, Room] = {}
        self._peers: dict[str, DecodePeer] = {}  # by name: one instance per decode address
        self.counters = {"peer_handshakes": 0, "peer_rehandshakes": 0}
        self._refused: dict[str, int] = {}  # bootstrap calls refused before reaching the table, by reason
        self._leaving_since: float | None = None
        self._unnotified: set[str] = set()  # decode names not yet told that this prefill is leaving

    # -- decode side (HTTP threads) ---------------------------------------------------------------
    def count_refusal(self, reason: str) -> int:
        """A bootstrap call refused before it reached the table (no token, a wrong one); the calls
        refused for that reason so far."""
        with self._lock:
            self._refused[reason] = self._refused.get(reason, 0) + 1
            return self._refused[reason]

    def refusals(self) -> tuple[tuple[str, int], ...]:
        """(reason, calls) for every refusal so far, by reason."""
        with self._lock:
            return tuple(sorted(self._refused.items()))

    def add_peer(self, body: dict) -> DecodePeer:
        """A decode's handshake. A new instance at a known name replaces its predecessor, whose
        unfinished rooms fail: the process that registered them is gone."""
        peer = DecodePeer.from_json(body, self.layout)
        with self._lock:
            if self._leaving_since is not None:
                raise PeerRefused("leaving", f"prefill instance {self.instance} is shutting down; no new decode peers")
            old = self._peers.get(peer.name)
            self._peers[peer.name] = peer
            if old is not None and old.instance != peer.instance:
                failed = self._drop_rooms_of(old, f"decode peer {old.name} restarted (instance {old.instance} "
                                                  f"replaced by {peer.instance})")
                self.counters["peer_rehandshakes"] += 1
                log.info("decode peer %s replaces instance %s (%d of its rooms failed); Mooncake session %s, %d pages",
                         peer, old.instance, failed, peer.session, peer.num_pages)
            else:
                self.counters["peer_handshakes"] += 1
                log.info("decode peer %s registered (Mooncake session %s, %d pages, %d tensor-parallel ranks)", peer,
                         peer.session, peer.num_pages, len(peer.parts))
        self.wake()
        return peer

    def remove_peer(self, name: str, instance: str) -> int:
        """A decode leaving (SIGTERM): forget it and fail its unfinished rooms. Returns their count."""
        with self._lock:
            peer = self._peers.get(name)
            if peer is None or peer.instance != instance:
                return 0
            del self._peers[name]
            self._unnotified.discard(name)
            failed = self._drop_rooms_of(peer, f"decode peer {peer.name} is shutting down")
        log.info("decode peer %s left (%d of its rooms failed)", peer, failed)
        self.wake()
        return failed

    def peers(self) -> list[dict]:
        """The decode peers registered now (name, instance, Mooncake session)."""
        with self._lock:
            return [{"decode": p.name, "instance": p.instance, "session": p.session} for p in self._peers.values()]

    def heartbeat(self, name: str, instance: str) -> dict:
        """A decode checking on this prefill: is its registration still here, is this prefill leaving."""
        with self._lock:
            peer = self._peers.get(name)
            known = peer is not None and peer.instance == instance
            return {"known": known, "leaving": self._heard(name)}

    def _heard(self, name: str) -> bool:
        """`name` is being answered now: if this prefill is leaving, that answer tells it so."""
        self._unnotified.discard(name)
        return self._leaving_since is not None

    def _peer(self, name: str, instance: str) -> DecodePeer:
        peer = self._peers.get(name)
        if peer is None or peer.instance != instance:
            raise PeerRefused("unknown_peer", f"decode peer {name!r} (instance {instance}) is not registered with prefill "
                                              f"instance {self.instance} (POST /v1/peers first)")
        return peer

    def register(self, body: dict) -> Room:
        """A decode's destination for one room. Raises PeerRefused (unknown peer, leaving) or ValueError."""
        with self._lock:
            peer = self._peer(body["decode"], body["decode_instance"])
            claimed = body["room"] in self._rooms and self._rooms[body["room"]].claimed_by is not None
            if self._leaving_since is not None and not claimed:
                raise PeerRefused("leaving", f"prefill instance {self.instance} is shutting down: bootstrap_room "
                                             f"{body['room']} has no prefill request here and will get none")
            reg = Registration.from_json(body, peer, self.layout.page_size)
            room = self._rooms.get(body["room"])
            if room is None:
                room = self._rooms[body["room"]] = Room(body["room"])
            elif room.registration is not None:
                raise ValueError(f"bootstrap_room {room.room} is already registered ({room.state})")
            room.registration = reg
            if room.state == RoomState.CLAIMED:
                room.state = RoomState.QUEUED
                room.check_same_request()
        self.wake()
        return room

    def cancel(self, room_id: int, message: str) -> RoomState:
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None:  # cancelled before either leg arrived: a late prefill leg fails fast
                room = self._rooms[room_id] = Room(room_id)
            room.cancelled = True
            if room.state in (RoomState.REGISTERED, RoomState.CLAIMED, RoomState.QUEUED):
                room.fail(message, "aborted")
            state = room.state
        self.wake()
        return state

    def status(self, rooms: list[int], name: str = "") -> dict:
        with self._lock:
            out = {}
            for r in rooms:
                room = self._rooms.get(r)
                out[str(r)] = (
                    {"state": room.state.value, "message": room.message, "code": room.code}
                    if room else {"state": RoomState.UNKNOWN.value, "message": "", "code": ""}
                )
            return {"rooms": out, "leaving": self._heard(name)}

    # -- leaving (the server's drain) -------------------------------------------------------------
    def leave(self) -> None:
        """Refuse new peers and unclaimed rooms from now on; tell every registered decode."""
        with self._lock:
            if self._leaving_since is None:
                self._leaving_since = time.monotonic()
                self._unnotified = set(self._peers)
        log.info("leaving: telling %d decode peer(s)", len(self._unnotified))

    def unnotified(self) -> list[str]:
        """Decode peers that have not heard that this prefill is leaving."""
        with self._lock:
            return sorted(self._unnotified)

    # -- prefill side (engine loop) ---------------------------------------------------------------
    def claim(self, room_id: int, rid: str, prompt_len: int, digest: int) -> Room:
        """The prefill leg for `room_id` arrived."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None or (room.claimed_by is not None and room.state in (RoomState.DONE, RoomState.FAILED)):
                room = self._rooms[room_id] = Room(room_id, state=RoomState.CLAIMED)  # new, or a finished room's number reused
            elif room.claimed_by is not None:
                room.fail(f"bootstrap_room {room_id} is used by two prefill requests at once", "aborted")
            elif room.state == RoomState.REGISTERED:
                room.state = RoomState.QUEUED
            room.claimed_by, room.prompt_len, room.digest = rid, prompt_len, digest
            if room.state == RoomState.QUEUED:
                room.check_same_request()
            return room

    def start_transfer(self, room_id: int) -> Registration | None:
        """queued -> transferring, atomically against a cancel: the destination to write, or None
        when the room is no longer queued (then nothing may be written)."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None or room.state != RoomState.QUEUED:
                return None
            room.state = RoomState.TRANSFERRING
            return room.registration

    def get(self, room_id: int) -> Room | None:
        with self._lock:
            return self._rooms.get(room_id)

    def set_state(self, room_id: int, state: RoomState, message: str = "", code: str = "") -> None:
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None or room.state in (RoomState.DONE, RoomState.FAILED):
                return
            if state == RoomState.FAILED:
                room.fail(message, code)
            else:
                room.state, room.message = state, message
                if state == RoomState.DONE:
                    room.finished_at = time.monotonic()

    def expire(self, now: float, bootstrap_timeout: float) -> None:
        """Fail rooms whose prefill leg never came; forget long-finished rooms."""
        with self._lock:
            for room in list(self._rooms.values()):
                if room.state == RoomState.REGISTERED and now - room.created > bootstrap_timeout:
                    room.fail(f"no prefill request arrived for bootstrap_room {room.room} within {bootstrap_timeout:g}s",
                              "deadline_exceeded")
                elif room.finished_at is not None and now - room.finished_at > FINISHED_ROOM_RETENTION_S:
                    del self._rooms[room.room]

    def _drop_rooms_of(self, peer: DecodePeer, message: str) -> int:
        """Fail the rooms `peer` registered that no write has started for (a started write ends
        by itself: it fails, or lands in memory nobody reads). Lock held."""
        failed = 0
        for room in self._rooms.values():
            unstarted = room.state in (RoomState.REGISTERED, RoomState.QUEUED)
            if room.registration is not None and room.registration.peer is peer and unstarted:
                room.fail(message, "unavailable")
                failed += 1
        return failed

