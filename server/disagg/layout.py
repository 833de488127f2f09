"""What a prefill and a decode server must agree on before KV pages can move between them, and
where a page lives in memory. Pure Python: no torch, no Mooncake.

A server's KV pool is one buffer per tensor-parallel rank (`KVBuffer`), each of shape
[num_layers, 2 (K, V), num_pages, page_size, heads, head_dim] over the rank's own KV heads, so
the bytes of (layer, kv, page) start at `base + ((layer * 2 + kv) * num_pages + page) *
part_page_bytes`. Where a prefill and a decode split the heads alike, pages move whole, rank to
rank; where their splits differ (prefill tp 3 -> decode tp 1), they move head-major and the
decode turns them back (`transfer_plan`).
"""

from __future__ import annotations

import zlib
from array import array
from dataclasses import asdict, dataclass


class LayoutMismatch(ValueError):
    """The two sides cannot exchange KV pages; the message names every field that differs."""


@dataclass(frozen=True)
class KVLayout:
    """The whole model's KV pool, whatever the tensor-parallel size of the server holding it."""

    model: str  # architecture and shape fingerprint: the same weights are the operator's promise
    kv_dtype: str
    page_size: int  # tokens per page
    num_layers: int
    num_kv_heads: int  # all of the model's KV heads
    head_dim: int
    page_bytes: int  # bytes of one page of one layer's K (or V, or latent), all heads
    kv_parts: int = 2  # per layer: K and V (2), or one latent row per token (1)
    replicated: bool = False  # every tensor-parallel rank holds every head (a latent pool)

    @property
    def head_bytes(self) -> int:
        """Bytes of one token's K (or V) for one head."""
        return self.page_bytes // (self.page_size * self.num_kv_heads)

    def to_json(self) -> dict:
        return asdict(self)

    @property
    def page_bytes_all_parts(self) -> int:
        """Bytes of one page over every layer and part: what one page of a request moves per copy."""
        return self.kv_parts * self.num_layers * self.page_bytes

    @classmethod
    def from_json(cls, data: dict) -> "KVLayout":
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})

    def check_compatible(self, other: "KVLayout", here: str = "here", there: str = "peer") -> None:
        """Raise LayoutMismatch naming each differing field with both values."""
        diffs = [
            f"{name}: {getattr(self, name)!r} {here}, {getattr(other, name)!r} {there}"
            for name in self.__dataclass_fields__
            if getattr(self, name) != getattr(other, name)
        ]
        if diffs:
            raise LayoutMismatch("KV layouts differ (" + "; ".join(diffs) + ")")


@dataclass(frozen=True)
class KVBuffer:
    """One rank's registered share of a KV pool: heads [first_head, first_head + num_heads) of
    every page, from `base` (page 0 of layer 0's K), reached through Mooncake `session`."""

    base: int
    num_pages: int
    first_head: int
    num_heads: int
    session: str = ""

    @property
    def last_head(self) -> int:
        return self.first_head + self.num_heads

    def page_bytes(self, layout: KVLayout) -> int:
        return layout.page_size * self.num_heads * layout.head_bytes

    def address(self, layout: KVLayout, layer: int, kv: int, page: int) -> int:
        return self.base + ((layer * layout.kv_parts + kv) * self.num_pages + page) * self.page_bytes(layout)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "KVBuffer":
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})


def check_split(layout: KVLayout, parts: list[KVBuffer], where: str) -> None:
    """Raise LayoutMismatch unless `parts` hold every KV head of `layout` once, in order, over the
    same pages (a replicated layout: all of them on every rank): a pool that any other head split
    can exchange pages with."""
    heads = [(p.first_head, p.last_head) for p in parts]
    if layout.replicated:
        if set(heads) != {(0, layout.num_kv_heads)} or len({p.num_pages for p in parts}) != 1:
            raise LayoutMismatch(f"the latent KV pool {where} is split into head ranges {heads} over "
                                 f"{[p.num_pages for p in parts]} pages: every rank must hold it whole, over the "
                                 "same pages")
        return
    expected = 0
    for first, last in heads:
        if first != expected or last <= first:
            break
        expected = last
    if expected != layout.num_kv_heads or len({p.num_pages for p in parts}) != 1:
        raise LayoutMismatch(f"the KV pool {where} is split into head ranges {heads} over "
                             f"{[p.num_pages for p in parts]} pages: it must hold each of the model's "
                             f"{layout.num_kv_heads} KV heads exactly once, over the same pages on every rank")


