"""PREALLOC, a decode request's first stage (decode.py's doc has its whole life): wait for the
handshake with the prefill process at the request's bootstrap address, then for a slot and pages
for the prompt past the prefix this server's cache holds.

Ownership: the reservation pins the cached prefix (the prefix cache's pages: no transfer writes
them); the pages after it are the request's, held by the connector from here on.
"""

from __future__ import annotations

from tandem.server.config import DisaggConfig
from tandem.server.disagg.connector import deadline
from tandem.server.disagg.decode_links import PrefillLink, PrefillLinks
from tandem.server.disagg.decode_peers import PeerState
from tandem.server.disagg.decode_stages import End, Pending, Stage
from tandem.server.scheduling.memory import KVMemory
from tandem.server.scheduling.request import Request


class DecodePrealloc:
    """Which registration a new request goes through, and how much KV admission may take: the
    prefix the cache holds is shared when the prefill can leave it out (`reuse`), and the running
    requests keep their output headroom."""

    def __init__(self, config: DisaggConfig, memory: KVMemory, links: PrefillLinks, reuse: bool):
        self.memory, self.links, self.reuse = memory, links, reuse
        self.bootstrap_timeout = config.bootstrap_timeout
        self.reserved_tokens = 0  # KV the running requests keep for their output, set at each poll

    def start(self, req: Request) -> Pending:
        """A new request: it waits for the registration at its bootstrap address until --bootstrap-timeout."""
        return Pending(req, self.links.for_room(req.bootstrap.address), deadline(self.bootstrap_timeout))

    def joined(self, req: Request) -> None:
        """`req`'s KV arrived: it joins the running batch after this poll. Until the next one counts
        it at the scheduler's ratio, reserve its whole output budget."""
        self.reserved_tokens += req.max_new_tokens - 1

    def advance(self, p: Pending, now: float) -> Stage | End | None:
        """Wait for the handshake, then for a slot and pages; then on to REGISTERING."""
        if p.peer.state.retired:  # not registered yet: use the address's current registration
            p.peer = self.links.for_room(p.peer.address)
        req, peer = p.req, p.peer
        if peer.state is PeerState.FAILED:  # end the prefill leg now, if it can hear
            return End.failed(peer.error, peer.code, "bootstrap_failures", cancel=True)
        if peer.state is PeerState.READY and req.cached_pages and not peer.skips_pages:
            self.memory.release(req)  # reserved for a prefill replaced by one that sends whole prompts
        if peer.state is PeerState.READY and (req.slot is not None or self._reserve(req, peer)):
            p.stage = Stage.REGISTERING
            return p.stage
        if now > p.due:
            why = "the handshake with the prefill did not finish" if peer.state is not PeerState.READY else "no KV pages or slot came free"
            return End.failed(f"{why} within {self.bootstrap_timeout:g}s (--bootstrap-timeout)", "deadline_exceeded",
                              "bootstrap_failures")
        return None

    def reuses(self, peer: PrefillLink) -> bool:
        """Whether a request for `peer` shares the prefix our cache holds (the prefill leaves it out)."""
        return self.reuse and peer.skips_pages

    def _reserve(self, req: Request, peer: PrefillLink) -> bool:
        """A slot and pages for the prompt, sharing the prefix our cache holds when the prefill can
        leave it out, and leaving the running requests their output headroom."""
        return self.memory.reserve(req, req.prompt_len, reuse_prefix=self.reuses(peer),
                                   keep_pages=self.memory.pages_for(self.reserved_tokens))
