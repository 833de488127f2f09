"""TorchAttention against naive dense attention: ragged batches of prompt pieces (with and
without a cached prefix) and decodes, scattered pages, page sizes 1 and 16, and a bf16 cache
read by float32 and by bfloat16 queries; decodes both gathered and read in place (tandem's
paged_decode_attention); and sliding-window layers, which see only each token's last `window`
positions."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from tandem.common.cpu import cpu_flags
from tandem.kernels.attention import AttentionBatch
from tandem.kernels.cpu_ops import cpu_ops_unavailable
from tandem.kernels.kv_cache import PagedKVCache, flat_slots
from tandem.kernels.torch_attention import TorchAttention

H, KVH, D = 6, 2, 16


def dense_attention(q, k, v, start, window=0):
    """q: [n, H, D] at positions start..start+n-1; k, v: [start+n, KVH, D]; window > 0: each
    query sees only positions (p - window, p]."""
    k = k.repeat_interleave(H // KVH, dim=1)
    v = v.repeat_interleave(H // KVH, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * D**-0.5
    n, total = q.shape[0], k.shape[0]
    cols, rows = torch.arange(total)[None, :], torch.arange(start, start + n)[:, None]
    visible = cols <= rows
    if window:
        visible &= cols > rows - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


HAS_CPU_KERNELS = all(flag in cpu_flags() for flag in ("avx2", "fma"))
HAS_AVX512 = all(flag in cpu_flags() for flag in ("avx512f", "avx512bw"))


def assert_kernel_absent_for_a_reason() -> None:
    """The kernel is missing only where the CPU lacks AVX2 or FMA or it was switched off (a build
    failure on an AVX2 CPU fails here), and the loader says which."""
    why = cpu_ops_unavailable()
    assert why == "TANDEM_CPU_KERNELS=0" or (not HAS_CPU_KERNELS and why.startswith("this CPU lacks")), why


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("cache_dtype,decodes", [(torch.float32, "in place"), (torch.float32, "gathered"),
                                                 (torch.bfloat16, "gathered"), (torch.bfloat16, "in place")])
@pytest.mark.parametrize("window", [0, 9])
def test_matches_dense_attention(page_size, cache_dtype, decodes, window):
    """window 9: shorter than the prompt pieces and the longer decodes, reaching into a cached
    prefix, and longer than the shortest decodes."""
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
    backend = TorchAttention(cache, H, D, D**-0.5, (window,))
    # the bfloat16 model's queries are bfloat16; a CPU without native bfloat16 reads such a cache
    # with float32 math (gathered)
    q_dtype = cache_dtype if decodes == "in place" else torch.float32
    if decodes == "in place":
        # a float32 or bfloat16 cache on an AVX2 CPU reads decodes in place; elsewhere they are gathered
        assert backend.in_place_decode == (cpu_ops_unavailable() is None)
    else:
        backend.in_place_decode = False
    backend.prepare(batch)
    assert (backend.in_place is not None) == backend.in_place_decode
    q = torch.cat([s[5] for s in seqs]).to(q_dtype)
    k_new = torch.cat([k[p:] for p, _, _, k, _, _ in seqs])
    v_new = torch.cat([v[p:] for p, _, _, _, v, _ in seqs])
    out = backend.forward(0, q, k_new, v_new)
    assert out.shape == q.shape and out.dtype == q_dtype and torch.isfinite(out).all()
    row = 0
    tol = 1e-5 if cache_dtype == torch.float32 else 2e-2
    for prefix, new, _, k, v, qi in seqs:
        # The reference sees K/V rounded as the cache stores them.
        want = dense_attention(qi.to(q_dtype).float(), k.to(cache_dtype).float(), v.to(cache_dtype).float(), prefix,
                               window)
        torch.testing.assert_close(out[row : row + new].float(), want, atol=tol, rtol=tol)
        row += new


def test_prompt_pieces_compute_in_the_prompt_dtype_and_decodes_do_not():
    """A float32 model with bfloat16 prompt products (`--prefill-dtype bfloat16`): its prompt
    pieces' attention runs in bfloat16 (within bfloat16's rounding of the float32 result, returned in
    float32), its decodes exactly as without it."""
    torch.manual_seed(1)
    shapes = [(0, 40), (24, 30), (50, 1), (7, 1)]  # two prompt pieces (one after a cached prefix), two decodes
    outs = {}
    for prompt_dtype in (None, torch.bfloat16):
        cache = PagedKVCache(1, 64, 16, KVH, D, torch.float32, torch.device("cpu"))
        pages = iter(random.Random(3).sample(range(64), 64))
        tables, slots, news = [], [], []
        gen = torch.Generator().manual_seed(5)
        for prefix, new in shapes:
            table = [next(pages) for _ in range(-(-(prefix + new) // 16))]
            k, v = torch.randn(prefix + new, KVH, D, generator=gen), torch.randn(prefix + new, KVH, D, generator=gen)
            if prefix:
                cache.write(0, torch.tensor(flat_slots(table, 0, prefix, 16)), k[:prefix], v[:prefix])
            tables.append(table)
            slots += flat_slots(table, prefix, prefix + new, 16)
            news.append((prefix, k, v, torch.randn(new, H, D, generator=gen)))
        backend = TorchAttention(cache, H, D, D**-0.5, prompt_dtype=prompt_dtype)
        backend.prepare(AttentionBatch([n for _, n in shapes], [p + n for p, n in shapes], tables, 2, torch.tensor(slots)))
        q = torch.cat([qi for *_, qi in news])
        out = backend.forward(0, q, torch.cat([k[p:] for p, k, _, _ in news]), torch.cat([v[p:] for p, _, v, _ in news]))
        assert out.dtype == torch.float32
        outs[prompt_dtype] = out
        row = 0
        for (prefix, k, v, qi), (_, new) in zip(news, shapes):
            tol = 2e-2 if prompt_dtype is not None and new > 1 else 1e-5
            torch.testing.assert_close(out[row : row + new], dense_attention(qi, k, v, prefix), atol=tol, rtol=tol)
            row += new
    prompt_rows = 70
    assert torch.equal(outs[None][prompt_rows:], outs[torch.bfloat16][prompt_rows:])  # decodes: untouched
    assert not torch.equal(outs[None][:prompt_rows], outs[torch.bfloat16][:prompt_rows])  # prompts: rounded


def test_fresh_cache_is_finite_everywhere():
    cache = PagedKVCache(2, 8, 4, KVH, D, torch.bfloat16, torch.device("cpu"))
    assert all(torch.isfinite(t).all() for t in cache.k + cache.v)


HUGE_PAGES_PROBE = """
import sys, torch
from tandem.kernels.kv_cache import PagedKVCache
cache = PagedKVCache(2, 1024, 16, 4, 32, torch.float32, torch.device("cpu"), huge_pages=sys.argv[1] == "1")
middle = cache.buffer.data_ptr() + cache.buffer.numel() * cache.buffer.element_size() // 2
for line in open("/proc/self/smaps"):
    head = line.split()[0]
    if "-" in head and not head.endswith(":"):
        lo, hi = (int(x, 16) for x in head.split("-"))
        inside = lo <= middle < hi
    elif inside and head == "VmFlags:":
        print(cache.huge_pages, "hg" in line.split()[1:], bool(cache.buffer.any()))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
