"""tandem.kernels.layer_ops: the native calls (csrc/layer_ops.cpp) against the torch code they
replace, which is HF's numerics, in float32 and in bfloat16 (where torch rounds each op's result
to bfloat16 and the native calls must round at the same points). Rotary embedding, SiLU products
and residual adds must be equal bit for bit; RMSNorm sums its squares in another order, so it may
differ in the last bit only. Shapes are the built-in model's (hidden 576, 9 and 3 heads of 64, MLP
1536) at 1, 8 and 300 rows, on the strided views the model passes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.common.cpu import cpu_flags
from tandem.kernels import layer_ops
from tandem.kernels.cpu_ops import cpu_ops_unavailable

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP = 576, 9, 3, 64, 1536
NATIVE = cpu_ops_unavailable() is None


def torch_rms_norm(x, weight, eps):
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def torch_rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def rope_tables(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (100000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return emb.cos(), emb.sin()


def assert_kernels_absent_for_a_reason() -> None:
    """They are missing only where the CPU lacks AVX2 or FMA or they were switched off (a build
    failure on an AVX2 CPU fails here)."""
    why = cpu_ops_unavailable()
    has_flags = all(f in cpu_flags() for f in ("avx2", "fma"))
    assert why == "TANDEM_CPU_KERNELS=0" or (not has_flags and why.startswith("this CPU lacks")), why


@pytest.fixture(params=[True, False], ids=["native", "torch"])
def native(request, monkeypatch):
    """Both paths; where tandem's kernels cannot run, the native case checks why and runs torch's."""
    if request.param and not NATIVE:
        assert_kernels_absent_for_a_reason()
    monkeypatch.setattr(layer_ops, "_kernels_ready", [request.param and NATIVE])
    return request.param and NATIVE


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])


@DTYPES
@pytest.mark.parametrize("rows", [1, 8, 300])
def test_rope_and_silu_products_are_torch_bit_for_bit(rows, dtype, native):
    torch.manual_seed(rows)
    qkv = (torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM) * 3).to(dtype)
    q, k, _ = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    cos, sin = (t.to(dtype) for t in rope_tables(torch.arange(rows) * 7 + 3))
    want_q = torch_rope(q.view(rows, HEADS, HEAD_DIM), cos, sin)
    want_k = torch_rope(k.view(rows, KV_HEADS, HEAD_DIM), cos, sin)
    got_q = layer_ops.apply_rope(q.view(rows, HEADS, HEAD_DIM), cos, sin)
    got_k = layer_ops.apply_rope(k.view(rows, KV_HEADS, HEAD_DIM), cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    if native:  # rotated where they lie, in the projection's output
        assert got_q.data_ptr() == qkv.data_ptr() and torch.equal(qkv[:, : HEADS * HEAD_DIM], want_q.flatten(1))

    gate_up = (torch.randn(rows, 2 * MLP) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(layer_ops.silu_mul(gate_up), F.silu(gate) * up)


@DTYPES
@pytest.mark.parametrize("rows", [1, 8, 300])
def test_rms_norm_and_the_residual_add_against_torch(rows, dtype, native):
    torch.manual_seed(rows)
    h, delta = (torch.randn(rows, HIDDEN) * 3).to(dtype), torch.randn(rows, HIDDEN).to(dtype)
    weight = torch.randn(HIDDEN).to(dtype)
    # a few ulp of float32 (only the order of the sum of squares differs), which bfloat16's
    # rounding of the normalized row may turn into one ulp of bfloat16 (2^-8 relative)
    close = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-8, atol=0)
    torch.testing.assert_close(layer_ops.rms_norm(h, weight, 1e-5), torch_rms_norm(h, weight, 1e-5), **close)
    want_h = h + delta
    new_h, x = layer_ops.add_rms_norm(h.clone(), delta, weight, 1e-5)
    assert torch.equal(new_h, want_h)
    torch.testing.assert_close(x, torch_rms_norm(want_h, weight, 1e-5), **close)


@pytest.mark.parametrize("rows", [1, 8, 300])
def test_bfloat16_between_float32_steps_is_the_float32_result_rounded(rows, native):
    """What a float32 model's prompt pieces hand between their bfloat16 products: a norm rounded once
    to bfloat16 equals the float32 norm's `.to(torch.bfloat16)`, a bfloat16 delta added to a float32
    residual stream equals the widened delta added, and SiLU products from bfloat16 values in float32
    math, rounded once, equal the float32 products of the widened values rounded; bit for bit, so
    the prompt pass is the same with and without the copies."""
    torch.manual_seed(rows)
    h, weight = torch.randn(rows, HIDDEN) * 3, torch.randn(HIDDEN)
    delta = torch.randn(rows, HIDDEN).bfloat16()
    out = layer_ops.rms_norm(h, weight, 1e-5, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, layer_ops.rms_norm(h, weight, 1e-5).bfloat16())
    want_h, want_x = layer_ops.add_rms_norm(h.clone(), delta.float(), weight, 1e-5)
    got_h, got_x = layer_ops.add_rms_norm(h.clone(), delta, weight, 1e-5, torch.bfloat16)
    assert torch.equal(got_h, want_h) and got_x.dtype == torch.bfloat16 and torch.equal(got_x, want_x.bfloat16())
    _, same_x = layer_ops.add_rms_norm(h.clone(), delta, weight, 1e-5)  # float32 out, as h
    assert same_x.dtype == torch.float32 and torch.equal(same_x, want_x)
    gate_up = (torch.randn(rows, 2 * MLP) * 4).bfloat16()
    got = layer_ops.silu_mul(gate_up, torch.bfloat16)
    gate, up = gate_up.float().chunk(2, dim=-1)
    want = (F.silu(gate) * up).bfloat16()
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert not torch.equal(got, layer_ops.silu_mul(gate_up))  # bfloat16 math rounds the SiLU apart too
    assert torch.equal(layer_ops.silu_mul(gate_up.float(), torch.float32), F.silu(gate) * up)


def test_other_dtypes_and_shapes_keep_the_torch_code(monkeypatch):
    """float16 math, mixed dtypes, and head dims the native rope does not take, go through torch
    unchanged."""
    monkeypatch.setattr(layer_ops, "_kernels_ready", [NATIVE])
    torch.manual_seed(0)
    h = torch.randn(4, HIDDEN).half()
    weight = torch.randn(HIDDEN).half()
    assert torch.equal(layer_ops.rms_norm(h, weight, 1e-5), torch_rms_norm(h, weight, 1e-5))
    h, weight = h.bfloat16(), weight.float()  # HF promotes: float32 weight times a bfloat16 row
    assert torch.equal(layer_ops.rms_norm(h, weight, 1e-5), torch_rms_norm(h, weight, 1e-5))
    x = torch.randn(4, 2, 24)  # head_dim 24: halves of 12, not whole vectors
    cos, sin = torch.randn(4, 1, 24), torch.randn(4, 1, 24)
    assert torch.equal(layer_ops.apply_rope(x, cos, sin), torch_rope(x, cos, sin))


def test_native_ops_name_what_is_wrong():
    if not NATIVE:
        return assert_kernels_absent_for_a_reason()
    with pytest.raises(RuntimeError, match=r"rms_norm needs rows of a multiple of 8, got 12"):
        torch.ops.tandem.rms_norm(torch.zeros(2, 12), torch.zeros(12), 1e-5)
    with pytest.raises(RuntimeError, match=r"weight must be float32 \[16\]"):
        torch.ops.tandem.rms_norm(torch.zeros(2, 16), torch.zeros(8), 1e-5)
    with pytest.raises(RuntimeError, match=r"weight must be bfloat16 \[16\]"):
        torch.ops.tandem.rms_norm(torch.zeros(2, 16).bfloat16(), torch.zeros(16), 1e-5)
    with pytest.raises(RuntimeError, match=r"x must be float32 or bfloat16 \[rows, n\]"):
        torch.ops.tandem.rms_norm(torch.zeros(2, 16).half(), torch.zeros(16).half(), 1e-5)
    with pytest.raises(RuntimeError, match=r"h and delta must have the same shape"):
        torch.ops.tandem.add_rms_norm_(torch.zeros(2, 16), torch.zeros(3, 16), torch.zeros(16), 1e-5)
    with pytest.raises(RuntimeError, match=r"same shape and dtype \(or a bfloat16 delta beside a float32 h\), got "
                                           r"bfloat16 \[2, 16\] and float32 \[2, 16\]"):
        torch.ops.tandem.add_rms_norm_(torch.zeros(2, 16).bfloat16(), torch.zeros(2, 16), torch.zeros(16).bfloat16(),
                                       1e-5)
    with pytest.raises(RuntimeError, match=r"rms_norm: out_dtype must be float32 or bfloat16, got Half"):
        torch.ops.tandem.rms_norm(torch.zeros(2, 16), torch.zeros(16), 1e-5, torch.float16)
    with pytest.raises(RuntimeError, match=r"silu_mul: out_dtype must be float32 or bfloat16, got Half"):
        torch.ops.tandem.silu_mul(torch.zeros(2, 32), torch.float16)
    with pytest.raises(RuntimeError, match=r"rope_ needs a head_dim that is a multiple of 16, got 24"):
        torch.ops.tandem.rope_(torch.zeros(2, 1, 24), torch.zeros(2, 24), torch.zeros(2, 24))
    with pytest.raises(RuntimeError, match=r"cos and sin must be contiguous float32 with tokens \* head_dim = 32"):
        torch.ops.tandem.rope_(torch.zeros(2, 1, 16), torch.zeros(2, 8), torch.zeros(2, 8))
    with pytest.raises(RuntimeError, match=r"gate_up must have 2F columns, F a multiple of 8, got 20"):
        torch.ops.tandem.silu_mul(torch.zeros(2, 20))
