"""DecodeConnector: a decode server's side of disaggregation.

Request path: prealloc (handshake with the prefill's bootstrap service once per peer, reserve a
slot and pages for the prompt, register them under the request's room) -> transfer (poll the
request's arrival record; prefill writes it after the KV) -> the scheduler's running batch, with
the first token, without a forward pass over the prompt.

Ownership: from reservation on, the request's slot and pages belong to this connector. Pages
that a live prefill may still write are never reused: when a request ends before its KV arrived,
its pages stay quarantined until the prefill reports the room finished (done, failed, unknown)
or is unreachable (a dead process writes nothing), then they are released.
"""

from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from tandem.kernels.kv_cache import PagedKVCache
from tandem.server.config import DisaggConfig
from tandem.server.disagg.bootstrap import BootstrapClient, BootstrapError
from tandem.server.disagg.connector import KVConnector, deadline, end
from tandem.server.disagg.layout import KVBuffer, KVLayout, LayoutMismatch, prompt_digest
from tandem.server.disagg.transfer import ArrivalRecord, MooncakeTransfer, RecordBuffer
from tandem.server.memory import KVMemory
from tandem.server.request import Bootstrap, Request
from tandem.server.sampling_params import InvalidRequestError

log = logging.getLogger("tandem.decode")

STATUS_INTERVAL_S = 0.1  # room-state polls per prefill peer while requests wait on it
PEER_RETRY_S = 5.0  # a failed handshake is retried for requests arriving this much later
FINISHED_ROOM_STATES = ("done", "failed", "unknown")  # no write can be in flight for these


@dataclass
class _Peer:
    client: BootstrapClient
    handshake: Future
    state: str = "connecting"  # connecting | ready | failed
    error: str = ""
    code: str = ""
    failed_at: float = 0.0
    statuses: dict[int, dict] = field(default_factory=dict)  # room -> latest {"state", "message", "code"}
    status_call: Future | None = None
    last_poll: float = 0.0
    unreachable_since: float | None = None


@dataclass
class _Pending:
    req: Request
    peer: _Peer
    due: float  # prealloc: the bootstrap deadline
    stage: str = "prealloc"  # prealloc | registering | transfer
    call: Future | None = None
    registered_at: float = 0.0


@dataclass
class _Quarantined:
    req: Request
    peer: _Peer
    room: int
    since: float


