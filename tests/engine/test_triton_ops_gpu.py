"""The layers' small steps as Triton kernels on CUDA (`tandem.kernels.triton_ops`) against torch's
ops (`layer_ops`' reference code, HF's numerics), in bfloat16 and float16.

The residual add and the rotary embedding round where torch rounds: equal to the bit. RMSNorm sums
its squares in another order and the SiLU's exp is Triton's: at most two units in the last place
of the output dtype apart, and nearly every element equal. A two-layer 8B-shaped model with the
kernels gives the torch ops' hidden states within bfloat16 noise."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels import layer_ops
from tandem.kernels.attention_backends import create_backend
from tandem.kernels.kv_cache import PagedKVCache, flat_slots
from tandem.server.loop.runner import ForwardInputs, forward_pass
from tandem.server.model.llama import LlamaForCausalLM
from tandem.server.model.precision import Precision
from tandem.server.model.random_weights import random_weights, shape_config

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]


def reference(fn, *args):
    layer_ops.use_fused_cuda_ops(False)
    try:
        return fn(*args)
    finally:
        layer_ops.use_fused_cuda_ops(True)


def assert_last_bits(got: torch.Tensor, want: torch.Tensor, ulps: int = 2, equal_at_least: float = 0.98) -> None:
    """Every element within `ulps` units in the last place of want's dtype, and nearly all equal."""
    assert got.dtype == want.dtype and got.shape == want.shape
    ulp = torch.finfo(want.dtype).eps * want.float().abs().clamp_min(torch.finfo(want.dtype).tiny)
    diff = (got.float() - want.float()).abs()
    assert bool((diff <= ulps * ulp).all()), f"max diff {diff.max().item()}"
    assert (got == want).float().mean().item() >= equal_at_least


def test_cuda_bf16_takes_the_kernels():
    x = torch.zeros(2, 64, dtype=torch.bfloat16, device="cuda")
    assert layer_ops.cuda_kernels(x) is not None, "Triton does not import on this GPU machine"
    assert layer_ops.cuda_kernels(x.float()) is None  # float32 keeps torch's ops (HF to the bit)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_add_rms_norm(dtype, rows):
    g = torch.Generator(device="cuda").manual_seed(rows)
    h = torch.randn(rows, 4096, dtype=dtype, device="cuda", generator=g)
    delta = torch.randn(rows, 4096, dtype=dtype, device="cuda", generator=g)
    weight = torch.randn(4096, dtype=dtype, device="cuda", generator=g)
    want_h, want = reference(layer_ops.add_rms_norm, h.clone(), delta, weight, 1e-5)
    got_h, got = layer_ops.add_rms_norm(h.clone(), delta, weight, 1e-5)
    assert torch.equal(got_h, want_h)
    assert_last_bits(got, want)
    assert_last_bits(layer_ops.rms_norm(h, weight, 1e-6), reference(layer_ops.rms_norm, h, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_in_place_over_q_and_k_side_by_side(dtype, head_dim):
    tokens, q_heads, kv_heads = 9, 32, 8
    g = torch.Generator(device="cuda").manual_seed(head_dim)
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype, device="cuda", generator=g)
    positions = torch.randint(0, 4000, (tokens,), device="cuda", generator=g)
    inv_freq = 1.0 / (500000 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim))
    emb = (positions.float()[:, None] * inv_freq[None])
    emb = torch.cat((emb, emb), -1)[:, None, :]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    view = qkv[:, : (q_heads + kv_heads) * head_dim].view(tokens, q_heads + kv_heads, head_dim)
    want = reference(layer_ops.apply_rope, view.clone(), cos, sin)
    untouched = qkv[:, (q_heads + kv_heads) * head_dim :].clone()
    got = layer_ops.apply_rope(view, cos, sin)
    assert got.data_ptr() == view.data_ptr()  # in place
    assert torch.equal(got, want)
    assert torch.equal(qkv[:, (q_heads + kv_heads) * head_dim :], untouched)  # v not touched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("features", [14336, 8192, 100])
def test_silu_mul(dtype, features):
    g = torch.Generator(device="cuda").manual_seed(features)
    gate_up = torch.randn(5, 2 * features, dtype=dtype, device="cuda", generator=g) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    assert_last_bits(layer_ops.silu_mul(gate_up), F.silu(gate) * up)


