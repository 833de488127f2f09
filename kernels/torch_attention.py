"""Attention in plain torch (CPU, or any device): gathers each sequence's pages and calls
scaled_dot_product_attention. Prompt pieces run one sequence at a time (they are few and large);
decodes run as padded batches.

Gathers move whole pages (index_select over [num_pages, page_size * heads * dim] rows): on CPU that
is several times faster than gathering token rows, which dominated decode steps. With a float32 or
bfloat16 cache on a CPU that runs tandem's own kernels (cpu_ops.py), decodes skip the gathers
altogether: `paged_decode_attention` reads each sequence's pages where they lie, all decodes in one
call (float32 math either way); so do prompt pieces whose attention runs in bfloat16 on a CPU with
AVX512-BF16 (`prompt_attention_bf16`).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from tandem.kernels.attention import AttentionBackend, AttentionBatch, PagedDecode
from tandem.kernels.block_linear import bfloat16_blocks_unavailable
from tandem.kernels.cpu_ops import cpu_ops_unavailable

log = logging.getLogger("tandem.kernels")

DECODE_BUCKETS = 4  # at most this many padded decode batches per layer
DECODE_BUCKET_MIN = 8  # ... each of at least this many sequences


class TorchAttention(AttentionBackend):
    def __init__(self, *args, prompt_dtype: torch.dtype | None = None, **kwargs):
        """`prompt_dtype`: prompt pieces' attention (SDPA over their gathered pages) computes in
        it, the output returned in q's dtype; None: in q's. A float32 model whose prompt products
        run in bfloat16 (`--prefill-dtype`) has its prompt attention run in bfloat16 too: on a CPU
        with AVX512-BF16, SDPA over a 512-token prompt took 0.44x float32's time (1.62 against 3.67
        ms a layer, SmolLM2's 9 heads). Decodes keep q's dtype.

        Where the CPU has AVX512-BF16 and tandem's kernels run, prompt pieces in bfloat16 skip SDPA
        and the gather: `prompt_attention_bf16` reads the pages (float32 or bfloat16) in place
        (layers without a sliding window, head dims a multiple of 64)."""
        super().__init__(*args, **kwargs)
        self.prompt_dtype = prompt_dtype
        c = self.kv_cache
        self.in_place_decode = (c.device.type == "cpu" and c.dtype in (torch.float32, torch.bfloat16)
                                and cpu_ops_unavailable() is None)
        self.in_place_prompt = (prompt_dtype == torch.bfloat16 and c.device.type == "cpu"
                                and c.dtype in (torch.float32, torch.bfloat16) and not c.latent
                                and c.head_dim % 64 == 0 and bfloat16_blocks_unavailable() is None)
        if prompt_dtype == torch.bfloat16 and c.device.type == "cpu":
            log.info("prompt attention in bfloat16: %s", "read in place (prompt_attention_bf16; SDPA for windowed layers)"
                     if self.in_place_prompt else "SDPA over gathered pages (the in-place kernel needs a float32 "
                     "or bfloat16 cache, head dims a multiple of 64 and AVX512-BF16)")

    def prepare(self, batch: AttentionBatch) -> None:
        device = self.kv_cache.device
        P = self.kv_cache.page_size
        windows = sorted(set(self.windows) - {0})
        self.out_slots = batch.out_slots
        # Per prompt piece: (first row, q_len, pages, {window: (first KV position read, mask or None
        # for plain causal)}), window 0 being every position
        self.extends = []
        row = 0
        for i in range(batch.num_extends):
            q_len, kv_len = batch.q_lens[i], batch.kv_lens[i]
            pages = torch.tensor(batch.page_tables[i], device=device)
            start = kv_len - q_len  # new token j is at position start + j
            rows = torch.arange(start, kv_len, device=device)[:, None]
            views = {0: (0, None if start == 0 else torch.arange(kv_len, device=device)[None, :] <= rows)}
            for w in windows:  # positions (p - w, p] of each new token p, read from the first any of them needs
                lo = max(0, start - w + 1)
                cols = torch.arange(lo, kv_len, device=device)[None, :]
                views[w] = (lo, (cols <= rows) & (cols > rows - w))
            self.extends.append((row, q_len, kv_len, pages, views))
            row += q_len
        # Decodes, sorted by length into a few padded buckets: one bucket would pad every sequence
        # to the longest, and the padding is read twice per layer (gather, then attention).
        self.decode_buckets = []  # (output rows, padded page ids [b, width], {window: mask [b, 1, 1, width * P]})
        self.in_place = None  # (first output row, padded page ids [b, width], kv lens [b])
        first = batch.num_extends
        if self.in_place_decode and first < len(batch.q_lens):
            tables = batch.page_tables[first:]
            width = max(len(t) for t in tables)
            pages = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables], device=device)
            self.in_place = (row, pages, torch.tensor(batch.kv_lens[first:], device=device))
            return
        order = sorted(range(first, len(batch.q_lens)), key=lambda i: batch.kv_lens[i])
        size = max(DECODE_BUCKET_MIN, -(-len(order) // DECODE_BUCKETS))
        for start in range(0, len(order), size):
            members = order[start : start + size]
            tables = [batch.page_tables[i] for i in members]
            width = max(len(t) for t in tables)
            # Padding repeats each sequence's first page (any finite page would do: masked out).
            pages = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables], device=device)
            kv_lens = torch.tensor([batch.kv_lens[i] for i in members], device=device)[:, None]
            positions = torch.arange(width * P, device=device)[None, :]
            masks = {0: positions < kv_lens}
            masks.update({w: masks[0] & (positions >= kv_lens - w) for w in windows})
            rows = torch.tensor([row + i - first for i in members], device=device)
            self.decode_buckets.append((rows, pages, {w: m[:, None, None, :] for w, m in masks.items()}))

    def decode_in_place(self, layer: int) -> PagedDecode | None:
        if self.in_place is None or self.in_place[0] != 0 or self.kv_cache.latent:
            return None
        c = self.kv_cache
        _, pages, kv_lens = self.in_place
        return PagedDecode(c.k[layer], c.v[layer], self.out_slots, pages, kv_lens, self.scale, self.windows[layer])

    def _gather(self, layer: int, pages: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `pages` ([...] page ids) as [..., len * page_size, kv_heads, head_dim], in
        `dtype` (the compute dtype; the cache may store a narrower one)."""
        c = self.kv_cache
        shape = (*pages.shape[:-1], pages.shape[-1] * c.page_size, c.num_kv_heads, c.head_dim)
        flat = pages.reshape(-1)
        k = c.k[layer].flatten(1).index_select(0, flat).view(shape).to(dtype)
        if c.latent:  # the values are the latent part of each row
            return k, k[..., : c.value_dim]
        return k, c.v[layer].flatten(1).index_select(0, flat).view(shape).to(dtype)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.kv_cache.write(layer, self.out_slots, k, v)
        window = self.windows[layer]
        c = self.kv_cache
        out = q.new_empty(*q.shape[:2], c.value_dim or q.shape[2])
        dtype = self.prompt_dtype or q.dtype
        for row, q_len, kv_len, pages, views in self.extends:
            if self.in_place_prompt and window == 0 and q.dtype == torch.float32:
                out[row : row + q_len] = torch.ops.tandem.prompt_attention_bf16(
                    q[row : row + q_len], c.k[layer], c.v[layer], pages, kv_len, self.scale)
                continue
            lo, mask = views[window]
            ki, vi = self._gather(layer, pages, dtype)
            qi = q[row : row + q_len].to(dtype).transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
            ki = ki[lo:kv_len].transpose(0, 1).unsqueeze(0)  # [1, KVH, kv_len - lo, D]
            vi = vi[lo:kv_len].transpose(0, 1).unsqueeze(0)
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=True
            )
            out[row : row + q_len] = oi[0].transpose(0, 1)
        for rows, pages, masks in self.decode_buckets:
            kd, vd = self._gather(layer, pages, q.dtype)  # [b, L, KVH, D]
            qd = q.index_select(0, rows).unsqueeze(2)  # [b, H, 1, D]
            od = F.scaled_dot_product_attention(
                qd, kd.transpose(1, 2), vd.transpose(1, 2), attn_mask=masks[window], scale=self.scale, enable_gqa=True
            )
            out.index_copy_(0, rows, od.squeeze(2))
        if self.in_place is not None:  # decodes are the batch's last rows
            first, pages, kv_lens = self.in_place
            # A latent cache's values are its rows' first value_dim: the kernel sums whole rows and
            # the rotated part's sums are dropped
            v_cache = c.k[layer] if c.latent else c.v[layer]
            decoded = torch.ops.tandem.paged_decode_attention(q[first:], c.k[layer], v_cache, pages, kv_lens,
                                                              self.scale, window)
            out[first:] = decoded[..., : out.shape[2]]
        return out