@pytest.mark.parametrize("huge_pages", [True, False])
def test_a_cpu_cache_asks_linux_for_huge_pages(huge_pages):
    """32 MiB of pages, advised as huge pages (VmFlags `hg`) before they are zeroed, unless told not
    to. In a fresh process: in a long one, malloc may hand out heap that an earlier pool advised."""
    proc = subprocess.run([sys.executable, "-c", HUGE_PAGES_PROBE, str(int(huge_pages))], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(huge_pages), str(huge_pages), "False"]


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 24), (8, 1, 128)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 40, 520])
@pytest.mark.parametrize("avx512", [0, 1])
def test_paged_decode_attention_kernel_against_float64(heads, kv_heads, dim, cache_dtype, window, avx512):
    """The kernel alone, with its AVX2 functions and with its AVX-512 ones (where the CPU has them;
    a head dim that is not a multiple of 16 keeps AVX2's): GQA group sizes 1 to 8, head dims that are and are not multiples of 16,
    sequences of 1 to 700 tokens on scattered pages of 16; a bfloat16 cache is widened exactly, so
    the float32 math is as close to float64 on its values as on a float32 cache's. A window of 40
    starts mid-page, within the longer sequences. Over 256 positions a sequence's KV is attended in
    parts and merged (300: two parts, 700 or a window of 520: three); a sequence's output is the same
    in any batch."""
    if cpu_ops_unavailable() is not None:
        return assert_kernel_absent_for_a_reason()
    torch.manual_seed(heads)
    P, lens = 16, [1, 17, 300, 64, 700]
    k_cache, v_cache = torch.randn(2, 256, P, kv_heads, dim).to(cache_dtype).unbind(0)
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    perm = torch.randperm(256)
    width = -(-max(lens) // P)
    tables = torch.stack([perm[i * width : (i + 1) * width] for i in range(len(lens))])
    q = torch.randn(len(lens), heads, dim)
    if avx512 and not (HAS_AVX512 and dim % 16 == 0):
        with pytest.raises(RuntimeError, match="avx512=1 needs AVX-512 F and BW and a head_dim that is a multiple of 16"):
            torch.ops.tandem.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens), dim**-0.5,
                                                    window, avx512)
        avx512 = -1  # what a caller gets: AVX2's functions here
    out = torch.ops.tandem.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens), dim**-0.5, window,
                                                  avx512)
    for b, L in enumerate(lens):
        first = max(0, L - window) if window else 0
        k = k_cache[tables[b]].reshape(-1, kv_heads, dim)[first:L].double().repeat_interleave(heads // kv_heads, 1)
        v = v_cache[tables[b]].reshape(-1, kv_heads, dim)[first:L].double().repeat_interleave(heads // kv_heads, 1)
        p = (torch.einsum("hd,khd->hk", q[b].double(), k) * dim**-0.5).softmax(-1)
        torch.testing.assert_close(out[b].double(), torch.einsum("hk,khd->hd", p, v), atol=1e-5, rtol=1e-5)
    if avx512 == 1:  # the AVX-512 functions ran: their sums are grouped otherwise than AVX2's
        assert not torch.equal(out, torch.ops.tandem.paged_decode_attention(q, k_cache, v_cache, tables,
                                                                            torch.tensor(lens), dim**-0.5, window, 0))
    for b in (2, 4):  # alone, as in the batch
        alone = torch.ops.tandem.paged_decode_attention(q[b : b + 1], k_cache, v_cache, tables[b : b + 1],
                                                        torch.tensor(lens[b : b + 1]), dim**-0.5, window, avx512)
        assert torch.equal(alone[0], out[b])


def test_paged_decode_attention_rejects_a_length_beyond_its_pages():
    if cpu_ops_unavailable() is not None:
        return assert_kernel_absent_for_a_reason()
    cache = torch.zeros(4, 16, 1, 16)
    with pytest.raises(RuntimeError, match=r"kv_lens\[0\] = 33 is outside \(0, 32\]"):
        torch.ops.tandem.paged_decode_attention(torch.zeros(1, 1, 16), cache, cache, torch.tensor([[0, 1]]),
                                                torch.tensor([33]), 0.25)
    with pytest.raises(RuntimeError, match=r"k_cache and v_cache must be contiguous float32 or bfloat16"):
        torch.ops.tandem.paged_decode_attention(torch.zeros(1, 1, 16), cache.half(), cache.half(),
                                                torch.tensor([[0, 1]]), torch.tensor([3]), 0.25)