def test_model_with_the_kernels_gives_torch_ops_hidden_states():
    device = torch.device("cuda")
    c = shape_config("llama3-8b", num_layers=2, vocab_size=8192)
    model = LlamaForCausalLM(c, random_weights(c, torch.bfloat16, device), Precision.uniform(torch.bfloat16), device)
    page, prompts, length = 16, 3, 40
    tables = [list(range(i * 3, i * 3 + 3)) for i in range(prompts)]
    inputs = ForwardInputs(
        input_ids=torch.randint(0, 8192, (prompts * length,), generator=torch.Generator().manual_seed(3)).tolist(),
        positions=[p for _ in range(prompts) for p in range(length)],
        slots=[s for t in tables for s in flat_slots(t, 0, length, page)], q_lens=[length] * prompts,
        kv_lens=[length] * prompts, page_tables=tables, num_extends=prompts)
    hidden = {}
    for fused in (False, True):
        cache = PagedKVCache(c.num_layers, 16, page, c.num_kv_heads, c.head_dim, torch.bfloat16, device)
        attn = create_backend("auto", cache, c.num_heads, c.head_dim, c.softmax_scale)
        layer_ops.use_fused_cuda_ops(fused)
        try:
            hidden[fused] = forward_pass(model, attn, inputs, device).float()
        finally:
            layer_ops.use_fused_cuda_ops(True)
    diff = (hidden[True] - hidden[False]).abs()
    assert diff.mean().item() < 5e-3  # bfloat16 noise, through two layers
    assert (diff > 0.05 + 0.05 * hidden[False].abs()).float().mean().item() < 1e-4


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_the_slots_index_put_writes(dtype):
    tokens, q_heads, kv_heads, head_dim = 7, 32, 8, 128
    g = torch.Generator(device="cuda").manual_seed(5)
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype, device="cuda", generator=g)
    k = qkv[:, q_heads * head_dim : (q_heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (q_heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(4 * 16, device="cuda", generator=g)[:tokens]
    caches = []
    for fused in (False, True):
        cache = PagedKVCache(2, 4, 16, kv_heads, head_dim, dtype, torch.device("cuda"))
        layer_ops.use_fused_cuda_ops(fused)
        try:
            cache.write(1, slots, k, v)
        finally:
            layer_ops.use_fused_cuda_ops(True)
        caches.append(cache.buffer)
    assert torch.equal(caches[0], caches[1])
    assert caches[1][1].abs().sum() > 0 and caches[1][0].abs().sum() == 0  # layer 1 written, layer 0 not


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_store_is_rope_then_store(dtype, head_dim):
    """FlashInfer's backend rotates q and k and writes K and V in one kernel: the same q, the same
    cache, and so the same attention as rotating and writing apart."""
    tokens, q_heads, kv_heads = 6, 32, 8
    g = torch.Generator(device="cuda").manual_seed(head_dim + 1)
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype, device="cuda", generator=g)
    positions = torch.randint(0, 4000, (tokens,), device="cuda", generator=g)
    inv_freq = 1.0 / (500000 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim))
    emb = positions.float()[:, None] * inv_freq[None]
    emb = torch.cat((emb, emb), -1)[:, None, :]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    slots = torch.randperm(4 * 16, device="cuda", generator=g)[:tokens]
    results = []
    for fused in (False, True):
        rows = qkv.clone()
        qk = rows[:, : (q_heads + kv_heads) * head_dim].view(tokens, q_heads + kv_heads, head_dim)
        v = rows[:, (q_heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
        cache = PagedKVCache(2, 4, 16, kv_heads, head_dim, dtype, torch.device("cuda"))
        kernels = layer_ops.cuda_kernels(qk)
        if fused:
            kernels.rope_store_(qk, cos, sin, q_heads, v, cache.k[1], cache.v[1], slots)
        else:
            kernels.apply_rope_(qk, cos, sin)
            kernels.store_kv(cache.k[1], cache.v[1], slots, qk[:, q_heads:], v)
        results.append((qk[:, :q_heads].clone(), cache.buffer))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
