"""DecodeConnector: a decode server's side of disaggregation.

A request's life on a decode (`Stage`, one method each):

    PREALLOC     wait for the handshake with the prefill process at the request's bootstrap
                 address (once per process, `decode_peers.py`), then for a slot and pages for the prompt
                 past the prefix this server's cache holds; then register them under the room
    REGISTERING  the registration call is in flight; a prefill that restarted (it does not know
                 this decode) gets the request again after a new handshake, once
    TRANSFER     poll the request's arrival record (the prefill writes it after the KV) and the
                 room's state on the prefill
    arrived      the scheduler's running batch, with the first token, without a forward pass
                 over the prompt

It ends early in one of two ways. Failed (`_fail`): no live prefill will write its pages (never
registered, the room failed on the prefill, the process is GONE), so they are free at once.
Abandoned (`_abandon`: an abort or a timeout after registration, a LOST peer, an unknown room, a
wrong arrival record): a live prefill may still write them, so they stay quarantined
(`_Quarantined`) until the prefill reports the room finished (done, failed, unknown), or its peer
is GONE, or --transfer-timeout passed; then they are released. Either way the request's stream
ends at once.

Prefix reuse: the reservation pins the longest prefix of the prompt this server's prefix cache
holds (a shared system prompt, the earlier turns of a conversation), and only the pages after it
are registered: the prefill sends those alone (`skip_pages`). Once the KV has arrived, the
prompt's whole pages enter the prefix cache (the scheduler's `add_prefilled`), and the output's
when the request ends: the next request with that prefix finds them.

Peers: the registrations with the prefill processes are `decode_peers.py`'s state machine, and
`decode_links.py` makes their calls (the handshake, room-status polls while requests wait,
heartbeats), feeds it the answers and acts on its transitions.

Ownership: from reservation on, the request's slot and pages belong to this connector (its
cached prefix stays the prefix cache's, pinned: no transfer writes it, no failure frees it).
"""

from __future__ import annotations

import enum
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from tandem.kernels.kv_cache import PagedKVCache
from tandem.server.config import DisaggConfig
from tandem.server.disagg.bootstrap import BootstrapClient, BootstrapError
from tandem.server.disagg.connector import ConnectorEvents, KVConnector, OtherRanks, deadline, own_part
from tandem.server.disagg.layout import KVLayout, prompt_digest
from tandem.server.disagg.decode_links import PrefillLink, PrefillLinks
from tandem.server.disagg.decode_peers import PeerState
from tandem.server.disagg.prefill_rooms import RoomState, new_instance_id
from tandem.server.disagg.transfer import ArrivalRecord, MooncakeTransfer, RecordBuffer, token_major
from tandem.server.scheduling.memory import KVMemory
from tandem.server.scheduling.request import Request
from tandem.server.scheduling.sampling_params import InvalidRequestError

log = logging.getLogger("tandem.decode")

ARRIVAL_POLL_S = 0.002  # arrival records are polled, not announced


class Stage(enum.Enum):
    PREALLOC = "prealloc"  # waiting for the handshake, a slot and pages
    REGISTERING = "registering"  # registering the pages under the request's room
    TRANSFER = "transfer"  # waiting for the KV and the arrival record


@dataclass
class _Pending:
    req: Request
    peer: PrefillLink
    due: float  # prealloc: the bootstrap deadline
    stage: Stage = Stage.PREALLOC
    call: Future | None = None
    registered_at: float = 0.0
    retried: bool = False  # a registration refused by a restarted prefill is retried once