def page_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """Split a page-to-page copy into runs (src_start, dst_start, count) where both sides are
    consecutive: each run is one write per layer and K/V instead of one per page."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source pages for {len(dst)} destination pages")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def write_list(
    layout: KVLayout, src: KVBuffer, dst: KVBuffer, src_pages: list[int], dst_pages: list[int]
) -> tuple[list[int], list[int], list[int]]:
    """Source addresses, destination addresses and lengths for copying `src_pages` onto
    `dst_pages` in every layer's K and V, between two buffers holding the same heads: one entry
    per (run of pages, layer, K|V)."""
    assert (src.first_head, src.num_heads) == (dst.first_head, dst.num_heads), "whole pages need the same heads"
    srcs, dsts, lens = [], [], []
    for s, d, n in page_runs(src_pages, dst_pages):
        for layer in range(layout.num_layers):
            for kv in range(layout.kv_parts):
                srcs.append(src.address(layout, layer, kv, s))
                dsts.append(dst.address(layout, layer, kv, d))
                lens.append(n * src.page_bytes(layout))
    return srcs, dsts, lens


@dataclass(frozen=True)
class Packed:
    """A write whose source is packed first: heads [first, last) of the source buffer (counted
    from its first head), of the source pages that go to each run of consecutive destination
    pages (`runs`). Chunk i of the write, for (run, layer, K|V) in that order, is that run's
    pages of that layer's K or V laid out head-major, [heads, pages, page_size, head_dim]."""

    first: int
    last: int
    runs: list[list[int]]  # source pages, grouped by the destination run they go to


def destination_runs(pages: list[int]) -> list[tuple[int, int]]:
    """(start, count) of each run of consecutive pages, in order."""
    runs: list[tuple[int, int]] = []
    for page in pages:
        if runs and runs[-1][0] + runs[-1][1] == page:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((page, 1))
    return runs


@dataclass
class Writes:
    """The writes one source rank makes to one destination buffer."""

    session: str  # the destination's Mooncake session
    srcs: list[int]  # empty when `packed`: the packer knows where it put each chunk
    dsts: list[int]
    lens: list[int]
    packed: Packed | None = None


def same_split(a: list[KVBuffer], b: list[KVBuffer]) -> bool:
    """Both pools split the heads the same way: pages can move whole, rank to rank."""
    return [(p.first_head, p.num_heads) for p in a] == [(p.first_head, p.num_heads) for p in b]


def transfer_plan(layout: KVLayout, sources: list[KVBuffer], dests: list[KVBuffer], src_pages: list[int],
                  dst_pages: list[int]) -> list[list[Writes]]:
    """For each source rank (in order), its writes to every destination rank it shares heads
    with: together they copy every head of `src_pages` onto `dst_pages`.

    Where both pools split the heads alike, pages move whole. Where they differ, the data of
    each run of consecutive destination pages travels head-major, [heads, pages, page_size,
    head_dim] per layer and K|V: each source rank packs the heads a destination rank shares with
    it into one contiguous chunk per (run, layer, K|V), at that heads' place in the run, and the
    destination turns the run back token-major on arrival (`tandem.server.disagg.transfer.
    token_major`). Token by token, a 1,200-token prompt took ~200,000 writes; this way, 60 per
    pair of ranks when the destination pages are consecutive."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages for {len(dst_pages)} destination pages")
    if layout.replicated:  # every rank holds it all: the first source rank sends, once to each destination
        first = [Writes(dst.session, *write_list(layout, sources[0], dst, src_pages, dst_pages)) for dst in dests]
        return [first] + [[] for _ in sources[1:]]
    if same_split(sources, dests):
        return [[Writes(dst.session, *write_list(layout, src, dst, src_pages, dst_pages))]
                for src, dst in zip(sources, dests)]
    head_page = layout.page_size * layout.head_bytes  # one head of one page
    runs, groups, at = destination_runs(dst_pages), [], 0
    for _, count in runs:
        groups.append(list(src_pages[at : at + count]))
        at += count
    plan = []
    for src in sources:
        writes = []
        for dst in dests:
            first, last = max(src.first_head, dst.first_head), min(src.last_head, dst.last_head)
            if first >= last:
                continue
            dsts, lens = [], []
            for start, count in runs:
                for layer in range(layout.num_layers):
                    for kv in range(layout.kv_parts):
                        dsts.append(dst.address(layout, layer, kv, start) + (first - dst.first_head) * count * head_page)
                        lens.append((last - first) * count * head_page)
            packed = Packed(first - src.first_head, last - src.first_head, groups)
            writes.append(Writes(dst.session, [], dsts, lens, packed))
        plan.append(writes)
    return plan


def prompt_digest(token_ids: list[int]) -> int:
    """A cheap fingerprint of a prompt, so both legs can tell they hold the same request."""
    return zlib.crc32(array("q", token_ids).tobytes())
