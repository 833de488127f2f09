"""A request held by a decode's connector: its stage, its record, and how a stage answers.

Each stage (decode_prealloc.py, decode_register.py, decode_transfer.py) advances a `Pending`
request and answers with what came of it: None (it waits where `stage` now says), the `Stage`
to advance it in at once, an `End`, or (decode_transfer.py) the arrival record. The connector
(decode.py) applies the answer: it owns the pending requests, how they end, and the quarantine.
"""

from __future__ import annotations

import enum
from concurrent.futures import Future
from dataclasses import dataclass

from tandem.server.disagg.decode_links import PrefillLink
from tandem.server.scheduling.request import Request


class Stage(enum.Enum):
    PREALLOC = "prealloc"  # waiting for the handshake, a slot and pages
    REGISTERING = "registering"  # registering the pages under the request's room
    TRANSFER = "transfer"  # waiting for the KV and the arrival record


@dataclass
class Pending:
    req: Request
    peer: PrefillLink
    due: float  # prealloc: the bootstrap deadline
    stage: Stage = Stage.PREALLOC
    call: Future | None = None  # the registration call (None: not made yet in this stage)
    registered_at: float = 0.0
    retried: bool = False  # a registration refused by a restarted prefill is retried once


@dataclass(frozen=True)
class End:
    """How a request ends early (decode.py's doc): its stream ends with `message` and `code`."""

    message: str
    code: str | None
    counter: str | None = None  # the failure counter it counts in, if any
    quarantine: bool = False  # abandoned: a live prefill may still write its pages
    cancel: bool = False  # ask the prefill to end the room (if it can hear), with `message`

    @classmethod
    def failed(cls, message: str, code: str | None, counter: str | None = None, cancel: bool = False) -> End:
        """No live prefill will write the request's pages: they are free at once."""
        return cls(message, code, counter, quarantine=False, cancel=cancel)

    @classmethod
    def abandoned(cls, message: str, code: str | None, counter: str | None = None, cancel: bool = True) -> End:
        """A live prefill may still write the request's pages: they stay quarantined."""
        return cls(message, code, counter, quarantine=True, cancel=cancel)
