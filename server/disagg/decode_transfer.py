"""TRANSFER, a decode request's last stage (decode.py's doc has its whole life): poll the
request's arrival record (the prefill writes it after the KV) and the room's state on the
prefill, until the KV is in place or the room can no longer deliver it.

Ownership: the pages being written are the request's, held by the connector; once the record is
read they are final, and turned token-major (on every rank) before any forward pass reads them.
"""

from __future__ import annotations

from typing import Callable

import torch

from tandem.server.config import DisaggConfig
from tandem.server.disagg.connector import OtherRanks
from tandem.server.disagg.decode_links import PrefillLink
from tandem.server.disagg.decode_peers import PeerState
from tandem.server.disagg.decode_stages import End, Pending
from tandem.server.disagg.layout import KVLayout
from tandem.server.disagg.prefill_rooms import RoomState
from tandem.server.disagg.transfer import ArrivalRecord, RecordBuffer, token_major
from tandem.server.scheduling.memory import KVMemory


class DecodeTransfer:
    """The arrival records (`records`, request slot i's in slot i) and the KV that lands: in rank
    0's `buffer` and the other `ranks`' (`memory` says which pages a request holds).
    `kv_bytes_per_page`: what arrives per page; `reuses(peer)`: whether a request for that prefill
    looked its prompt up in the prefix cache; `on_transfer`: the seconds one request's KV took to move."""

    def __init__(self, config: DisaggConfig, layout: KVLayout, records: RecordBuffer, buffer: torch.Tensor,
                 ranks: OtherRanks | None, memory: KVMemory, kv_bytes_per_page: int,
                 reuses: Callable[[PrefillLink], bool], on_transfer: Callable[[float], None]):
        self.config, self.layout, self.records, self.buffer, self.ranks = config, layout, records, buffer, ranks
        self.memory, self.kv_bytes_per_page, self.reuses, self.on_transfer = memory, kv_bytes_per_page, reuses, on_transfer
        self.counters = {"kv_transfer_bytes": 0, "kv_transfer_skipped_bytes": 0, "decode_prefix_query_tokens": 0,
                         "decode_prefix_hit_tokens": 0}

    def advance(self, p: Pending, now: float) -> ArrivalRecord | End | None:
        """Read the arrival record (the request's KV is then in place); end the request when its
        room can no longer deliver."""
        req, peer, room = p.req, p.peer, p.req.bootstrap.room
        record = self.records.read(req.slot)
        if record is not None:
            if record.room != room:
                return End.abandoned(f"the arrival record for bootstrap_room {record.room} landed where room {room} "
                                     "was expected (wrong room)", "internal", "kv_transfer_failures")
            self._arrived(p, record, now)
            return record
        if peer.state.void:
            message = f"the KV for bootstrap_room {room} will not arrive: {peer.error}"
            if peer.state is PeerState.GONE:
                return End.failed(message, "unavailable", "kv_transfer_failures")
            return End.abandoned(message, "unavailable", "kv_transfer_failures", cancel=False)
        status = peer.statuses.get(room, {})
        state = status.get("state")
        if state is RoomState.FAILED:
            counter = "bootstrap_failures" if status["code"] == "deadline_exceeded" else "kv_transfer_failures"
            return End.failed(f"prefill {peer.client.address}: {status['message']}", status["code"] or "aborted", counter)
        if state is RoomState.UNKNOWN:
            return End.abandoned(f"{peer} no longer knows bootstrap_room {room}", "unavailable")
        if state is RoomState.REGISTERED and now - p.registered_at > self.config.bootstrap_timeout + 1.0:
            return End.abandoned(f"no prefill request arrived for bootstrap_room {room} within "
                                 f"{self.config.bootstrap_timeout:g}s (--bootstrap-timeout)", "deadline_exceeded",
                                 "bootstrap_failures")
        if now - p.registered_at > self.config.transfer_timeout:
            return End.abandoned(f"the KV for bootstrap_room {room} did not arrive within "
                                 f"{self.config.transfer_timeout:g}s (--transfer-timeout)", "deadline_exceeded",
                                 "kv_transfer_failures")
        return None

    def _arrived(self, p: Pending, record: ArrivalRecord, now: float) -> None:
        """The KV is in place: make it readable, give the request what the record carries, count it."""
        req = p.req
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
        if self.reuses(p.peer):  # its prompt was looked up in the prefix cache
            self.counters["decode_prefix_query_tokens"] += req.prompt_len
            self.counters["decode_prefix_hit_tokens"] += req.cached_pages * self.memory.page_size
        self.on_transfer(now - p.registered_at)
