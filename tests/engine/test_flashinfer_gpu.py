"""FlashInfer against the torch reference backend on the same paged cache and inputs (CUDA only).

Each pass runs both backends layer by layer: a ragged batch of two prompt pieces (one continuing a
cached prefix, one fresh) and three decodes goes through the prefill wrapper; a pure decode batch
goes through the decode wrapper. Page tables are random, non-contiguous page ids, and kv lengths hit
page boundaries (last page holding 1 token, or a full 16). Where CUDA is absent, conftest.py skips
these tests; where it is present, FlashInfer must be installed, so a failed import fails."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.attention import AttentionBatch
from tandem.kernels.kv_cache import PagedKVCache, flat_slots
from tandem.kernels.torch_attention import TorchAttention

pytestmark = pytest.mark.gpu

PAGE_SIZE = 16
NUM_PAGES = 128
NUM_LAYERS = 2
# (num_heads, num_kv_heads, head_dim): SmolLM2-135M's shape (GQA group 3: CUDA-core decode kernel)
# and a Llama-like one (group 8: tensor-core decode path).
HEAD_SHAPES = [(9, 3, 64), (16, 2, 128)]
# FlashInfer has no float32 kernels. Both backends round their output to the input dtype.
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3}

# (cached prefix, new tokens) per prompt piece; kv lengths of the one-token decodes.
MIXED = dict(extends=[(150, 41), (0, 100)], decodes=[17, 32, 300])
DECODE_ONLY = dict(extends=[], decodes=[2, 16, 33, 257, 1000])


def make_batch(extends, decodes, pages: list[int], device) -> AttentionBatch:
    """Page tables drawn (without reuse) from the shuffled `pages`, ceil(kv_len / P) pages each."""
    q_lens = [n for _, n in extends] + [1] * len(decodes)
    kv_lens = [p + n for p, n in extends] + decodes
    tables, slots, free = [], [], iter(pages)
    for q_len, kv_len in zip(q_lens, kv_lens):
        table = [next(free) for _ in range(-(-kv_len // PAGE_SIZE))]
        tables.append(table)
        slots += flat_slots(table, kv_len - q_len, kv_len, PAGE_SIZE)
    return AttentionBatch(
        q_lens=q_lens,
        kv_lens=kv_lens,
        page_tables=tables,
        num_extends=len(extends),
        out_slots=torch.tensor(slots, dtype=torch.long, device=device),
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("shape", HEAD_SHAPES, ids=lambda s: f"h{s[0]}-kv{s[1]}-d{s[2]}")
def test_flashinfer_matches_torch(shape, dtype):
    import flashinfer  # noqa: F401  (a GPU machine must have it: an ImportError fails the test)

    from tandem.kernels.flashinfer_attention import FlashInferAttention

    num_heads, num_kv_heads, head_dim = shape
    device = torch.device("cuda")
    torch.manual_seed(0)
    cache = PagedKVCache(NUM_LAYERS, NUM_PAGES, PAGE_SIZE, num_kv_heads, head_dim, dtype, device)
    for layer in range(NUM_LAYERS):  # every slot holds data: cached prefixes are random K/V
        cache.k[layer].normal_()
        cache.v[layer].normal_()
    scale = head_dim**-0.5
    ref = TorchAttention(cache, num_heads, head_dim, scale)
    fi = FlashInferAttention(cache, num_heads, head_dim, scale)
    tol = TOLERANCE[dtype]

    # Mixed, then decode-only, then mixed again: the wrappers share one workspace and alternate.
    for name, spec in [("mixed", MIXED), ("decode", DECODE_ONLY), ("mixed again", MIXED)]:
        batch = make_batch(**spec, pages=torch.randperm(NUM_PAGES).tolist(), device=device)
        ref.prepare(batch)
        fi.prepare(batch)
        assert fi.wrapper is (fi.decode if batch.num_extends == 0 else fi.prefill)
        T = batch.num_tokens
        for layer in range(NUM_LAYERS):
            q = torch.randn(T, num_heads, head_dim, dtype=dtype, device=device)
            k = torch.randn(T, num_kv_heads, head_dim, dtype=dtype, device=device)
            v = torch.randn(T, num_kv_heads, head_dim, dtype=dtype, device=device)
            want = ref.forward(layer, q, k, v)  # both backends write the same new K/V to the cache
            got = fi.forward(layer, q, k, v)
            assert got.shape == want.shape and got.dtype == dtype
            torch.testing.assert_close(
                got, want, atol=tol, rtol=tol, msg=lambda m: f"{name} pass, layer {layer}: {m}"
            )
