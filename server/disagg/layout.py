"""What a prefill and a decode server must agree on before KV pages can move between them, and
where a page lives in memory. Pure Python: no torch, no Mooncake.

Both KV pools are one contiguous buffer of shape [num_layers, 2 (K, V), num_pages, page_size,
num_kv_heads, head_dim], so the bytes of (layer, kv, page) start at
`base + ((layer * 2 + kv) * num_pages + page) * page_bytes`.
"""

from __future__ import annotations

import zlib
from array import array
from dataclasses import asdict, dataclass


class LayoutMismatch(ValueError):
    """The two sides cannot exchange KV pages; the message names every field that differs."""


@dataclass(frozen=True)
class KVLayout:
    model: str  # architecture and shape fingerprint: the same weights are the operator's promise
    kv_dtype: str
    page_size: int  # tokens per page
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_bytes: int  # bytes of one page of one layer's K (or V)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "KVLayout":
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})

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
    """One side's registered KV pool: where page 0 of layer 0's K starts and how many pages."""

    base: int
    num_pages: int

    def address(self, layout: KVLayout, layer: int, kv: int, page: int) -> int:
        return self.base + ((layer * 2 + kv) * self.num_pages + page) * layout.page_bytes


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
    `dst_pages` in every layer's K and V, one entry per (run, layer, K|V)."""
    srcs, dsts, lens = [], [], []
    for s, d, n in page_runs(src_pages, dst_pages):
        for layer in range(layout.num_layers):
            for kv in (0, 1):
                srcs.append(src.address(layout, layer, kv, s))
                dsts.append(dst.address(layout, layer, kv, d))
                lens.append(n * layout.page_bytes)
    return srcs, dsts, lens


def prompt_digest(token_ids: list[int]) -> int:
    """A cheap fingerprint of a prompt, so both legs can tell they hold the same request."""
    return zlib.crc32(array("q", token_ids).tobytes())
