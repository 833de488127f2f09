"""DecodeConnector: a decode server's side of disaggregation.

Request path: prealloc (handshake with the prefill's bootstrap service once per prefill process,
reserve a slot and pages for the prompt, register them under the request's room) -> transfer
(poll the request's arrival record; prefill writes it after the KV) -> the scheduler's running
batch, with the first token, without a forward pass over the prompt.

Prefix reuse: the reservation pins the longest prefix of the prompt this server's prefix cache
holds (a shared system prompt, the earlier turns of a conversation), and only the pages after it
are registered: the prefill sends those alone (`skip_pages`). Once the KV has arrived, the
prompt's whole pages enter the prefix cache (the scheduler's `add_prefilled`), and the output's
when the request ends: the next request with that prefix finds them.

Peers: a `_Peer` is this decode's registration with one prefill *process* (its instance id, read
at the handshake and in every answer). A new instance at the same address, a refusal that says
the registration is unknown, or a prefill that says it is leaving retires the registration; the
next request handshakes again. Ready peers get a heartbeat every `--peer-heartbeat-interval`;
after two missed in a row (or, while requests wait on it, `--peer-timeout` without an answer)
the peer is offline and the requests waiting on it fail at once (UNAVAILABLE).

Ownership: from reservation on, the request's slot and pages belong to this connector (its
cached prefix stays the prefix cache's, pinned: no transfer writes it, no failure frees it). Pages
that a live prefill may still write are never reused: when a request ends before its KV arrived,
its pages stay quarantined until the prefill reports the room finished (done, failed, unknown)
or is proven gone (another instance answers at its address, or nothing listens there: a prefill
closes its bootstrap service only after its last write), then they are released.
"""

from __future__ import annotations

import enum
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable

from tandem.kernels.kv_cache import PagedKVCache
from tandem.server.config import DisaggConfig
from tandem.server.disagg.bootstrap import BootstrapClient, BootstrapError
from tandem.server.disagg.rooms import RoomState, new_instance_id
from tandem.server.disagg.connector import ConnectorEvents, KVConnector, OtherRanks, deadline, own_part
from tandem.server.disagg.layout import KVLayout, LayoutMismatch, prompt_digest
from tandem.server.disagg.transfer import ArrivalRecord, MooncakeTransfer, RecordBuffer, token_major
from tandem.server.scheduling.memory import KVMemory
from tandem.server.scheduling.request import Request
from tandem.server.scheduling.sampling_params import InvalidRequestError

log = logging.getLogger("tandem.decode")

ARRIVAL_POLL_S = 0.002  # arrival records are polled, not announced
STATUS_INTERVAL_S = 0.1  # room-state polls per prefill peer while requests wait on it
PEER_RETRY_S = 1.0  # a failed handshake is retried for requests arriving this much later
HEARTBEAT_MISSES = 2  # heartbeats missed in a row that mark a prefill offline
LEAVE_TIMEOUT_S = 2.0  # on shutdown, how long telling the prefills may take


class PeerState(enum.Enum):
    CONNECTING = "connecting"  # handshake in flight
    READY = "ready"  # registered with `instance`
    FAILED = "failed"  # the handshake failed
    GONE = "gone"  # the registration is void


class Stage(enum.Enum):
    PREALLOC = "prealloc"  # waiting for the handshake, a slot and pages
    REGISTERING = "registering"  # registering the pages under the request's room
    TRANSFER = "transfer"  # waiting for the KV and the arrival record


@dataclass
class _Peer:
    """This decode's registration with one prefill process at one bootstrap address.

    States: connecting (handshake in flight) -> ready (registered with `instance`) -> gone (the
    registration is void: the prefill restarted, forgot it, or went offline); or connecting ->
    failed (the handshake failed; requests for the address fail fast for PEER_RETRY_S). A ready
    peer that says it is `leaving` takes no new rooms but still serves the ones it has."""

    key: tuple[str, int]  # bootstrap (host, port)
    client: BootstrapClient
    handshake: Future  # -> the prefill's answer to our registration
    state: PeerState = PeerState.CONNECTING
    instance: str = ""  # the prefill process we registered with
    head_major: bool = False  # it splits the KV heads unlike us: its pages arrive head-major
    skips_pages: bool = False  # it can leave out the prompt pages our prefix cache holds
    leaving: bool = False
    error: str = ""
    code: str = ""
    failed_at: float = 0.0
    proven_gone: bool = False  # the process can write nothing more (see the module doc)
    refused: bool = False  # the last failed call found nothing listening
    statuses: dict[int, dict] = field(default_factory=dict)  # room -> latest {"state", "message", "code"}
    status_call: Future | None = None
    last_poll: float = 0.0
    unreachable_since: float | None = None
    heartbeat: Future | None = None
    next_heartbeat: float = 0.0
    missed: int = 0  # heartbeats missed in a row

    def __str__(self) -> str:
        return f"prefill {self.client.address}" + (f" (instance {self.instance})" if self.instance else "")


