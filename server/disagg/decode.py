"""DecodeConnector: a decode server's side of disaggregation.

A request's life on a decode (`Stage`, one class each, in its own module):

    PREALLOC     wait for the handshake with the prefill process at the request's bootstrap
                 address (once per process, `decode_peers.py`), then for a slot and pages for the
                 prompt past the prefix this server's cache holds (decode_prealloc.py)
    REGISTERING  register them under the room; a prefill that restarted (it does not know this
                 decode) gets the request again after a new handshake, once (decode_register.py)
    TRANSFER     poll the request's arrival record (the prefill writes it after the KV) and the
                 room's state on the prefill (decode_transfer.py)
    arrived      the scheduler's running batch, with the first token, without a forward pass
                 over the prompt

Each stage answers with what came of the request (decode_stages.py); this connector applies it.
A request ends early in one of two ways (`End`). Failed: no live prefill will write its pages
(never registered, the room failed on the prefill, the process is GONE), so they are free at once.
Abandoned (an abort or a timeout after registration, a LOST peer, an unknown room, a wrong
arrival record): a live prefill may still write them, so they stay quarantined (`_Quarantined`,
this connector's) until the prefill reports the room finished (done, failed, unknown), or its peer
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

import logging
import time
from dataclasses import dataclass
from typing import Callable

from tandem.kernels.kv_cache import PagedKVCache
from tandem.server.config import DisaggConfig
from tandem.server.disagg.bootstrap import BootstrapClient
from tandem.server.disagg.connector import ConnectorEvents, KVConnector, OtherRanks, own_part
from tandem.server.disagg.decode_links import PrefillLink, PrefillLinks
from tandem.server.disagg.decode_peers import PeerState
from tandem.server.disagg.decode_prealloc import DecodePrealloc
from tandem.server.disagg.decode_register import DecodeRegister
from tandem.server.disagg.decode_stages import End, Pending, Stage
from tandem.server.disagg.decode_transfer import DecodeTransfer
from tandem.server.disagg.layout import KVLayout
from tandem.server.disagg.prefill_rooms import new_instance_id
from tandem.server.disagg.transfer import ArrivalRecord, MooncakeTransfer, RecordBuffer
from tandem.server.scheduling.memory import KVMemory
from tandem.server.scheduling.request import Request
from tandem.server.scheduling.sampling_params import InvalidRequestError

log = logging.getLogger("tandem.decode")

ARRIVAL_POLL_S = 0.002  # arrival records are polled, not announced


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
        self.config, self.layout, self.memory = config, layout, memory
        self.transfer = MooncakeTransfer(advertise_host, config.kv_transfer_protocol, config.ib_device)
        # One buffer per tensor-parallel rank: each prefill rank writes its heads into whichever holds them.
        self.parts = [own_part(self.transfer, kv_cache)] + (ranks.parts if ranks is not None else [])
        self.kv_heads = [[p.first_head, p.num_heads] for p in self.parts]
        self.records = RecordBuffer(memory.slots.num_slots)  # request slot i receives its record in slot i
        self.transfer.register(self.records.tensor)
        # Who we are to the prefills: a stable name (a successor at the same address replaces us)
        # and this process's instance.
        self.me = {"decode": name or self.transfer.session, "decode_instance": new_instance_id()}
        self.links = PrefillLinks(config, self.me, self._handshake, self.kv_heads, wake)
        # What arrives per page: a copy on each rank of a replicated (latent) pool, else each head once
        self.kv_bytes_per_page = layout.page_bytes_all_parts * (len(self.parts) if layout.replicated else 1)
        self.prealloc = DecodePrealloc(config, memory, self.links, reuse=not config.disable_decode_prefix_reuse)
        self.registering = DecodeRegister(self.me, self.records, self.links, wake)
        self.transferring = DecodeTransfer(config, layout, self.records, kv_cache.buffer, ranks, memory,
                                           self.kv_bytes_per_page, self.prealloc.reuses, on_transfer)
        self._stages = {Stage.PREALLOC: self.prealloc.advance, Stage.REGISTERING: self.registering.advance,
                        Stage.TRANSFER: self.transferring.advance}
        self.pending: dict[str, Pending] = {}
        self.quarantine: list[_Quarantined] = []
        self._events = ConnectorEvents()  # what the current poll hands the loop
        self.counters = {"kv_transfer_failures": 0, "bootstrap_failures": 0}
        log.info("decode KV connector: %s (instance %s), Mooncake session %s (%s)", self.me["decode"],
                 self.me["decode_instance"], self.transfer.session, config.kv_transfer_protocol)

    def check_request(self, req: Request) -> None:
        if req.bootstrap is None:
            raise InvalidRequestError(
                "disaggregated_params", "required on a decode server (bootstrap_host, bootstrap_port, bootstrap_room; the router sets them)"
            )

    def add(self, req: Request) -> None:
        self.pending[req.rid] = self.prealloc.start(req)

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
        now, self._events = time.monotonic(), ConnectorEvents()
        self.prealloc.reserved_tokens = reserved_tokens  # what admission leaves the running requests
        retired = [p.peer for p in self.pending.values()] + [q.peer for q in self.quarantine]
        self.links.update(now, retired, self._rooms_waiting_on)
        for p in list(self.pending.values()):
            self._advance(p, now)
        self._release_quarantined(now)
        return self._events

    def _advance(self, p: Pending, now: float) -> None:
        """Move one request along its stages (the module doc) while they say go on: into the events
        once it arrived or ended."""
        answer = self._stages[p.stage](p, now)
        while isinstance(answer, Stage):
            answer = self._stages[answer](p, now)
        if isinstance(answer, ArrivalRecord):
            self._arrived(p, answer)
        elif isinstance(answer, End):
            self._end(p, answer)

    def _arrived(self, p: Pending, record: ArrivalRecord) -> None:
        del self.pending[p.req.rid]
        self._events.arrived.append((p.req, record.first_token))
        self.prealloc.joined(p.req)

    def _end(self, p: Pending, end: End) -> None:
        """End a request early: its pages free at once, or quarantined while a live prefill may
        still write them."""
        if end.counter is not None:
            self.counters[end.counter] += 1
        req = self._quarantine(p) if end.quarantine else self._drop(p)
        if end.cancel:
            self.links.cancel(p.peer, req.bootstrap.room, end.message)
        self._events.end(req, end.message, end.code)

    def _drop(self, p: Pending) -> Request:
        del self.pending[p.req.rid]
        self.memory.release(p.req)
        return p.req

    def _quarantine(self, p: Pending) -> Request:
        """Keep the request's pages until the prefill says its room is finished or is proven gone."""
        del self.pending[p.req.rid]
        self.quarantine.append(_Quarantined(p.req, p.peer, p.req.bootstrap.room, time.monotonic()))
        return p.req

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
        if p.stage is Stage.PREALLOC:
            return self._drop(p)
        req = self._quarantine(p)
        self.links.cancel(p.peer, req.bootstrap.room, message)
        return req

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
                **self.transferring.counters, **self.links.counters}

    def close(self) -> None:
        self.links.close()
