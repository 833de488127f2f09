"""Attention on CUDA with FlashInfer's paged kernels (flashinfer-python >= 0.2.1, where the prefill
plan() names its head size `head_dim_qk`; the decode plan() keeps `head_dim`).

Batches with prompt pieces use the batch prefill kernel over the paged cache. Its causal mask is
bottom-right aligned (key kv_idx is masked for new row q_idx iff kv_idx + q_len > kv_len + q_idx),
which is our convention: a cached prefix, and one-token decodes riding along as q_len == 1, need
nothing extra. Pure decode batches use the batch decode kernel. Both read the cache as a (K, V)
tuple of [num_pages, page_size, num_kv_heads, head_dim] tensors: FlashInfer's "NHD" layout.
"""

from __future__ import annotations

import torch

from tandem.kernels.attention import AttentionBackend, AttentionBatch
from tandem.kernels.kv_cache import PagedKVCache
from tandem.kernels.layer_ops import cuda_kernels

WORKSPACE_BYTES = 128 * 1024 * 1024


def _check_dtype(kv_cache: PagedKVCache) -> None:
    if kv_cache.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"FlashInfer's attention kernels take float16 or bfloat16, not {kv_cache.dtype}: "
            "use --dtype bfloat16 or --attention-backend torch"
        )


def _uses_tensor_cores(num_heads: int, num_kv_heads: int) -> bool:
    """The CUDA-core decode kernel is compiled for GQA group sizes 1, 2, 3, 4 and 8 only. Groups of
    4 and more take the tensor-core path instead (the prefill kernel: any group size, and faster for
    large groups; SGLang switches at 4 too)."""
    return num_heads // num_kv_heads >= 4


def _page_arrays(batch: AttentionBatch, page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kv indptr, page ids, last page length) as plan() wants them: int32, on the host. plan()
    reads the indptrs there anyway and copies everything to the workspace's device itself.
    FlashInfer derives kv_len = (len(table) - 1) * P + last_page_len, so each table must hold
    exactly ceil(kv_len / P) pages (the runner trims them), and last_page_len is in [1, P]."""
    kv_indptr = [0]
    for table in batch.page_tables:
        kv_indptr.append(kv_indptr[-1] + len(table))
    return (torch.tensor(kv_indptr, dtype=torch.int32),
            torch.tensor([p for t in batch.page_tables for p in t], dtype=torch.int32),
            torch.tensor([(n - 1) % page_size + 1 for n in batch.kv_lens], dtype=torch.int32))


def _plan_arguments(backend: AttentionBackend) -> dict:
    """What every plan() of `backend` is given beside the page tables. q shares the cache's dtype
    (both are the model's); run() checks q against q_data_type."""
    c = backend.kv_cache
    return dict(num_qo_heads=backend.num_heads, num_kv_heads=c.num_kv_heads, page_size=c.page_size,
                sm_scale=backend.scale, q_data_type=c.dtype, kv_data_type=c.dtype)


class FlashInferAttention(AttentionBackend):
    def __init__(self, kv_cache: PagedKVCache, num_heads: int, head_dim: int, scale: float):
        super().__init__(kv_cache, num_heads, head_dim, scale)
        import flashinfer

        _check_dtype(kv_cache)
        # One float workspace (split-KV partial results) serves both wrappers: a forward pass plans
        # and runs only one of them, and each wrapper keeps its plan in its own int workspace.
        # Zeroed: the wrappers ask for a zero-initialized buffer on first use.
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=kv_cache.device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, kv_layout="NHD")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, kv_layout="NHD", use_tensor_cores=_uses_tensor_cores(num_heads, kv_cache.num_kv_heads)
        )
        self.wrapper = None
        self.common = _plan_arguments(self)

    def prepare(self, batch: AttentionBatch) -> None:
        kv_indptr_t, kv_indices, last_page_len = _page_arrays(batch, self.kv_cache.page_size)
        common = self.common
        self.out_slots = batch.out_slots
        if batch.num_extends == 0:
            self.decode.plan(
                indptr=kv_indptr_t,
                indices=kv_indices,
                last_page_len=last_page_len,
                head_dim=self.head_dim,
                **common,
            )
            self.wrapper = self.decode
        else:
            qo_indptr = [0]
            for n in batch.q_lens:
                qo_indptr.append(qo_indptr[-1] + n)
            self.prefill.plan(
                qo_indptr=torch.tensor(qo_indptr, dtype=torch.int32),
                paged_kv_indptr=kv_indptr_t,
                paged_kv_indices=kv_indices,
                paged_kv_last_page_len=last_page_len,
                head_dim_qk=self.head_dim,
                causal=True,
                **common,
            )
            self.wrapper = self.prefill

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.kv_cache.write(layer, self.out_slots, k, v)
        return self.wrapper.run(q, (self.kv_cache.k[layer], self.kv_cache.v[layer]))

    def rotate_and_attend(self, layer: int, qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor) -> torch.Tensor | None:
        """RoPE and the KV write in one Triton kernel (`triton_ops.rope_store_`), then attention."""
        cache = self.kv_cache
        kernels = cuda_kernels(qk, cos, sin, v, cache.buffer)
        if kernels is None or not (kernels.takes_rope(qk, cos) and sin.is_contiguous() and kernels.takes_kv(v)):
            return None
        kernels.rope_store_(qk, cos, sin, self.num_heads, v, cache.k[layer], cache.v[layer], self.out_slots)
        return self.wrapper.run(qk[:, : self.num_heads], (cache.k[layer], cache.v[layer]))


