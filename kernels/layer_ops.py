"""The small steps of a decoder layer between its projections: RMSNorm (with the residual add before
it), rotary embedding and SiLU-gated products.

The torch versions below are the reference (HF transformers' numerics). On a CPU that runs
tandem's kernels, float32 and bfloat16 tensors take `csrc/layer_ops.cpp` instead: one call where
torch takes five to eight ops, which is most of their cost at a decode step's few rows. Those calls
round as the torch code does (rotary embedding, SiLU products and residual adds bit for bit, in
either dtype); RMSNorm sums its squares in another order, so its output may differ in the last bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels.cpu_ops import cpu_ops_unavailable


_kernels_ready: list[bool] = []  # filled on first use: building them at import would slow every import


_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, n]."""
    if _native(x, weight) and x.shape[-1] % 8 == 0:
        return torch.ops.tandem.rms_norm(x, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta)); h may be updated in place."""
    if _native(h, delta, weight) and h.shape[-1] % 8 == 0:
        return h, torch.ops.tandem.add_rms_norm_(h, delta, weight, eps)
    h = h + delta
    return h, rms_norm(h, weight, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D], may be rotated in place; cos, sin: [T, 1, D]."""
    if _native(x, cos, sin) and x.stride(1) == x.shape[2] and x.stride(2) == 1 and x.shape[2] % 16 == 0 and cos.is_contiguous():
        torch.ops.tandem.rope_(x, cos, sin)
        return x
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2F] = [gate | up] -> silu(gate) * up."""
    if _native(gate_up) and gate_up.stride(-1) == 1 and gate_up.shape[-1] % 16 == 0:
        return torch.ops.tandem.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2F] = [gate | up] -> gelu(gate, tanh approximation) * up (Gemma's MLP; plain torch)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
