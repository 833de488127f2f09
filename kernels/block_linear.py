"""Projections over block-quantized weights: the form a GGUF file stores them in, streamed as int8.

GGUF's Q8_0, Q4_0 and Q4_1 tensors hold each run of 32 weights as small integers with a 16-bit
scale (and, for Q4_1, a 16-bit offset): `w = q * scale + offset`. The loader keeps them as
`BlockWeights` (q widened to int8, scale and offset widened to float32) next to the dequantized
float32 weights. `block_gemm` (a C++ operator, kernels/csrc/block_gemm.cpp, built with torch's
extension builder on first use and cached) rebuilds each weight in float32 with one fused
multiply-add, which gives the dequantized value bit for bit, and multiplies in float32: the
arithmetic is float32's, the bytes streamed per weight are 1.25 instead of 4.

It pays where decoding is bound by weight bandwidth, a few rows at a time; larger batches go to
oneDNN (`Linear` picks per call; `BLOCK_MAX_ROWS`). `tandem bench linear` measures both.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.common.cpu import cpu_flags

log = logging.getLogger("tandem.kernels")

BLOCK = 32
# Up to this many rows the int8 blocks beat oneDNN's float32 (measured on a 2-core AVX2 EPYC over
# all of SmolLM2's projections: 2.0x at 1 row, 1.4x at 8, 0.9x at 16).
BLOCK_MAX_ROWS = 8
_SOURCE = Path(__file__).parent / "csrc" / "block_gemm.cpp"
_REQUIRED_FLAGS = ("avx2", "fma")


@dataclass
class BlockWeights:
    """A [N, K] weight as `q * scale + offset` over 32-wide blocks of each row."""

    q: torch.Tensor  # [N, K] int8
    scale: torch.Tensor  # [N, K // 32] float32
    offset: torch.Tensor  # [N, K // 32] float32

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        blocks = torch.addcmul(self.offset[..., None], self.q.view(n, k // BLOCK, BLOCK).float(), self.scale[..., None])
        return blocks.view(n, k)

    def rows(self, index) -> BlockWeights:
        return BlockWeights(self.q[index].contiguous(), self.scale[index].contiguous(), self.offset[index].contiguous())

    @staticmethod
    def cat(parts: list[BlockWeights]) -> BlockWeights:
        return BlockWeights(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "scale", "offset")))


_lock = threading.Lock()
_state: dict[str, object] = {}


def block_kernel_unavailable() -> str | None:
    """None when `block_gemm` can run here, else why not. Builds the operator on first call
    (about a minute with two cores; cached under $TORCH_EXTENSIONS_DIR afterwards)."""
    with _lock:
        if "why" not in _state:
            _state["why"] = _load()
        return _state["why"]


def _load() -> str | None:
    if os.environ.get("TANDEM_BLOCK_KERNEL", "1") == "0":
        return "TANDEM_BLOCK_KERNEL=0"
    flags = cpu_flags()
    missing = [f for f in _REQUIRED_FLAGS if f not in flags]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    try:
        from torch.utils.cpp_extension import load

        load("tandem_block_gemm", [str(_SOURCE)], extra_cflags=["-O3", "-mavx2", "-mfma"], is_python_module=False)
    except Exception as e:  # no compiler, no ninja: serve with float32 weights
        log.warning("block-quantized kernel unavailable, using float32 weights: %s", e)
        return f"the kernel did not build: {type(e).__name__}: {str(e)[:200]}"
    return None


def block_gemm(x: torch.Tensor, w: BlockWeights) -> torch.Tensor:
    """x [M, K] float32 @ w.T -> [M, N] float32."""
    return torch.ops.tandem.block_gemm(x, w.q, w.scale, w.offset)
