"""PrefillConnector: a prefill server's side of disaggregation.

Request path: bootstrap queue (until the decode has registered its destination pages for the
request's room) -> the scheduler (waiting, forward pass, exactly one sampled token: the request
ends there and its gRPC stream closes) -> inflight (its pages are written to the decode with
Mooncake, but for the leading ones the decode said it holds already, then the arrival record)
-> done (pages released; the prompt stays in the prefix cache).

Ownership: every request that ends in the scheduler comes to this connector with what it holds
(`takes_finished`); one whose room is still queued goes inflight: its slot and pages belong to
this connector, nothing writes them (the prompt's KV is final), and they are released only when
the write has ended. The others fail their room and are released at once.

Leaving (SIGTERM): the bootstrap service refuses new decode peers and unclaimed rooms, the
requests already here finish and their KV is sent, and the server waits (at most one
`--peer-heartbeat-interval` and a second) until every registered decode has heard that it is
leaving. The bootstrap service closes only after the last write: a decode that finds nothing
listening knows no write to its pages can still come.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable

import torch

from tandem.kernels.kv_cache import PagedKVCache
from tandem.server.config import DisaggConfig
from tandem.server.disagg.bootstrap import BootstrapService, is_loopback
from tandem.server.disagg.connector import ConnectorEvents, KVConnector, OtherRanks, deadline, own_part
from tandem.server.disagg.layout import KVLayout, Writes, prompt_digest, transfer_plan
from tandem.server.disagg.prefill_rooms import PrefillRoomTable, RoomState
from tandem.server.disagg.transfer import RECORD_BYTES, ArrivalRecord, MooncakeTransfer, RecordBuffer
from tandem.server.scheduling.memory import KVMemory
from tandem.server.scheduling.request import Request
from tandem.server.scheduling.sampling_params import InvalidRequestError

log = logging.getLogger("tandem.prefill")

EXPIRY_INTERVAL_S = 0.25  # how often rooms whose prefill leg never came are looked for


@dataclass
class _Send:
    req: Request
    future: Future  # -> seconds the write took
    nbytes: int


class PrefillConnector(KVConnector):
    role = "prefill"
    takes_finished = True  # their KV goes to the decode
    max_new_tokens = 1  # the first output token goes to the decode with the KV

    def __init__(self, config: DisaggConfig, listen_host: str, advertise_host: str, layout: KVLayout,
                 kv_cache: PagedKVCache, memory: KVMemory, wake: Callable[[], None],
                 on_transfer: Callable[[float], None] = lambda seconds: None, ranks: OtherRanks | None = None):
        super().__init__(on_transfer)
        self.config, self.layout, self.memory, self.wake, self.ranks = config, layout, memory, wake, ranks
        self.device = kv_cache.device
        self.transfer = MooncakeTransfer(advertise_host, config.kv_transfer_protocol, config.ib_device)
        self.buffer = kv_cache.buffer
        self.parts = [own_part(self.transfer, kv_cache)] + (ranks.parts if ranks is not None else [])
        self.records = RecordBuffer(memory.slots.num_slots)  # staging: one record per request slot
        self.transfer.register(self.records.tensor)
        self.table = PrefillRoomTable(layout, self.transfer.session, wake, [(p.first_head, p.num_heads) for p in self.parts])
        tokens = config.bootstrap_tokens()
        self.service = BootstrapService(self.table, listen_host, config.bootstrap_port, tokens)
        if not tokens and not is_loopback(listen_host):
            log.warning("the bootstrap service on %s:%d accepts any caller: whoever reaches it can register as a "
                        "decode and be sent prompts' KV; give both roles --bootstrap-token-file", listen_host,
                        config.bootstrap_port)
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tandem-kv-send")
        self.waiting_for_peer: dict[str, tuple[Request, float]] = {}  # the bootstrap queue: rid -> (req, deadline)
        self.scheduled: dict[str, Request] = {}  # handed to the scheduler, not yet ended
        self.inflight: dict[str, _Send] = {}
        self.counters = {"kv_transfer_bytes": 0, "kv_transfer_failures": 0, "bootstrap_failures": 0}
        self._next_expiry = 0.0
        self._leave_deadline: float | None = None
        log.info("bootstrap service on %s:%d (instance %s), Mooncake session %s (%s)", listen_host, config.bootstrap_port,
                 self.table.instance, self.transfer.session, config.kv_transfer_protocol)

    def check_request(self, req: Request) -> None:
        if req.bootstrap is None:
            raise InvalidRequestError(
                "disaggregated_params", "required on a prefill server (bootstrap_host, bootstrap_port, bootstrap_room; the router sets them)"
            )

    def add(self, req: Request) -> None:
        self.table.claim(req.bootstrap.room, req.rid, req.prompt_len, prompt_digest(req.token_ids[: req.prompt_len]))
        self.waiting_for_peer[req.rid] = (req, deadline(self.config.bootstrap_timeout))

    def poll(self, finished: list[Request], reserved_tokens: int) -> ConnectorEvents:
        now, events = time.monotonic(), ConnectorEvents()
        if finished:
            if self.device.type == "cuda":  # the forward pass that wrote their pages must be done
                torch.cuda.current_stream(self.device).synchronize()
            for req in finished:
                self._send(req)
        if now >= self._next_expiry:  # a sweep over every room: not on every step
            self._next_expiry = now + EXPIRY_INTERVAL_S
            self.table.expire(now, self.config.bootstrap_timeout)
        for rid, (req, due) in list(self.waiting_for_peer.items()):
            room = self.table.get(req.bootstrap.room)
            if room.state is RoomState.FAILED:
                del self.waiting_for_peer[rid]
                self.counters["bootstrap_failures"] += 1
                events.end(req, room.message, room.code)
            elif room.state is RoomState.QUEUED:
                del self.waiting_for_peer[rid]
                self.scheduled[rid] = req
                events.admit.append(req)
            elif now > due:
                del self.waiting_for_peer[rid]
                message = (f"no decode server registered bootstrap_room {req.bootstrap.room} within "
                           f"{self.config.bootstrap_timeout:g}s (--bootstrap-timeout)")
                self.table.set_state(req.bootstrap.room, RoomState.FAILED, message, "deadline_exceeded")
                self.counters["bootstrap_failures"] += 1
                events.end(req, message, "deadline_exceeded")
        for rid, req in self.scheduled.items():  # the decode side gave up: stop computing
            room = self.table.get(req.bootstrap.room)
            if room is not None and room.state is RoomState.FAILED:
                events.aborts.append((rid, room.message, room.code))
        for rid, send in list(self.inflight.items()):
            if send.future.done():
                del self.inflight[rid]
                self._sent(send)
        return events

    def _send(self, req: Request) -> None:
        """A request that ended in the scheduler: write its KV and arrival record to the decode,
        or, when its room can take no write (aborted, cancelled, failed), fail the room and free it."""
        self.scheduled.pop(req.rid, None)
        reg = None if req.finish.reason == "abort" else self.table.start_transfer(req.bootstrap.room)
        if reg is None:
            message = f"the prefill request ended before its KV was sent: {req.finish.message or req.finish.reason}"
            self.table.set_state(req.bootstrap.room, RoomState.FAILED, message, req.finish.code or "aborted")
            self.memory.release(req)
            return
        need = -(-req.prompt_len // self.layout.page_size)
        # The decode's prefix cache holds the first `skip_pages`: only the rest moves.
        plan = transfer_plan(self.layout, self.parts, list(reg.peer.parts), req.pages[reg.skip_pages : need], reg.pages)
        logprob = req.output_logprobs[0] if req.output_logprobs else 0.0
        self.records.write(req.slot, ArrivalRecord(req.bootstrap.room, req.token_ids[req.prompt_len], req.num_cached_prompt, logprob))
        record = (self.records.address(req.slot), reg.peer.record_base + reg.record_slot * RECORD_BYTES)
        future = self.pool.submit(self._write, plan, reg.peer.session, record)
        future.add_done_callback(lambda _: self.wake())
        self.inflight[req.rid] = _Send(req, future, sum(sum(w.lens) for writes in plan for w in writes))

    def _write(self, plan: list[list[Writes]], session: str, record: tuple[int, int]) -> float:
        """On a sender thread: every rank's heads of the KV pages (rank 0's here, the others' by
        their own engines), then (only once they are all written) the record to the decode's
        rank 0 at `session`. Returns the seconds the writes took."""
        start = time.perf_counter()
        others = [self.ranks.write(rank, writes) for rank, writes in enumerate(plan) if rank and writes]
        try:
            self.transfer.send(self.buffer, plan[0])
        finally:  # the pages stay ours until no rank reads them any more, whatever failed
            wait(others)
        for future in others:
            future.result()
        self.transfer.write(session, [record[0]], [record[1]], [RECORD_BYTES])
        return time.perf_counter() - start

    def _sent(self, send: _Send) -> None:
        req = send.req
        self.memory.release(req)
        error = send.future.exception()
        if error is None:
            self.counters["kv_transfer_bytes"] += send.nbytes
            self.on_transfer(send.future.result())
            self.table.set_state(req.bootstrap.room, RoomState.DONE)
        else:
            log.warning("KV transfer for %s (room %d) failed: %s", req.rid, req.bootstrap.room, error)
            self.counters["kv_transfer_failures"] += 1
            self.table.set_state(req.bootstrap.room, RoomState.FAILED, f"KV transfer failed: {error}", "unavailable")

    def abort(self, rid: str, message: str) -> Request | None:
        entry = self.waiting_for_peer.pop(rid, None)
        if entry is None:
            return None  # inflight requests already ended for their caller; the write finishes
        req = entry[0]
        self.table.set_state(req.bootstrap.room, RoomState.FAILED, f"the prefill request was aborted: {message}", "aborted")
        return req

    def has_work(self) -> bool:
        return bool(self.waiting_for_peer or self.inflight)

    def drain(self) -> None:
        self.table.leave()
        self._leave_deadline = time.monotonic() + self.config.peer_heartbeat_interval + 1.0

    def drained(self) -> bool:
        if self.waiting_for_peer or self.scheduled or self.inflight:
            return False
        unnotified = self.table.unnotified()
        if unnotified and time.monotonic() < self._leave_deadline:
            return False
        if unnotified:
            log.info("leaving without telling %s (no call from them)", ", ".join(unnotified))
        return True

    def idle_wait(self) -> float | None:
        # Registrations and finished sends wake the loop; this is for deadlines, including those
        # of rooms a decode registered for a prefill request that never comes.
        return 0.05 if self.has_work() else 0.5

    def held(self) -> list[Request]:
        return [s.req for s in self.inflight.values()]

    def stats(self) -> dict[str, int]:
        return {"bootstrap_queue": len(self.waiting_for_peer), "inflight_queue": len(self.inflight), **self.counters,
                **self.table.counters, "bootstrap_refused": self.table.refusals()}

    def close(self) -> None:
        self.pool.shutdown(wait=True)  # the last write ends before the address goes quiet
        self.service.close()
