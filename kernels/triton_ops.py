"""The small steps of a decoder layer on CUDA, fused: one Triton kernel where torch launches five to
nine.

A decode step of an 8B model launches about forty kernels per layer, of which four are the
projections that read the weights; the others (RMSNorm with its residual add, rotary embedding,
SiLU-gated product) each touch a few kilobytes and cost a launch's latency on the GPU, replayed
from a CUDA graph or not. These kernels do each step in one launch (`layer_ops` calls them for
CUDA tensors in bfloat16 or float16; float32 keeps torch's ops, and HF's numerics to the bit).

They round where torch rounds: the residual add, each product of the rotary embedding and the
SiLU are rounded to the tensor's dtype before the next operation, as torch's separate ops do.
RMSNorm sums its squares in another order than torch, and Triton's exp and rsqrt are not torch's,
so those may differ from torch in the last bit of the output dtype (tests/engine/test_triton_ops_gpu.py).

Imported only where a CUDA tensor needs it: Triton is not installed with torch's CPU build.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(h_ptr, delta_ptr, w_ptr, out_ptr, stride_h, stride_delta, stride_out, n, eps,
                     HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    """One row: h += delta (rounded, stored back into h) when HAS_DELTA, then out = w * norm(h)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    dtype = out_ptr.dtype.element_ty
    x = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * stride_delta + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x + d).to(dtype)
        tl.store(h_ptr + row * stride_h + cols, x, mask=mask)
        x = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    normed = (x * inv_rms).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * normed).to(dtype), mask=mask)


@triton.jit
def _rope_kernel(qk_ptr, cos_ptr, sin_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, stride_t, stride_h, stride_v,
                 q_heads, kv_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_V: tl.constexpr,
                 STORE: tl.constexpr):
    """One token's q_heads + kv_heads heads rotated in place: x * cos + rotate_half(x) * sin, each
    product rounded. With STORE, the rotated heads from q_heads on (k's) and the token's v row are
    written into its slot of the paged cache too (unused pointers are never read without it)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, HALF)[None, :]
    mask = h < q_heads + kv_heads
    dtype = qk_ptr.dtype.element_ty
    first = qk_ptr + t * stride_t + h * stride_h + cols
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    table = t * 2 * HALF + cols
    cos1 = tl.load(cos_ptr + table).to(tl.float32)
    cos2 = tl.load(cos_ptr + table + HALF).to(tl.float32)
    sin1 = tl.load(sin_ptr + table).to(tl.float32)
    sin2 = tl.load(sin_ptr + table + HALF).to(tl.float32)
    out1 = ((x1 * cos1).to(dtype).to(tl.float32) + (-x2 * sin1).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)).to(dtype)
    tl.store(first, out1, mask=mask)
    tl.store(first + HALF, out2, mask=mask)
    if STORE:
        slot = tl.load(slots_ptr + t).to(tl.int64)
        width = kv_heads * 2 * HALF
        is_k = mask & (h >= q_heads)
        k_row = k_cache_ptr + slot * width + (h - q_heads) * (2 * HALF) + cols
        tl.store(k_row, out1, mask=is_k)
        tl.store(k_row + HALF, out2, mask=is_k)
        v_cols = tl.arange(0, BLOCK_V)
        v_mask = v_cols < width
        tl.store(v_cache_ptr + slot * width + v_cols, tl.load(v_ptr + t * stride_v + v_cols, mask=v_mask),
                 mask=v_mask)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, features, BLOCK: tl.constexpr):
    """silu(gate) * up over one block of one row of [gate | up]; silu rounded before the product."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < features
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + features + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (silu * up).to(dtype), mask=mask)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, stride_k, stride_v, width,
                     BLOCK: tl.constexpr):
    """One token's K and V rows (`width` values each) into their slot of the paged cache."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    tl.store(k_cache_ptr + slot * width + cols, tl.load(k_ptr + t * stride_k + cols, mask=mask), mask=mask)
    tl.store(v_cache_ptr + slot * width + cols, tl.load(v_ptr + t * stride_v + cols, mask=mask), mask=mask)


# No fused multiply-adds: a product rounded to the output dtype before a sum (as torch's separate
# ops round it) must not be contracted with that sum.
_ROUNDED = dict(enable_fp_fusion=False)


def _row_warps(n: int) -> int:
    return max(1, min(16, n // 256))


def takes_rows(x: torch.Tensor) -> bool:
    """Whether the row kernels take x: [T, n] with unit stride along n."""
    return x.dim() == 2 and x.stride(1) == 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None) -> torch.Tensor:
    """weight * RMSNorm(x) for x: [T, n]. With `delta`, x += delta first, in place."""
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows,)](x, x if delta is None else delta, weight, out, x.stride(0),
                                  0 if delta is None else delta.stride(0), out.stride(0), n, eps,
                                  HAS_DELTA=delta is not None, BLOCK=block, num_warps=_row_warps(block), **_ROUNDED)
    return out


def takes_rope(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether the rotary kernel takes x: [T, heads, D] (unit stride along D, D/2 a power of two)
    with cos: [T, 1, D] contiguous."""
    half = x.shape[-1] // 2
    return x.dim() == 3 and x.stride(2) == 1 and half > 0 and half & (half - 1) == 0 and cos.is_contiguous()


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] rotated in place; cos, sin: [T, 1, D]."""
    tokens, heads, dim = x.shape
    if tokens:
        _rope_kernel[(tokens,)](x, cos, sin, x, x, x, x, x.stride(0), x.stride(1), 0, heads, 0, HALF=dim // 2,
                                BLOCK_H=triton.next_power_of_2(heads), BLOCK_V=1, STORE=False, num_warps=4,
                                **_ROUNDED)
    return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2F] = [gate | up] -> silu(gate) * up."""
    rows, features = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, features), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(features))
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(features, block))](gate_up, out, gate_up.stride(0), out.stride(0),
                                                               features, BLOCK=block, num_warps=4, **_ROUNDED)
    return out


def takes_kv(k: torch.Tensor) -> bool:
    """Whether `store_kv` takes k (or v): [T, heads, D] with each token's heads contiguous."""
    return k.dim() == 3 and k.stride(2) == 1 and k.stride(1) == k.shape[2]


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """k, v: [T, heads, D] into flat `slots` of one layer's contiguous [pages, page_size, heads, D]
    caches, in one launch."""
    tokens, width = k.shape[0], k.shape[1] * k.shape[2]
    if tokens:
        _store_kv_kernel[(tokens,)](k, v, k_cache, v_cache, slots, k.stride(0), v.stride(0), width,
                                    BLOCK=triton.next_power_of_2(width), num_warps=4)


def rope_store_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_heads: int, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """`apply_rope_(qk, cos, sin)` and `store_kv(k_cache, v_cache, slots, qk[:, q_heads:], v)` in one
    launch (the same kernel): qk [T, q_heads + kv_heads, D] (the rotary kernel's layout), v [T, kv_heads, D]
    (`takes_kv`), each layer's cache contiguous [pages, page_size, kv_heads, D]."""
    tokens, heads, dim = qk.shape
    if tokens:
        width = (heads - q_heads) * dim
        _rope_kernel[(tokens,)](qk, cos, sin, v, k_cache, v_cache, slots, qk.stride(0), qk.stride(1), v.stride(0),
                                q_heads, heads - q_heads, HALF=dim // 2, BLOCK_H=triton.next_power_of_2(heads),
                                BLOCK_V=triton.next_power_of_2(width), STORE=True, num_warps=4, **_ROUNDED)