class DecodeConnector(KVConnector):
    role = "decode"

    def __init__(self, config: DisaggConfig, advertise_host: str, layout: KVLayout, kv_cache: PagedKVCache,
                 memory: KVMemory, wake: Callable[[], None]):
        super().__init__()
        self.config, self.layout, self.memory, self.wake = config, layout, memory, wake
        self.transfer = MooncakeTransfer(advertise_host, config.kv_transfer_protocol, config.ib_device)
        self.kv = KVBuffer(self.transfer.register(kv_cache.buffer), kv_cache.num_pages)
        self.records = RecordBuffer(memory.slots.num_slots)  # request slot i receives its record in slot i
        self.transfer.register(self.records.tensor)
        self.decode_id = f"{self.transfer.session}/{uuid.uuid4().hex[:8]}"
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tandem-bootstrap-client")
        self.peers: dict[tuple[str, int], _Peer] = {}
        self.pending: dict[str, _Pending] = {}
        self.quarantine: list[_Quarantined] = []
        self.counters = {"kv_transfer_bytes": 0, "kv_transfer_failures": 0, "bootstrap_failures": 0}
        self.kv_bytes_per_page = 2 * layout.num_layers * layout.page_bytes
        log.info("decode KV connector: Mooncake session %s (%s)", self.transfer.session, config.kv_transfer_protocol)

    def check_request(self, req: Request) -> None:
        if req.bootstrap is None:
            raise InvalidRequestError(
                "disaggregated_params", "required on a decode server (bootstrap_host, bootstrap_port, bootstrap_room; the router sets them)"
            )

    def add(self, req: Request) -> None:
        self.pending[req.rid] = _Pending(req, self._peer(req.bootstrap), deadline(self.config.bootstrap_timeout))

    # -- peers ------------------------------------------------------------------------------------
    def _peer(self, b: Bootstrap) -> _Peer:
        peer = self.peers.get((b.host, b.port))
        if peer is None or (peer.state == "failed" and time.monotonic() - peer.failed_at > PEER_RETRY_S):
            client = BootstrapClient(b.host, b.port)
            peer = self.peers[(b.host, b.port)] = _Peer(client, self.pool.submit(self._handshake, client))
            peer.handshake.add_done_callback(lambda _: self.wake())
        return peer

    def _handshake(self, client: BootstrapClient) -> None:
        """On a client thread: check the prefill's layout, then register our KV pool with it."""
        theirs, _session = client.layout()
        self.layout.check_compatible(theirs, here="on decode", there=f"on prefill {client.address}")
        client.add_peer(self.decode_id, self.transfer.session, self.layout, self.kv, self.records.base)

    def _update_peer(self, peer: _Peer, now: float) -> None:
        if peer.state == "connecting" and peer.handshake.done():
            error = peer.handshake.exception()
            if error is None:
                peer.state = "ready"
            else:
                mismatch = isinstance(error, LayoutMismatch) or getattr(error, "conflict", False)
                self._peer_failed(peer, now, f"handshake with prefill {peer.client.address} failed: {error}",
                                  "failed_precondition" if mismatch else "unavailable")
        if peer.status_call is not None and peer.status_call.done():
            try:
                peer.statuses.update(peer.status_call.result())
                peer.unreachable_since = None
            except BootstrapError as e:
                if e.unreachable and peer.unreachable_since is None:
                    peer.unreachable_since = now
            peer.status_call = None
        rooms = [p.req.bootstrap.room for p in self.pending.values() if p.peer is peer and p.stage == "transfer"]
        rooms += [q.room for q in self.quarantine if q.peer is peer]
        if not rooms:
            peer.unreachable_since = None  # only a failure while requests wait on it counts
        elif peer.status_call is None and now - peer.last_poll >= STATUS_INTERVAL_S:
            peer.last_poll = now
            peer.status_call = self.pool.submit(peer.client.status, rooms)
        if self._dead(peer, now) and peer.state != "failed":
            self._peer_failed(peer, now, f"prefill bootstrap service {peer.client.address} unreachable for "
                              f"{self.config.peer_timeout:g}s (--peer-timeout)", "unavailable")

    def _peer_failed(self, peer: _Peer, now: float, message: str, code: str) -> None:
        peer.state, peer.error, peer.code, peer.failed_at = "failed", message, code, now
        log.warning("%s", message)

    def _dead(self, peer: _Peer, now: float) -> bool:
        return peer.unreachable_since is not None and now - peer.unreachable_since > self.config.peer_timeout

    # -- the queues -------------------------------------------------------------------------------
    def poll(self) -> list[Request]:
        now = time.monotonic()
        for peer in list(self.peers.values()):
            self._update_peer(peer, now)
        ended = [r for p in list(self.pending.values()) if (r := self._advance(p, now)) is not None]
        self._release_quarantined(now)
        return ended

    def _advance(self, p: _Pending, now: float) -> Request | None:
        """Move one request along; returns it when it arrived or ended."""
        req, peer, room = p.req, p.peer, p.req.bootstrap.room
        if p.stage == "prealloc":
            if peer.state == "failed":
                self.counters["bootstrap_failures"] += 1
                self.pool.submit(self._cancel, peer.client, room, peer.error)  # end the prefill leg now, if it can hear
                return self._fail(p, peer.error, peer.code)
            if peer.state == "ready" and self._reserve(req):
                self.records.clear(req.slot)
                p.stage = "registering"
                p.call = self.pool.submit(
                    peer.client.register, room, self.decode_id, req.rid, req.prompt_len,
                    prompt_digest(req.token_ids[: req.prompt_len]), list(req.pages), req.slot,
                )
                p.call.add_done_callback(lambda _: self.wake())
            elif now > p.due:
                why = "the handshake with the prefill did not finish" if peer.state != "ready" else "no KV pages or slot came free"
                self.counters["bootstrap_failures"] += 1
                return self._fail(p, f"{why} within {self.config.bootstrap_timeout:g}s (--bootstrap-timeout)", "deadline_exceeded")
            return None
        if p.stage == "registering":
            if not p.call.done():
                return None
            error = p.call.exception()
            if error is not None:
                self.counters["bootstrap_failures"] += 1
                code = "failed_precondition" if getattr(error, "conflict", False) else "unavailable"
                return self._abandon(p, f"registering bootstrap_room {room} failed: {error}", code)
            p.stage, p.registered_at = "transfer", now
            return None
        record = self.records.read(req.slot)
        if record is not None:
            if record.room != room:
                self.counters["kv_transfer_failures"] += 1
                return self._abandon(p, f"the arrival record for bootstrap_room {record.room} landed where room {room} "
                                     "was expected (wrong room)", "internal")
            return self._arrived(p, record, now)
        status = peer.statuses.get(room, {})
        state = status.get("state")
        if self._dead(peer, now):
            self.counters["kv_transfer_failures"] += 1
            return self._fail(p, f"prefill {peer.client.address} died before the KV arrived (unreachable for "
                              f"{self.config.peer_timeout:g}s)", "unavailable")
        if state == "failed":
            self.counters["bootstrap_failures" if status["code"] == "deadline_exceeded" else "kv_transfer_failures"] += 1
            return self._fail(p, f"prefill {peer.client.address}: {status['message']}", status["code"] or "aborted")
        if state == "unknown":
            return self._abandon(p, f"prefill {peer.client.address} no longer knows bootstrap_room {room} (restarted?)", "unavailable")
        if state == "registered" and now - p.registered_at > self.config.bootstrap_timeout + 1.0:
            self.counters["bootstrap_failures"] += 1
            return self._abandon(p, f"no prefill request arrived for bootstrap_room {room} within "
                                 f"{self.config.bootstrap_timeout:g}s (--bootstrap-timeout)", "deadline_exceeded")
        if now - p.registered_at > self.config.transfer_timeout:
            self.counters["kv_transfer_failures"] += 1
            return self._abandon(p, f"the KV for bootstrap_room {room} did not arrive within "
                                 f"{self.config.transfer_timeout:g}s (--transfer-timeout)", "deadline_exceeded")
        return None

    def _reserve(self, req: Request) -> bool:
        """A slot and pages for the prompt, leaving the running requests their output headroom."""
        need = self.memory.pages_for(req.prompt_len)
        headroom = self.memory.pages_for(self.scheduler.reserved_tokens())
        if self.memory.available_pages - need < headroom:
            return False
        return self.memory.reserve(req, req.prompt_len)

    def _arrived(self, p: _Pending, record: ArrivalRecord, now: float) -> Request:
        req = p.req
        del self.pending[req.rid]
        req.num_cached_prompt = record.cached_tokens
        if req.params.logprobs:
            req.output_logprobs.append(record.logprob)
        if req.params.top_logprobs:
            req.output_top_logprobs.append([])  # the prefill sends the chosen token's logprob only
        self.counters["kv_transfer_bytes"] += self.memory.pages_for(req.prompt_len) * self.kv_bytes_per_page
        self.on_transfer(now - p.registered_at)
        self.scheduler.add_prefilled(req, record.first_token)
        return req

    def _fail(self, p: _Pending, message: str, code: str | None) -> Request:
        """End a request no live prefill will write to: its pages are free at once."""
        del self.pending[p.req.rid]
        self.memory.release(p.req)
        return end(p.req, message, code)

    def _abandon(self, p: _Pending, message: str, code: str | None) -> Request:
        """End a request whose room a live prefill may still write: cancel it there, and keep the
        pages until the prefill says the room is finished."""
        del self.pending[p.req.rid]
        room = p.req.bootstrap.room
        self.quarantine.append(_Quarantined(p.req, p.peer, room, time.monotonic()))
        self.pool.submit(self._cancel, p.peer.client, room, message)
        return end(p.req, message, code)

    @staticmethod
    def _cancel(client: BootstrapClient, room: int, message: str) -> None:
        try:
            client.cancel(room, message)
        except BootstrapError as e:  # the status polls decide what happens to the pages
            log.info("cancelling bootstrap_room %d: %s", room, e)

    def _release_quarantined(self, now: float) -> None:
        for q in list(self.quarantine):
            state = q.peer.statuses.get(q.room, {}).get("state")
            overdue = now - q.since > self.config.transfer_timeout
            if state in FINISHED_ROOM_STATES or self._dead(q.peer, now) or overdue:
                if overdue:
                    log.warning("releasing the pages of bootstrap_room %d after %.0fs without an answer from %s",
                                q.room, now - q.since, q.peer.client.address)
                self.quarantine.remove(q)
                self.memory.release(q.req)

    def abort(self, rid: str, message: str) -> Request | None:
        p = self.pending.get(rid)
        if p is None:
            return None
        if p.stage == "prealloc":
            return self._fail(p, message, None)
        return self._abandon(p, message, None)

    def has_work(self) -> bool:
        return bool(self.pending or self.quarantine)

    def idle_wait(self) -> float | None:
        if any(p.stage == "transfer" for p in self.pending.values()):
            return 0.002  # arrival records are polled, not announced
        return 0.05 if self.has_work() else None

    def held(self) -> list[Request]:
        return [p.req for p in self.pending.values() if p.req.slot is not None] + [q.req for q in self.quarantine]

    def stats(self) -> dict[str, int]:
        transfer = sum(p.stage == "transfer" for p in self.pending.values())
        return {"prealloc_queue": len(self.pending) - transfer, "transfer_queue": transfer, **self.counters}

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
