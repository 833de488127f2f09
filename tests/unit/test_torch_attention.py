"""TorchAttention against naive dense attention: ragged batches of prompt pieces (with and
without a cached prefix) and decodes, scattered pages, page sizes 1 and 16, and a bf16 cache
read by float32 math."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.kernels.attention import AttentionBatch
from tandem.kernels.kv_cache import PagedKVCache, flat_slots
from tandem.kernels.torch_attention import TorchAttention

H, KVH, D = 6, 2, 16


def dense_attention(q, k, v, start):
    """q: [n, H, D] at positions start..start+n-1; k, v: [start+n, KVH, D]."""
    k = k.repeat_interleave(H // KVH, dim=1)
    v = v.repeat_interleave(H // KVH, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * D**-0.5
    n, total = q.shape[0], k.shape[0]
    visible = torch.arange(total)[None, :] <= torch.arange(start, start + n)[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_matches_dense_attention(page_size, cache_dtype):
    torch.manual_seed(0)
    rng = random.Random(page_size)
    # (cached prefix, new tokens): two prompt pieces, then decodes of various lengths.
    shapes = [(0, 37), (48, 20), (5, 1), (70, 1), (1, 1), (33, 1)]
    num_extends = 2
    cache = PagedKVCache(1, 512 // page_size, page_size, KVH, D, cache_dtype, torch.device("cpu"))
    free = list(range(cache.num_pages))
    rng.shuffle(free)  # scattered, non-contiguous page tables
    seqs = []
    for prefix, new in shapes:
        total = prefix + new
        pages = [free.pop() for _ in range(-(-total // page_size))]
        k, v = torch.randn(total, KVH, D), torch.randn(total, KVH, D)
        if prefix:  # the prefix is already in the cache
            cache.write(0, torch.tensor(flat_slots(pages, 0, prefix, page_size)), k[:prefix], v[:prefix])
        seqs.append((prefix, new, pages, k, v, torch.randn(new, H, D)))
    batch = AttentionBatch(
        q_lens=[n for _, n, *_ in seqs],
        kv_lens=[p + n for p, n, *_ in seqs],
        page_tables=[pages for _, _, pages, *_ in seqs],
        num_extends=num_extends,
        out_slots=torch.tensor([s for p, n, pages, *_ in seqs for s in flat_slots(pages, p, p + n, page_size)]),
    )
    backend = TorchAttention(cache, H, D, D**-0.5)
    backend.prepare(batch)
    q = torch.cat([s[5] for s in seqs])
    k_new = torch.cat([k[p:] for p, _, _, k, _, _ in seqs])
    v_new = torch.cat([v[p:] for p, _, _, _, v, _ in seqs])
    out = backend.forward(0, q, k_new, v_new)
    assert out.shape == q.shape and torch.isfinite(out).all()
    row = 0
    tol = 1e-5 if cache_dtype == torch.float32 else 2e-2
    for prefix, new, _, k, v, qi in seqs:
        # The reference sees K/V rounded as the cache stores them.
        want = dense_attention(qi, k.to(cache_dtype).float(), v.to(cache_dtype).float(), prefix)
        torch.testing.assert_close(out[row : row + new], want, atol=tol, rtol=tol)
        row += new


def test_fresh_cache_is_finite_everywhere():
    cache = PagedKVCache(2, 8, 4, KVH, D, torch.bfloat16, torch.device("cpu"))
    assert all(torch.isfinite(t).all() for t in cache.k + cache.v)
