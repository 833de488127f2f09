"""The attention interface every backend implements, and the batch layout it receives.

A forward pass runs a ragged batch: sequence i contributes `q_lens[i]` new tokens (rows
`[qo_indptr[i], qo_indptr[i+1])` of q/k/v) whose positions continue its `kv_lens[i] - q_lens[i]`
tokens already in the paged KV cache. Prompt pieces ("extends") come first, one-token decodes
last. Causality is bottom-right aligned: new token j of sequence i sees KV positions
`[0, kv_lens[i] - q_lens[i] + j]`.
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


class AttentionBackend(ABC):
    """Contract: `prepare(batch)` once per forward pass, before any layer; then `forward(layer, q,
    k, v)` for each layer in order. `forward` writes k and v of the new tokens into the cache at
    `batch.out_slots` and returns attention over each sequence's whole KV (prefix + new tokens)."""

    def __init__(self, kv_cache: PagedKVCache, num_heads: int, head_dim: int, scale: float):
        self.kv_cache = kv_cache
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale

    @abstractmethod
    def prepare(self, batch: AttentionBatch) -> None: ...

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] -> [T, num_heads, head_dim]."""


def create_backend(name: str, kv_cache: PagedKVCache, num_heads: int, head_dim: int) -> AttentionBackend:
    """`auto` picks FlashInfer on CUDA for 16-bit caches (it has no float32 kernels) and the torch
    backend everywhere else."""
    scale = head_dim**-0.5
    if name == "auto":
        half = kv_cache.dtype in (torch.float16, torch.bfloat16)
        name = "flashinfer" if kv_cache.device.type == "cuda" and half else "torch"
    if name == "torch":
        from tandem.kernels.torch_attention import TorchAttention

        return TorchAttention(kv_cache, num_heads, head_dim, scale)
    if name == "flashinfer":
        if kv_cache.device.type != "cuda":
            raise ValueError("--attention-backend=flashinfer needs a CUDA device")
        from tandem.kernels.flashinfer_attention import FlashInferAttention

        return FlashInferAttention(kv_cache, num_heads, head_dim, scale)
    raise ValueError(f"--attention-backend={name!r} is unknown: choose auto, torch or flashinfer")