@dataclass
class _Quarantined:
    req: Request
    peer: PrefillLink
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
        self.links = PrefillLinks(config, self.me, self._handshake, self.kv_heads, wake)
        self.pending: dict[str, _Pending] = {}
        self.quarantine: list[_Quarantined] = []
        self._events = ConnectorEvents()  # what the current poll hands the loop
        self._reserved_tokens = 0  # KV the running requests keep for their output, as of the current poll
        self.counters = {"kv_transfer_bytes": 0, "kv_transfer_failures": 0, "bootstrap_failures": 0,
                         "kv_transfer_skipped_bytes": 0, "decode_prefix_query_tokens": 0, "decode_prefix_hit_tokens": 0}
        # What arrives per page: a copy on each rank of a replicated (latent) pool, else each head once
        self.kv_bytes_per_page = layout.page_bytes_all_parts * (len(self.parts) if layout.replicated else 1)
        log.info("decode KV connector: %s (instance %s), Mooncake session %s (%s)", self.me["decode"],
                 self.me["decode_instance"], self.transfer.session, config.kv_transfer_protocol)

    def check_request(self, req: Request) -> None:
        if req.bootstrap is None:
            raise InvalidRequestError(
                "disaggregated_params", "required on a decode server (bootstrap_host, bootstrap_port, bootstrap_room; the router sets them)"
            )

    def add(self, req: Request) -> None:
        self.pending[req.rid] = _Pending(req, self.links.for_room(req.bootstrap.address), deadline(self.config.bootstrap_timeout))

    # -- peers ------------------------------------------------------------------------------------
    def _handshake(self, client: BootstrapClient) -> dict:
        """On a client thread: check the prefill's layout, then register our KV pool with it."""
        theirs = client.layout()
        self.layout.check_compatible(theirs["layout"], here="on decode", there=f"on prefill {client.address}")
        answer = client.add_peer(self.me, self.transfer.session, self.layout, self.parts, self.records.base)
        return {**answer, "kv_heads": theirs["kv_heads"], "features": theirs["features"]}

    def _rooms_waiting_on(self, peer: PrefillLink) -> list[int]:
        """The rooms whose state to poll at `peer`: requests waiting for their KV, and quarantined
        pages that a process not proven gone may still write."""
        rooms = [p.req.bootstrap.room for p in self.pending.values() if p.peer is peer and p.stage is Stage.TRANSFER]
        return rooms + [q.room for q in self.quarantine if q.peer is peer and peer.state is not PeerState.GONE]

    # -- the queues -------------------------------------------------------------------------------
    def poll(self, finished: list[Request], reserved_tokens: int) -> ConnectorEvents:
        now, self._events, self._reserved_tokens = time.monotonic(), ConnectorEvents(), reserved_tokens
        retired = [p.peer for p in self.pending.values()] + [q.peer for q in self.quarantine]
        self.links.update(now, retired, self._rooms_waiting_on)
        for p in list(self.pending.values()):
            self._advance(p, now)
        self._release_quarantined(now)
        return self._events

    def _advance(self, p: _Pending, now: float) -> None:
        """Move one request along its stage (the module doc): into the events once it arrived or ended."""
        {Stage.PREALLOC: self._prealloc, Stage.REGISTERING: self._registering, Stage.TRANSFER: self._transfer}[p.stage](p, now)

    def _prealloc(self, p: _Pending, now: float) -> None:
        """Wait for the handshake, then for a slot and pages; then register them under the room."""
        if p.peer.state.retired:  # not registered yet: use the address's current registration
            p.peer = self.links.for_room(p.peer.address)
        req, peer = p.req, p.peer
        if peer.state is PeerState.FAILED:
            self.counters["bootstrap_failures"] += 1
            self.links.pool.submit(self._cancel, peer.client, req.bootstrap.room, peer.error)  # end the prefill leg now, if it can hear
            return self._fail(p, peer.error, peer.code)
        if peer.state is PeerState.READY and req.cached_pages and not peer.skips_pages:
            self.memory.release(req)  # reserved for a prefill replaced by one that sends whole prompts
        if peer.state is PeerState.READY and (req.slot is not None or self._reserve(req, peer)):
            return self._register(p)
        if now > p.due:
            why = "the handshake with the prefill did not finish" if peer.state is not PeerState.READY else "no KV pages or slot came free"
            self.counters["bootstrap_failures"] += 1
            return self._fail(p, f"{why} within {self.config.bootstrap_timeout:g}s (--bootstrap-timeout)", "deadline_exceeded")
        return None

    def _register(self, p: _Pending) -> None:
        req = p.req
        self.records.clear(req.slot)
        p.stage = Stage.REGISTERING
        p.call = self.links.pool.submit(
            p.peer.client.register, self.me, req.bootstrap.room, req.rid, req.prompt_len,
            prompt_digest(req.token_ids[: req.prompt_len]), req.pages[req.cached_pages :], req.slot, req.cached_pages,
        )
        p.call.add_done_callback(lambda _: self.wake())

    def _registering(self, p: _Pending, now: float) -> None:
        """The registration's answer: on to TRANSFER; back to PREALLOC, once, for a prefill that
        restarted; or the end."""
        if not p.call.done():
            return None
        peer, room = p.peer, p.req.bootstrap.room
        error = p.call.exception()
        if error is None:
            answer = p.call.result()
            self.links.apply(peer, peer.on_answer(answer["instance"], bool(answer.get("leaving"))))
            p.stage, p.registered_at = Stage.TRANSFER, now
            # Registered, but with a process already gone: _transfer ends it now.
            return self._transfer(p, now) if answer["instance"] != peer.instance else None
        reason = getattr(error, "reason", "")  # set on the bootstrap service's own refusals
        if reason in ("unknown_peer", "leaving"):
            # Refused before anything was registered: no write can come to these pages.
            message = f"{peer} refused bootstrap_room {room}: {error}"
            self.links.apply(peer, peer.on_refused_registration(reason, error.instance, message))
            if reason == "unknown_peer" and not p.retried:  # handshake again and register there, once
                p.stage, p.retried = Stage.PREALLOC, True  # the reserved pages stay with the request
                return self._prealloc(p, now)
            self.counters["bootstrap_failures"] += 1
            return self._fail(p, f"registering bootstrap_room {room} failed: {error}", "unavailable")
        self.counters["bootstrap_failures"] += 1
        code = "failed_precondition" if getattr(error, "conflict", False) else "unavailable"
        return self._abandon(p, f"registering bootstrap_room {room} failed: {error}", code)

    def _transfer(self, p: _Pending, now: float) -> None:
        """Read the arrival record; end the request when its room can no longer deliver."""
        req, peer, room = p.req, p.peer, p.req.bootstrap.room
        record = self.records.read(req.slot)
        if record is not None:
            if record.room != room:
                self.counters["kv_transfer_failures"] += 1
                return self._abandon(p, f"the arrival record for bootstrap_room {record.room} landed where room {room} "
                                     "was expected (wrong room)", "internal")
            return self._arrived(p, record, now)
        if peer.state.void:
            self.counters["kv_transfer_failures"] += 1
            message = f"the KV for bootstrap_room {room} will not arrive: {peer.error}"
            if peer.state is PeerState.GONE:
                return self._fail(p, message, "unavailable")
            return self._abandon(p, message, "unavailable", cancel=False)
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

    def _reserve(self, req: Request, peer: PrefillLink) -> bool:
        """A slot and pages for the prompt, sharing the prefix our cache holds when the prefill can
        leave it out, and leaving the running requests their output headroom."""
        return self.memory.reserve(req, req.prompt_len, reuse_prefix=self._reuses(peer),
                                   keep_pages=self.memory.pages_for(self._reserved_tokens))

    def _reuses(self, peer: PrefillLink) -> bool:
        """Requests for `peer` share the prefix our cache holds (it can leave those pages out)."""
        return self.reuse and peer.skips_pages

    def _arrived(self, p: _Pending, record: ArrivalRecord, now: float) -> None:
        req = p.req
        del self.pending[req.rid]
        arrived = req.pages[req.cached_pages : self.memory.pages_for(req.prompt_len)]  # not the cached prefix
        if p.peer.head_major and not self.layout.replicated:  # on every rank, before any forward pass reads them
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
            self.links.pool.submit(self._cancel, p.peer.client, room, message)
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
            if (state is not None and state.finished) or q.peer.state is PeerState.GONE or overdue:
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
        return self.links.next_heartbeat()

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
        return {"prealloc_queue": len(self.pending) - transfer, "transfer_queue": transfer, **self.counters,
                **self.links.counters}

    def close(self) -> None:
        self.links.close()
