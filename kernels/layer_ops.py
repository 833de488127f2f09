"""The small steps of a decoder layer between its projections: RMSNorm (with the residual add before
it), rotary embedding and SiLU-gated products.

The torch versions below are the reference (HF transformers' numerics). On a CPU that runs
tandem's kernels, float32 and bfloat16 tensors take `csrc/layer_ops.cpp` instead: one call where
torch takes five to eight ops, which is most of their cost at a decode step's few rows. Those calls
round as the torch code does (rotary embedding, SiLU products and residual adds bit for bit, in
either dtype); RMSNorm sums its squares in another order, so its output may differ in the last bit.
On CUDA, bfloat16 and float16 tensors take `triton_ops`' kernels, which round the same way (their
exp and rsqrt may differ from torch's in the last bit too); float32 keeps torch's ops there.

`out_dtype` (norms and SiLU products) rounds a result once to another dtype, and `add_rms_norm` takes
a bfloat16 delta beside a float32 residual stream: what a float32 model's prompt pieces hand between
their bfloat16 products (`DecoderLayer`), the values the float32 tensors would have had rounded on
their way into each product, without the copies.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from tandem.kernels.cpu_ops import cpu_ops_unavailable

log = logging.getLogger("tandem.kernels")

_kernels_ready: list[bool] = []  # filled on first use: building them at import would slow every import
_triton_ops: list = []  # the module, or None where Triton does not import; filled on first CUDA use
_fused_on_cuda = [True]  # `use_fused_cuda_ops(False)`: torch's ops on CUDA too (a baseline to measure against)
_FUSED_DTYPES = (torch.bfloat16, torch.float16)


def use_fused_cuda_ops(enabled: bool) -> None:
    """Whether CUDA tensors take the Triton kernels (the default) or torch's ops. Kernels already
    captured in a CUDA graph keep what they were captured with."""
    _fused_on_cuda[0] = enabled


def cuda_kernels(x: torch.Tensor, *others: torch.Tensor):
    """`triton_ops` where it takes x (a CUDA tensor in bfloat16 or float16; `others` of its dtype),
    else None."""
    if x.device.type != "cuda" or x.dtype not in _FUSED_DTYPES or not _fused_on_cuda[0]:
        return None
    for other in others:
        if other.dtype != x.dtype:
            return None
    if not _triton_ops:
        try:
            from tandem.kernels import triton_ops
        except ImportError as e:
            log.warning("Triton does not import (%s): the layers' small steps run as torch ops on CUDA", e)
            triton_ops = None
        _triton_ops.append(triton_ops)
    return _triton_ops[0]


_NATIVE_DTYPES = (torch.float32, torch.bfloat16)
_NATIVE_OUT = (None, *_NATIVE_DTYPES)  # the out_dtype values the native calls take


def _native(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether the native call takes x (and `others`, which must share its dtype)."""
    if x.dtype not in _NATIVE_DTYPES or x.device.type != "cpu":
        return False
    for other in others:  # a loop, not any(): this runs several times per layer
        if other.dtype != x.dtype:
            return False
    if not _kernels_ready:
        _kernels_ready.append(cpu_ops_unavailable() is None)
    return _kernels_ready[0]


def native_kernels(x: torch.Tensor) -> bool:
    """Whether x (a CPU tensor in float32 or bfloat16) takes tandem's native calls here, as the
    functions below decide it (a benchmark may turn them off)."""
    return _native(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x: [T, n]; the result rounded to `out_dtype` where given."""
    if _native(x, weight) and x.shape[-1] % 8 == 0 and out_dtype in _NATIVE_OUT:
        return torch.ops.tandem.rms_norm(x, weight, eps, out_dtype)
    fused = cuda_kernels(x, weight)
    if fused is not None and fused.takes_rows(x) and out_dtype is None:
        return fused.rms_norm(x, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(x.dtype)
    return out if out_dtype is None else out.to(out_dtype)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta)); h may be updated in place. delta: h's dtype, or bfloat16
    beside a float32 h (widened); the norm rounded to `out_dtype` where given."""
    widened = h.dtype == torch.float32 and delta.dtype == torch.bfloat16
    if _native(h, weight) and (delta.dtype == h.dtype or widened) and h.shape[-1] % 8 == 0 and out_dtype in _NATIVE_OUT:
        return h, torch.ops.tandem.add_rms_norm_(h, delta, weight, eps, out_dtype)
    fused = cuda_kernels(h, delta, weight)
    if fused is not None and fused.takes_rows(h) and fused.takes_rows(delta) and out_dtype is None:
        return h, fused.rms_norm(h, weight, eps, delta)
    h = h + delta  # a bfloat16 delta beside a float32 h: promoted, i.e. widened
    return h, rms_norm(h, weight, eps, out_dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D], may be rotated in place; cos, sin: [T, 1, D]."""
    if _native(x, cos, sin) and x.stride(1) == x.shape[2] and x.stride(2) == 1 and x.shape[2] % 16 == 0 and cos.is_contiguous():
        torch.ops.tandem.rope_(x, cos, sin)
        return x
    fused = cuda_kernels(x, cos, sin)
    if fused is not None and fused.takes_rope(x, cos) and sin.is_contiguous():
        return fused.apply_rope_(x, cos, sin)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def silu_mul(gate_up: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """[T, 2F] = [gate | up] -> silu(gate) * up, computed in gate_up's dtype; with `out_dtype`, in
    float32 from gate_up's values and rounded once to out_dtype."""
    if _native(gate_up) and gate_up.stride(-1) == 1 and gate_up.shape[-1] % 16 == 0 and out_dtype in _NATIVE_OUT:
        return torch.ops.tandem.silu_mul(gate_up, out_dtype)
    fused = cuda_kernels(gate_up)
    if fused is not None and fused.takes_rows(gate_up) and out_dtype is None:
        return fused.silu_mul(gate_up)
    if out_dtype is not None:
        return silu_mul(gate_up.float()).to(out_dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2F] = [gate | up] -> gelu(gate, tanh approximation) * up (Gemma's MLP; plain torch)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
