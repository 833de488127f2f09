"""The attention interface every backend implements, and the batch layout it receives.

A forward pass runs a ragged batch: sequence i contributes `q_lens[i]` new tokens (rows
`[qo_indptr[i], qo_indptr[i+1])` of q/k/v) whose positions continue its `kv_lens[i] - q_lens[i]`
tokens already in the paged KV cache. Prompt pieces ("extends") come first, one-token decodes
last. Causality is bottom-right aligned: new token j of sequence i sees KV positions
`[0, kv_lens[i] - q_lens[i] + j]`. A sliding-window layer (Gemma 3's local layers) narrows that
to the last `window` of them: `[p - window + 1, p]` for a token at position p, as HF transformers
masks it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from tandem.kernels.kv_cache import PagedKVCache


@dataclass
class AttentionBatch:
    q_lens: list[int]  # new tokens per sequence
    kv_lens: list[int]  # tokens with KV per sequence after this pass (cached + new)
    page_tables: list[list[int]]  # per sequence, pages covering positions [0, kv_len)
    num_extends: int  # sequences [0, num_extends) are prompt pieces; the rest decode one token each
    out_slots: torch.Tensor  # [num_tokens] int64: flat KV slot (page * page_size + offset) of each new token

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)


@dataclass
class PagedDecode:
    """What a step of decodes alone reads in place, for one layer: that layer's caches [pages,
    page_size, kv_heads, head_dim], each new token's flat slot, each sequence's page table [B, W]
    (padded) and KV length [B] (int64), q.k's scale and the layer's window (0: none)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slots: torch.Tensor
    page_table: torch.Tensor
    kv_lens: torch.Tensor
    scale: float
    window: int


class AttentionBackend(ABC):
    """Contract: `prepare(batch)` once per forward pass, before any layer; then `forward(layer, q,
    k, v)` for each layer in order. `forward` writes k and v of the new tokens into the cache at
    `batch.out_slots` and returns attention over each sequence's whole KV (prefix + new tokens), or
    over its last `windows[layer]` positions where that is not 0. Every layer's KV is kept whole:
    a window narrows what a layer reads, not what the cache holds."""

    def __init__(self, kv_cache: PagedKVCache, num_heads: int, head_dim: int, scale: float,
                 windows: tuple[int, ...] = ()):
        self.kv_cache = kv_cache
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.windows = windows or (0,) * kv_cache.num_layers  # per layer: 0 (all positions) or a window
        if len(self.windows) != kv_cache.num_layers:
            raise ValueError(f"{len(self.windows)} layer windows for a cache of {kv_cache.num_layers} layers")

    @abstractmethod
    def prepare(self, batch: AttentionBatch) -> None: ...

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> torch.Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] -> [T, num_heads, head_dim].
        A latent cache (`kv_cache.latent`, multi-head latent attention): k [T, 1, head_dim] is the
        tokens' latent rows, v is None, and the output is [T, num_heads, kv_cache.value_dim]."""

    def rotate_and_attend(self, layer: int, qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor) -> torch.Tensor | None:
        """`forward` with RoPE applied first, where this backend does both in fewer launches: qk
        [T, num_heads + num_kv_heads, head_dim] (q's heads, then k's) is rotated by cos and sin
        ([T, 1, head_dim]) in place, its k heads and v are written into the cache, and the output
        is `forward`'s. None where the backend cannot: the caller rotates and calls `forward`."""
        return None

    def decode_in_place(self, layer: int) -> PagedDecode | None:
        """Where the prepared batch is decodes alone and this backend reads them in place from
        the paged cache: the operands of that read for `layer` (a fused layer's kernel then does
        the KV store and the attention itself). None otherwise."""
        return None