class FlashInferGraphDecode(FlashInferAttention):
    """Decode attention for a CUDA graph of a fixed batch size (`tandem.server.loop.cuda_graphs`).

    The graph captures the kernels with the addresses of this backend's buffers: the page tables
    (kv indptr, page ids, last page lengths) and the new tokens' KV slots. `prepare` runs before
    each replay, outside the graph: plan() writes the step's page tables and its work split into
    the same buffers, and the slots are copied into `out_slots`, so the replayed kernels read the
    new step's sequences. Every batch must have exactly `batch_size` sequences (the graph runner
    pads with rows that attend to a scratch page)."""

    def __init__(self, kv_cache: PagedKVCache, num_heads: int, head_dim: int, scale: float, batch_size: int,
                 workspace: torch.Tensor, page_ids: torch.Tensor, out_slots: torch.Tensor):
        """`workspace` (float, zeroed) and `page_ids` (int32, as many as a batch's page tables may
        hold in all) are shared by the graphs of every size: only one runs at a time. `out_slots`
        ([batch_size] int64 on the device): where the graph's KV writes read their slots from; a
        batch that brings this very tensor as its `out_slots` was filled in by its caller."""
        AttentionBackend.__init__(self, kv_cache, num_heads, head_dim, scale)
        import flashinfer

        _check_dtype(kv_cache)
        device = kv_cache.device
        self.batch_size = batch_size
        self.workspace = workspace
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, kv_layout="NHD", use_cuda_graph=True,
            use_tensor_cores=_uses_tensor_cores(num_heads, kv_cache.num_kv_heads),
            paged_kv_indptr_buffer=torch.zeros(batch_size + 1, dtype=torch.int32, device=device),
            paged_kv_indices_buffer=page_ids,
            paged_kv_last_page_len_buffer=torch.ones(batch_size, dtype=torch.int32, device=device),
        )
        self.wrapper = self.decode
        self.out_slots = out_slots
        self.common = _plan_arguments(self)

    def prepare(self, batch: AttentionBatch) -> None:
        if batch.num_extends or len(batch.q_lens) != self.batch_size:
            raise ValueError(f"a decode graph of {self.batch_size} rows got {len(batch.q_lens)} sequences, "
                             f"{batch.num_extends} of them prompt pieces")
        kv_indptr_t, kv_indices, last_page_len = _page_arrays(batch, self.kv_cache.page_size)
        self.decode.plan(indptr=kv_indptr_t, indices=kv_indices, last_page_len=last_page_len,
                         head_dim=self.head_dim, **self.common)
        if batch.out_slots is not self.out_slots:
            self.out_slots.copy_(batch.out_slots)
