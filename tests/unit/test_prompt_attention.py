"""`prompt_attention_bf16` (csrc/prompt_attention_bf16.cpp): a prompt piece's causal attention read in
place from a float32 or bfloat16 paged cache and multiplied in bfloat16, against float64 attention
over the bfloat16-rounded q, K and V (within what rounding the softmax weights to bfloat16 can cost),
for pieces with and without a cached prefix, lengths that fill no whole block of keys or group of
rows, GQA and head dims of 64 and 128 (a bfloat16 cache: bit for bit a float32 one holding the same
rounded values); then through TorchAttention, which takes it for caches whose prompts compute in
bfloat16 on a CPU with AVX512-BF16; and its refusals, by name."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.common.cpu import cpu_flags
from tandem.kernels.attention import AttentionBatch
from tandem.kernels.block_linear import bfloat16_blocks_unavailable
from tandem.kernels.cpu_ops import cpu_ops_unavailable
from tandem.kernels.kv_cache import PagedKVCache, flat_slots
from tandem.kernels.torch_attention import TorchAttention

NATIVE = bfloat16_blocks_unavailable() is None


def assert_refused(call) -> None:
    """Where the CPU lacks AVX512-BF16, the operator refuses by name; where tandem's kernels are not
    built at all, only because the CPU lacks AVX2 + FMA or they were switched off."""
    why = cpu_ops_unavailable()
    if why is not None:
        has_avx2 = all(flag in cpu_flags() for flag in ("avx2", "fma"))
        assert why == "TANDEM_CPU_KERNELS=0" or (not has_avx2 and why.startswith("this CPU lacks")), why
        return
    with pytest.raises(RuntimeError, match="prompt_attention_bf16 needs a CPU with AVX512-BF16"):
        call()
PAGE = 16


def scattered_cache(pages: int, kv_heads: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(pages, PAGE, kv_heads, dim, generator=g), torch.randn(pages, PAGE, kv_heads, dim, generator=g)


def reference(q, k_cache, v_cache, pages, kv_len, scale):
    """float64 attention over the bfloat16-rounded operands, and the bound on its difference from
    a bfloat16 sum over V: each weight rounded to bfloat16 moves by at most 2^-9 of itself, so an
    output by at most 2^-9 of sum_j p_j |v_j| (twice that, for the float32 sums and e^x)."""
    T, H, D = q.shape
    pos = torch.arange(kv_len)
    rows = pages[pos // PAGE] * PAGE + pos % PAGE
    k, v = (c.flatten(0, 1)[rows].bfloat16().double() for c in (k_cache, v_cache))
    group = H // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("thd,lhd->htl", q.bfloat16().double(), k) * scale
    visible = pos[None, :] <= torch.arange(kv_len - T, kv_len)[:, None]
    p = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("htl,lhd->thd", p, v), 2**-8 * torch.einsum("htl,lhd->thd", p, v.abs()) + 1e-6


@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (5, 5), (7, 40), (300, 300), (33, 530), (4, 17)])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 2, 128)])
def test_matches_float64_attention_over_the_rounded_operands(q_len, kv_len, heads, kv_heads, dim):
    k_cache, v_cache = scattered_cache(48, kv_heads, dim, seed=q_len)
    pages = torch.randperm(48, generator=torch.Generator().manual_seed(kv_len))[: -(-kv_len // PAGE)]
    q = torch.randn(q_len, heads, dim, generator=torch.Generator().manual_seed(3))
    if not NATIVE:  # the library is built everywhere; the operator refuses a CPU it cannot run on
        return assert_refused(lambda: torch.ops.tandem.prompt_attention_bf16(q, k_cache, v_cache, pages, kv_len,
                                                                              dim**-0.5))
    out = torch.ops.tandem.prompt_attention_bf16(q, k_cache, v_cache, pages, kv_len, dim**-0.5)
    assert out.shape == q.shape and out.dtype == torch.float32
    want, bound = reference(q, k_cache, v_cache, pages, kv_len, dim**-0.5)
    worst = float(((out.double() - want).abs() / bound).max())
    assert worst <= 1, f"off by {worst:.2f}x the bound"
    # a bfloat16 cache holds what the kernel rounds a float32 one to: the same result, bit for bit
    rounded = torch.ops.tandem.prompt_attention_bf16(q, k_cache.bfloat16(), v_cache.bfloat16(), pages, kv_len,
                                                     dim**-0.5)
    assert torch.equal(rounded, out)


def attend(prompt_dtype, in_place: bool | None = None,
           kv_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, TorchAttention]:
    """Two prompt pieces (one after a cached prefix of 37 tokens) and a decode, through TorchAttention
    over a cache of `kv_dtype`: H 9, KVH 3, D 64 (SmolLM2's)."""
    H, KVH, D = 9, 3, 64
    shapes = [(0, 70), (37, 50), (20, 1)]
    cache = PagedKVCache(1, 64, PAGE, KVH, D, kv_dtype, torch.device("cpu"))
    pages = iter(random.Random(3).sample(range(64), 64))
    gen = torch.Generator().manual_seed(5)
    tables, slots, ks, vs, qs = [], [], [], [], []
    for prefix, new in shapes:
        table = [next(pages) for _ in range(-(-(prefix + new) // PAGE))]
        k, v = torch.randn(prefix + new, KVH, D, generator=gen), torch.randn(prefix + new, KVH, D, generator=gen)
        if prefix:
            cache.write(0, torch.tensor(flat_slots(table, 0, prefix, PAGE)), k[:prefix], v[:prefix])
        tables.append(table)
        slots += flat_slots(table, prefix, prefix + new, PAGE)
        ks.append(k[prefix:])
        vs.append(v[prefix:])
        qs.append(torch.randn(new, H, D, generator=gen))
    backend = TorchAttention(cache, H, D, D**-0.5, prompt_dtype=prompt_dtype)
    if in_place is not None:
        backend.in_place_prompt = in_place
    backend.prepare(AttentionBatch([n for _, n in shapes], [p + n for p, n in shapes], tables, 2, torch.tensor(slots)))
    return backend.forward(0, torch.cat(qs), torch.cat(ks), torch.cat(vs)), backend


def test_torch_attention_reads_bfloat16_prompts_in_place_where_it_can():
    """The in-place kernel where the CPU has AVX512-BF16 (SDPA over the gathered pages otherwise):
    within bfloat16's rounding of the float32 result, the decode untouched."""
    out, backend = attend(torch.bfloat16)
    assert backend.in_place_prompt == NATIVE
    exact, float32_backend = attend(None)
    assert not float32_backend.in_place_prompt  # float32 prompts stay SDPA's
    torch.testing.assert_close(out, exact, atol=2e-2, rtol=2e-2)
    assert torch.equal(out[120:], exact[120:])  # the decode
    assert not torch.equal(out[:120], exact[:120])  # the prompts: rounded
    if NATIVE:
        gathered, _ = attend(torch.bfloat16, in_place=False)  # SDPA in bfloat16 over the gathered pages
        torch.testing.assert_close(out, gathered, atol=2e-2, rtol=2e-2)
        assert not torch.equal(out[:120], gathered[:120])  # not SDPA's: the kernel ran


def test_torch_attention_reads_a_bfloat16_cache_in_place_too():
    """A bfloat16 cache (--kv-cache-dtype): its prompts read in place as well, within bfloat16's
    rounding of SDPA's bfloat16 attention over the same pages; its decode read in place by
    paged_decode_attention, within the rounding of K and V of the float32 cache's."""
    out, backend = attend(torch.bfloat16, kv_dtype=torch.bfloat16)
    assert backend.in_place_prompt == NATIVE and backend.in_place_decode == (cpu_ops_unavailable() is None)
    gathered, sdpa = attend(torch.bfloat16, in_place=False, kv_dtype=torch.bfloat16)
    assert not sdpa.in_place_prompt
    torch.testing.assert_close(out, gathered, atol=2e-2, rtol=2e-2)
    assert NATIVE != torch.equal(out[:120], gathered[:120])  # where native, the kernel ran, not SDPA
    torch.testing.assert_close(out, attend(None)[0], atol=2e-2, rtol=2e-2)


def test_refuses_what_it_cannot_take_by_name():
    k_cache, v_cache = scattered_cache(4, 2, 64, seed=1)
    pages = torch.tensor([0, 1])
    q = torch.randn(3, 4, 64)
    if not NATIVE:
        return assert_refused(lambda: torch.ops.tandem.prompt_attention_bf16(q, k_cache, v_cache, pages, 20, 0.125))
    with pytest.raises(RuntimeError, match=r"kv_len = 40 must hold the 3 query rows and fit the 2 pages of 16"):
        torch.ops.tandem.prompt_attention_bf16(q, k_cache, v_cache, pages, 40, 0.125)
    with pytest.raises(RuntimeError, match=r"kv_len = 2 must hold the 3 query rows"):
        torch.ops.tandem.prompt_attention_bf16(q, k_cache, v_cache, pages, 2, 0.125)
    with pytest.raises(RuntimeError, match=r"pages\[1\] = 9 is outside the cache's 4"):
        torch.ops.tandem.prompt_attention_bf16(q, k_cache, v_cache, torch.tensor([0, 9]), 20, 0.125)
    with pytest.raises(RuntimeError, match="head_dim must match the cache and be a multiple of 64, got 32"):
        small = torch.randn(4, PAGE, 2, 32)
        torch.ops.tandem.prompt_attention_bf16(torch.randn(3, 4, 32), small, small, pages, 20, 0.125)
    with pytest.raises(RuntimeError, match=r"k_cache and v_cache must be contiguous float32 or bfloat16"):
        torch.ops.tandem.prompt_attention_bf16(q, k_cache, v_cache.bfloat16(), pages, 20, 0.125)
    with pytest.raises(RuntimeError, match=r"query heads \(3\) must be a multiple of kv heads \(2\)"):
        torch.ops.tandem.prompt_attention_bf16(torch.randn(3, 3, 64), k_cache, v_cache, pages, 20, 0.125)