@dataclass
class _Pending:
    req: Request
    peer: _Peer
    due: float  # prealloc: the bootstrap deadline
    stage: Stage = Stage.PREALLOC
    call: Future | None = None
    registered_at: float = 0.0
    retried: bool = False  # a registration refused by a restarted prefill is retried once


@dataclass
class _Quarantined:
    req: Request
    peer: _Peer
    room: int
    since: float


class DecodeConnector(KVConnector):
    role = "decode"

    def __init__(self, config: DisaggConfig, advertise_host: str, layout: KVLayout, kv_cache: PagedKVCache,
                 memory: KVMemory, wake: Callable[[], None], on_transfer: Callable[[float], None] = lambda seconds: None,
                 name: str | None = None, ranks: OtherRanks | None = None):
        super().__init__(on_transfer)
        self.config, self.layout, self.memory, self.wake = config, layout, memory, wake
        self.reuse = not config.disable_decode_prefix_reuse
        self.transfer = MooncakeTransfer(advertise_host, config.kv_transfer_protocol, config.ib_device)
        # One buffer per tensor-parallel rank: each prefill rank writes its heads into whichever holds them.
        self.buffer, self.ranks = kv_cache.buffer, ranks
        self.parts = [own_part(self.transfer, kv_cache)] + (ranks.parts if ranks is not None else [])
        self.kv_heads = [[p.first_head, p.num_heads] for p in self.parts]
        self.records = RecordBuffer(memory.slots.num_slots)  # request slot i receives its record in slot i
        self.transfer.register(self.records.tensor)
        # Who we are to the prefills: a stable name (a successor at the same address replaces us)
        # and this process's instance.
        self.me = {"decode": name or self.transfer.session, "decode_instance": new_instance_id()}
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tandem-bootstrap-client")
        self.peers: dict[tuple[str, int], _Peer] = {}  # the current registration per address
        self.instances: dict[tuple[str, int], str] = {}  # the last prefill instance registered with per address
        self.pending: dict[str, _Pending] = {}
        self.quarantine: list[_Quarantined] = []
        self._events = ConnectorEvents()  # what the current poll hands the loop
        self._reserved_tokens = 0  # KV the running requests keep for their output, as of the current poll
        self.counters = {"kv_transfer_bytes": 0, "kv_transfer_failures": 0, "bootstrap_failures": 0,
                         "peer_handshakes": 0, "peer_rehandshakes": 0, "peers_offline": 0,
                         "kv_transfer_skipped_bytes": 0, "decode_prefix_query_tokens": 0, "decode_prefix_hit_tokens": 0}
        self.kv_bytes_per_page = 2 * layout.num_layers * layout.page_bytes
        log.info("decode KV connector: %s (instance %s), Mooncake session %s (%s)", self.me["decode"],
                 self.me["decode_instance"], self.transfer.session, config.kv_transfer_protocol)

    def check_request(self, req: Request) -> None:
        if req.bootstrap is None:
            raise InvalidRequestError(
                "disaggregated_params", "required on a decode server (bootstrap_host, bootstrap_port, bootstrap_room; the router sets them)"
            )

    def add(self, req: Request) -> None:
        self.pending[req.rid] = _Pending(req, self._peer(req.bootstrap.address), deadline(self.config.bootstrap_timeout))

    # -- peers ------------------------------------------------------------------------------------
    def _peer(self, key: tuple[str, int]) -> _Peer:
        """The registration to use for a new room at a bootstrap address, handshaking if there is none."""
        peer = self.peers.get(key)
        if peer is None or (peer.state is PeerState.FAILED and time.monotonic() - peer.failed_at > PEER_RETRY_S):
            client = BootstrapClient(*key)
            peer = self.peers[key] = _Peer(key, client, self.pool.submit(self._handshake, client))
            peer.handshake.add_done_callback(lambda _: self.wake())
        return peer

    def _handshake(self, client: BootstrapClient) -> dict:
        """On a client thread: check the prefill's layout, then register our KV pool with it."""
        theirs = client.layout()
        self.layout.check_compatible(theirs["layout"], here="on decode", there=f"on prefill {client.address}")
        answer = client.add_peer(self.me, self.transfer.session, self.layout, self.parts, self.records.base)
        return {**answer, "kv_heads": theirs["kv_heads"], "features": theirs["features"]}

    def _known_peers(self) -> list[_Peer]:
        """Current registrations and retired ones that requests or quarantined pages still wait on."""
        peers = {id(p): p for p in self.peers.values()}
        peers.update((id(p.peer), p.peer) for p in self.pending.values())
        peers.update((id(q.peer), q.peer) for q in self.quarantine)
        return list(peers.values())

    def _update_peer(self, peer: _Peer, now: float) -> None:
        if peer.state is PeerState.CONNECTING and peer.handshake.done():
            error = peer.handshake.exception()
            if error is None:
                answer = peer.handshake.result()
                peer.head_major = [list(h) for h in answer["kv_heads"]] != self.kv_heads
                peer.skips_pages = "skip_pages" in answer["features"]
                self._connected(peer, answer["instance"], now)
            else:
                mismatch = isinstance(error, LayoutMismatch) or getattr(error, "conflict", False)
                peer.state, peer.failed_at = PeerState.FAILED, now
                peer.error, peer.code = f"handshake with prefill {peer.client.address} failed: {error}", (
                    "failed_precondition" if mismatch else "unavailable")
                log.warning("%s", peer.error)
        if peer.status_call is not None and peer.status_call.done():
            try:
                answer = peer.status_call.result()
            except BootstrapError as e:
                self._no_answer(peer, now, e)
            else:
                peer.unreachable_since = None
                if self._same_instance(peer, answer):
                    peer.statuses.update(answer["rooms"])
            peer.status_call = None
        if peer.heartbeat is not None and peer.heartbeat.done():
            try:
                answer = peer.heartbeat.result()
            except BootstrapError as e:
                peer.missed += 1
                self._no_answer(peer, now, e)
                if peer.missed >= HEARTBEAT_MISSES:
                    self._offline(peer, f"{peer.missed} heartbeats in a row unanswered ({e})")
            else:
                peer.missed = 0
                if self._same_instance(peer, answer) and not answer["known"]:
                    self._lost(peer, f"{peer} no longer knows this decode", proven=False, rehandshake=True)
            peer.heartbeat = None
        rooms = [p.req.bootstrap.room for p in self.pending.values() if p.peer is peer and p.stage is Stage.TRANSFER]
        rooms += [q.room for q in self.quarantine if q.peer is peer and not peer.proven_gone]
        if not rooms:
            peer.unreachable_since = None  # only a failure while requests wait on it counts
        elif peer.status_call is None and now - peer.last_poll >= STATUS_INTERVAL_S:
            peer.last_poll = now
            peer.status_call = self.pool.submit(peer.client.status, self.me, rooms)
        if peer.state is PeerState.READY and not peer.leaving and peer.heartbeat is None and now >= peer.next_heartbeat:
            peer.next_heartbeat = now + self.config.peer_heartbeat_interval
            peer.heartbeat = self.pool.submit(peer.client.heartbeat, self.me)
            peer.heartbeat.add_done_callback(lambda _: self.wake())
        if peer.unreachable_since is not None and now - peer.unreachable_since > self.config.peer_timeout:
            self._offline(peer, f"unreachable for {self.config.peer_timeout:g}s (--peer-timeout)")

    def _connected(self, peer: _Peer, instance: str, now: float) -> None:
        peer.state, peer.instance = PeerState.READY, instance
        peer.next_heartbeat = now + self.config.peer_heartbeat_interval
        self.counters["peer_handshakes"] += 1
        before = self.instances.get(peer.key)
        self.instances[peer.key] = instance
        if before is None or before == instance:
            log.info("handshake with %s: registered as %s (instance %s)", peer, self.me["decode"], self.me["decode_instance"])
            return
        self.counters["peer_rehandshakes"] += 1
        log.info("re-handshake with %s: it replaced instance %s", peer, before)
        for old in self._known_peers():  # the predecessor is gone: a new process holds its address
            if old.key == peer.key and old.instance not in ("", instance):
                self._lost(old, f"{old} was replaced by instance {instance}", proven=True)

    def _same_instance(self, peer: _Peer, answer: dict) -> bool:
        """Check an answer of `peer`'s address; False (and the registration retired) when another
        process answered. A prefill that says it is leaving takes no new rooms from now on."""
        if answer["instance"] != peer.instance:
            self._lost(peer, f"{peer} was replaced by instance {answer['instance']}", proven=True, rehandshake=True)
            return False
        if answer.get("leaving"):
            self._leaving(peer)
        return True

    def _leaving(self, peer: _Peer) -> None:
        """The prefill is shutting down: no new rooms through this registration."""
        if peer.state is PeerState.READY and not peer.leaving:
            peer.leaving = True
            self._retire(peer)
            log.info("%s is leaving: new rooms wait for its successor, its rooms in flight finish", peer)

    def _no_answer(self, peer: _Peer, now: float, e: BootstrapError) -> None:
        if not e.unreachable:
            return
        peer.refused = e.refused
        if peer.unreachable_since is None:
            peer.unreachable_since = now
        if peer.state is PeerState.GONE and e.refused:
            peer.proven_gone = True  # nothing listens: the process exited after its last write

    def _offline(self, peer: _Peer, why: str) -> None:
        if peer.state is not PeerState.READY:
            return
        self.counters["peers_offline"] += 1
        self._lost(peer, f"{peer} is offline: {why}", proven=peer.refused)

    def _lost(self, peer: _Peer, message: str, proven: bool, rehandshake: bool = False) -> None:
        """The registration is void. Requests waiting on it fail (see _advance); with
        `rehandshake`, a new handshake with the address starts now instead of on the next request."""
        peer.proven_gone |= proven
        if peer.state is PeerState.GONE:
            return
        peer.state, peer.error, peer.code = PeerState.GONE, message, "unavailable"
        log.warning("%s", message)
        self._retire(peer)
        if rehandshake:
            self._peer(peer.key)

    def _retire(self, peer: _Peer) -> None:
        if self.peers.get(peer.key) is peer:
            del self.peers[peer.key]

    # -- the queues -------------------------------------------------------------------------------
    def poll(self, finished: list[Request], reserved_tokens: int) -> ConnectorEvents:
        now, self._events, self._reserved_tokens = time.monotonic(), ConnectorEvents(), reserved_tokens
        for peer in self._known_peers():
            self._update_peer(peer, now)
        for p in list(self.pending.values()):
            self._advance(p, now)
        self._release_quarantined(now)
        return self._events

    def _advance(self, p: _Pending, now: float) -> None:
        """Move one request along: into the events once it arrived or ended."""
        req, room = p.req, p.req.bootstrap.room
        if p.stage is Stage.PREALLOC:
            if p.peer.state is PeerState.GONE or p.peer.leaving:  # not registered yet: use the address's current peer
                p.peer = self._peer(p.peer.key)
            peer = p.peer
            if peer.state is PeerState.FAILED:
                self.counters["bootstrap_failures"] += 1
                self.pool.submit(self._cancel, peer.client, room, peer.error)  # end the prefill leg now, if it can hear
                return self._fail(p, peer.error, peer.code)
            if peer.state is PeerState.READY and req.cached_pages and not peer.skips_pages:
                self.memory.release(req)  # reserved for a prefill replaced by one that sends whole prompts
            if peer.state is PeerState.READY and (req.slot is not None or self._reserve(req, peer)):
                self.records.clear(req.slot)
                p.stage = Stage.REGISTERING
                p.call = self.pool.submit(
                    peer.client.register, self.me, room, req.rid, req.prompt_len,
                    prompt_digest(req.token_ids[: req.prompt_len]), req.pages[req.cached_pages :], req.slot,
                    req.cached_pages,
                )
                p.call.add_done_callback(lambda _: self.wake())
            elif now > p.due:
                why = "the handshake with the prefill did not finish" if peer.state is not PeerState.READY else "no KV pages or slot came free"
                self.counters["bootstrap_failures"] += 1
                return self._fail(p, f"{why} within {self.config.bootstrap_timeout:g}s (--bootstrap-timeout)", "deadline_exceeded")
            return None
        peer = p.peer
        if p.stage is Stage.REGISTERING:
            if not p.call.done():
                return None
            error = p.call.exception()
            reason = getattr(error, "reason", "")  # set on the bootstrap service's own refusals
            if error is None and self._same_instance(peer, p.call.result()):
                p.stage, p.registered_at = Stage.TRANSFER, now
                return None
            if reason in ("unknown_peer", "leaving"):
                # Refused before anything was registered: no write can come to these pages.
                if reason == "leaving":
                    self._leaving(peer)  # it still serves the rooms it has
                else:  # the prefill restarted (or forgot us): handshake again and register there, once
                    self._lost(peer, f"{peer} refused bootstrap_room {room}: {error}",
                               proven=error.instance != peer.instance, rehandshake=True)
                    if not p.retried:
                        p.stage, p.retried = Stage.PREALLOC, True  # the reserved pages stay with the request
                        return self._advance(p, now)
                self.counters["bootstrap_failures"] += 1
                return self._fail(p, f"registering bootstrap_room {room} failed: {error}", "unavailable")
            if error is not None:
                self.counters["bootstrap_failures"] += 1
                code = "failed_precondition" if getattr(error, "conflict", False) else "unavailable"
                return self._abandon(p, f"registering bootstrap_room {room} failed: {error}", code)
            p.stage, p.registered_at = Stage.TRANSFER, now  # registered, but with a process already gone (below)
        record = self.records.read(req.slot)
        if record is not None:
            if record.room != room:
                self.counters["kv_transfer_failures"] += 1
                return self._abandon(p, f"the arrival record for bootstrap_room {record.room} landed where room {room} "
                                     "was expected (wrong room)", "internal")
            return self._arrived(p, record, now)
        if peer.state is PeerState.GONE:
            self.counters["kv_transfer_failures"] += 1
            message = f"the KV for bootstrap_room {room} will not arrive: {peer.error}"
            return self._fail(p, message, "unavailable") if peer.proven_gone else self._abandon(p, message, "unavailable", cancel=False)
        status = peer.statuses.get(room, {})
        state = status.get("state")
        if state is RoomState.FAILED:
            self.counters["bootstrap_failures" if status["code"] == "deadline_exceeded" else "kv_transfer_failures"] += 1
            return self._fail(p, f"prefill {peer.client.address}: {status['message']}", status["code"] or "aborted")
        if state is RoomState.UNKNOWN:
            return self._abandon(p, f"{peer} no longer knows bootstrap_room {room}", "unavailable")
        if state is RoomState.REGISTERED and now - p.registered_at > self.config.bootstrap_timeout + 1.0:
            self.counters["bootstrap_failures"] += 1
            return self._abandon(p, f"no prefill request arrived for bootstrap_room {room} within "
                                 f"{self.config.bootstrap_timeout:g}s (--bootstrap-timeout)", "deadline_exceeded")
        if now - p.registered_at > self.config.transfer_timeout:
            self.counters["kv_transfer_failures"] += 1
            return self._abandon(p, f"the KV for bootstrap_room {room} did not arrive within "
                                 f"{self.config.transfer_timeout:g}s (--transfer-timeout)", "deadline_exceeded")
        return None

    def _reserve(self, req: Request, peer: _Peer) -> bool:
        """A slot and pages for the prompt, sharing the prefix our cache holds when the prefill can
        leave it out, and leaving the running requests their output headroom."""
        return self.memory.reserve(req, req.prompt_len, reuse_prefix=self._reuses(peer),
                                   keep_pages=self.memory.pages_for(self._reserved_tokens))

    def _reuses(self, peer: _Peer) -> bool:
        """Requests for `peer` share the prefix our cache holds (it can leave those pages out)."""
        return self.reuse and peer.skips_pages

    def _arrived(self, p: _Pending, record: ArrivalRecord, now: float) -> None:
        req = p.req
        del self.pending[req.rid]
        arrived = req.pages[req.cached_pages : self.memory.pages_for(req.prompt_len)]  # not the cached prefix
        if p.peer.head_major:  # on every rank, before any forward pass reads these pages
            token_major(self.buffer, arrived)
            if self.ranks is not None:
                self.ranks.relayout(arrived)
        req.num_cached_prompt = record.cached_tokens
        if req.params.logprobs:
            req.output_logprobs.append(record.logprob)
        if req.params.top_logprobs:
            req.output_top_logprobs.append([])  # the prefill sends the chosen token's logprob only
        self.counters["kv_transfer_bytes"] += len(arrived) * self.kv_bytes_per_page
        self.counters["kv_transfer_skipped_bytes"] += req.cached_pages * self.kv_bytes_per_page
        if self._reuses(p.peer):  # its prompt was looked up in the prefix cache
            self.counters["decode_prefix_query_tokens"] += req.prompt_len
            self.counters["decode_prefix_hit_tokens"] += req.cached_pages * self.memory.page_size
        self.on_transfer(now - p.registered_at)
        self._events.arrived.append((req, record.first_token))
        # It joins the running batch after this poll: until the next one counts it at the
        # scheduler's ratio, reserve its whole output budget.
        self._reserved_tokens += req.max_new_tokens - 1

    def _fail(self, p: _Pending, message: str, code: str | None) -> None:
        """End a request no live prefill will write to: its pages are free at once."""
        self._events.end(self._drop(p), message, code)

    def _abandon(self, p: _Pending, message: str, code: str | None, cancel: bool = True) -> None:
        """End a request whose room a live prefill may still write (see _quarantine)."""
        self._events.end(self._quarantine(p, message, cancel), message, code)

    def _drop(self, p: _Pending) -> Request:
        del self.pending[p.req.rid]
        self.memory.release(p.req)
        return p.req

    def _quarantine(self, p: _Pending, message: str, cancel: bool = True) -> Request:
        """Cancel the request's room on the prefill (if it can hear), and keep its pages until the
        prefill says the room is finished or is proven gone."""
        del self.pending[p.req.rid]
        room = p.req.bootstrap.room
        self.quarantine.append(_Quarantined(p.req, p.peer, room, time.monotonic()))
        if cancel:
            self.pool.submit(self._cancel, p.peer.client, room, message)
        return p.req

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
            if (state is not None and state.finished) or q.peer.proven_gone or overdue:
                if overdue:
                    log.warning("releasing the pages of bootstrap_room %d after %.0fs without an answer from %s",
                                q.room, now - q.since, q.peer)
                self.quarantine.remove(q)
                self.memory.release(q.req)

    def abort(self, rid: str, message: str) -> Request | None:
        p = self.pending.get(rid)
        if p is None:
            return None
        return self._drop(p) if p.stage is Stage.PREALLOC else self._quarantine(p, message)

    def has_work(self) -> bool:
        return bool(self.pending or self.quarantine)

    def _awaiting_kv(self) -> bool:
        """Requests registered with their prefill whose arrival record has not been read yet
        (the other stages' calls wake the loop when they end)."""
        return any(p.stage is Stage.TRANSFER for p in self.pending.values())

    def idle_wait(self) -> float | None:
        if self._awaiting_kv():
            return ARRIVAL_POLL_S
        if self.has_work():
            return 0.05
        beats = [p.next_heartbeat for p in self.peers.values() if p.state is PeerState.READY and p.heartbeat is None]
        return max(0.0, min(beats) - time.monotonic()) if beats else None

    def step_poll_interval(self) -> float | None:
        # A KV that lands mid-step streams its first token now, not after the step (a decode
        # step lasts tens of milliseconds, longer while a prefill beside it holds the cores).
        return ARRIVAL_POLL_S if self._awaiting_kv() else None

    def drained(self) -> bool:
        return not self.pending

    def held(self) -> list[Request]:
        return [p.req for p in self.pending.values() if p.req.slot is not None] + [q.req for q in self.quarantine]

    def stats(self) -> dict[str, int]:
        transfer = sum(p.stage is Stage.TRANSFER for p in self.pending.values())
        return {"prealloc_queue": len(self.pending) - transfer, "transfer_queue": transfer, **self.counters}

    def close(self) -> None:
        """Tell every prefill we hold a registration with that we are leaving: it forgets this
        decode and fails the rooms we registered that it has not started writing."""
        peers = [p for p in self.peers.values() if p.state is PeerState.READY]
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
