"""Attention on CUDA with FlashInfer's paged kernels.

Batches with prompt pieces use the batch prefill kernel over the paged cache (it handles a cached
prefix and bottom-right causality, and one-token decodes riding along as q_len == 1); pure
decode batches use the batch decode kernel. Both read the cache as (K, V) tuples in NHD layout.
"""

from __future__ import annotations

import torch

from tandem.kernels.attention import AttentionBackend, AttentionBatch
from tandem.kernels.kv_cache import PagedKVCache

WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferAttention(AttentionBackend):
    def __init__(self, kv_cache: PagedKVCache, num_heads: int, head_dim: int, scale: float):
        super().__init__(kv_cache, num_heads, head_dim, scale)
        import flashinfer

        device = kv_cache.device
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.wrapper = None

    def prepare(self, batch: AttentionBatch) -> None:
        device, P = self.kv_cache.device, self.kv_cache.page_size
        kv_indptr = [0]
        for table in batch.page_tables:
            kv_indptr.append(kv_indptr[-1] + len(table))
        kv_indices = torch.tensor([p for t in batch.page_tables for p in t], dtype=torch.int32, device=device)
        kv_indptr_t = torch.tensor(kv_indptr, dtype=torch.int32, device=device)
        last_page_len = torch.tensor([(n - 1) % P + 1 for n in batch.kv_lens], dtype=torch.int32, device=device)
        common = dict(
            num_qo_heads=self.num_heads,
            num_kv_heads=self.kv_cache.num_kv_heads,
            head_dim=self.head_dim,
            page_size=P,
            q_data_type=self.kv_cache.dtype,
            sm_scale=self.scale,
        )
        self.out_slots = batch.out_slots
        if batch.num_extends == 0:
            self.decode.plan(
                kv_indptr_t, kv_indices, last_page_len, kv_data_type=self.kv_cache.dtype, **common
            )
            self.wrapper = self.decode
        else:
            qo_indptr = [0]
            for n in batch.q_lens:
                qo_indptr.append(qo_indptr[-1] + n)
            qo_indptr_t = torch.tensor(qo_indptr, dtype=torch.int32, device=device)
            self.prefill.plan(
                qo_indptr_t,
                kv_indptr_t,
                kv_indices,
                last_page_len,
                causal=True,
                kv_data_type=self.kv_cache.dtype,
                **{k: v for k, v in common.items() if k != "head_dim"},
                head_dim_qk=self.head_dim,
            )
            self.wrapper = self.prefill

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.kv_cache.write(layer, self.out_slots, k, v)
        return self.wrapper.run(q, (self.kv_cache.k[layer], self.kv_cache.v[layer]))
