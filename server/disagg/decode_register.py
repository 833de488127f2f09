"""REGISTERING, a decode request's second stage (decode.py's doc has its whole life): register
the request's pages past its cached prefix, and its arrival-record slot, under its room on the
prefill. A prefill that restarted (it does not know this decode) gets the request again after a
new handshake, once.

Ownership: from the call on, the prefill may write the registered pages and the record slot; a
request that ends here after the call is abandoned (its pages quarantined), unless the prefill
refused it before registering anything.
"""

from __future__ import annotations

from typing import Callable

from tandem.server.disagg.decode_links import PrefillLinks
from tandem.server.disagg.decode_stages import End, Pending, Stage
from tandem.server.disagg.layout import prompt_digest
from tandem.server.disagg.transfer import RecordBuffer


class DecodeRegister:
    """The registration calls. `me`: who this decode is to the prefills; `records`: the arrival
    records, request slot i's in slot i (cleared before each registration)."""

    def __init__(self, me: dict, records: RecordBuffer, links: PrefillLinks, wake: Callable[[], None]):
        self.me, self.records, self.links, self.wake = me, records, links, wake

    def advance(self, p: Pending, now: float) -> Stage | End | None:
        """Make the call; then take its answer: on to TRANSFER; back to PREALLOC, once, for a
        prefill that restarted; or the end."""
        if p.call is None:
            self._call(p)
            return None
        if not p.call.done():
            return None
        peer, room = p.peer, p.req.bootstrap.room
        error = p.call.exception()
        if error is None:
            answer = p.call.result()
            self.links.apply(peer, peer.on_answer(answer["instance"], bool(answer.get("leaving"))))
            p.stage, p.registered_at = Stage.TRANSFER, now
            # Registered, but with a process already gone: the TRANSFER stage ends it now.
            return p.stage if answer["instance"] != peer.instance else None
        reason = getattr(error, "reason", "")  # set on the bootstrap service's own refusals
        if reason in ("unknown_peer", "leaving"):
            # Refused before anything was registered: no write can come to these pages.
            message = f"{peer} refused bootstrap_room {room}: {error}"
            self.links.apply(peer, peer.on_refused_registration(reason, error.instance, message))
            if reason == "unknown_peer" and not p.retried:  # handshake again and register there, once
                p.stage, p.retried, p.call = Stage.PREALLOC, True, None  # the reserved pages stay with the request
                return p.stage
            return End.failed(f"registering bootstrap_room {room} failed: {error}", "unavailable", "bootstrap_failures")
        code = "failed_precondition" if getattr(error, "conflict", False) else "unavailable"
        return End.abandoned(f"registering bootstrap_room {room} failed: {error}", code, "bootstrap_failures")

    def _call(self, p: Pending) -> None:
        req = p.req
        self.records.clear(req.slot)
        p.call = self.links.pool.submit(
            p.peer.client.register, self.me, req.bootstrap.room, req.rid, req.prompt_len,
            prompt_digest(req.token_ids[: req.prompt_len]), req.pages[req.cached_pages :], req.slot, req.cached_pages,
        )
        p.call.add_done_callback(lambda _: self.wake())
