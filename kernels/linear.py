"""Projections with a fixed weight (`y = x @ W.T`), held in the form that runs fastest on the device.

On CPU the weight is reordered once, at load, into oneDNN's blocked layout and multiplied by
oneDNN (`mkldnn._linear_pointwise`). Measured on a 2-core AVX2 EPYC against `F.linear` (which
goes to MKL's sgemm; `tandem bench linear` repeats it): the same at prompt-sized batches and
1.4-3x faster at decode sizes, 1 to 32 rows, where MKL does not stream the weight at the machine's
bandwidth (the lm_head at 8 rows: 7.7 ms against 22 ms). Where oneDNN cannot take the weight's
dtype on this CPU (bfloat16 without AVX512-BF16), or off the CPU, the weight stays a plain tensor:
`F.linear` on CUDA and for 16-bit weights, `x @ W` with W stored [in, out] for float32 on CPU
(faster than F.linear at small batches there; for bfloat16 it is 8-40x slower).

A weight that came block-quantized from a GGUF file also keeps that form, and batches of up to
`BLOCK_MAX_ROWS` rows multiply it: in 4 bits as the file keeps Q4_0 and Q4_1 (`Nibbles`,
`block_gemm_q4`, 0.625 bytes a weight), Q8_0 as the file keeps it (`Bytes`, `block_gemm_q8`,
1.0625), otherwise as int8 blocks (`BlockWeights`, `block_gemm`, 1.25), instead of float32's 4. All
rebuild the file's values exactly. On a 2-core Xeon
(AVX512-BF16, AMX), all of SmolLM2's projections (`tandem bench linear --whole-model`): 10.98 ms at
1 row against the int8 blocks' 16.71, 24.08 at 8 rows against 30.53 (and against 37.51 for the int8
blocks in bfloat16, so no int8 blocks are kept beside the 4-bit ones).
A float32 weight may also have its products over many rows run in bfloat16 (`prefill_dtype`: prefill
chunks, decode batches of `BFLOAT16_MIN_ROWS` or more), which a CPU with AVX512-BF16 multiplies two
to three times as fast: above `BLOCK_MAX_ROWS` rows against a bfloat16 copy of the weight (oneDNN),
from `BFLOAT16_MIN_ROWS` up to it against the blocks, in whichever form they are held
(`block_gemm_bf16`). Inputs are rounded on the way in and products returned in float32. That is the
one inexact path here.

4-bit blocks whose rows make whole stripes of 16 are regrouped so (`NibbleStripes`), whose kernel
multiplies the 4-bit values as they are, 16 weight rows to a vector, the blocks' scales applied to
their sums (`block_gemm_q4_stripes`): in float32 (AVX-512, else AVX2), and where bfloat16 products are
asked and native, from `STRIPES_BFLOAT16_MIN_ROWS` rows with x rounded to bfloat16. All of SmolLM2's
projections and LM head in 4 bits (`tandem bench linear --whole-model`, 2-core Zen 5 EPYC), Nibbles
against stripes, both float32: 3.47 / 2.89 ms at 1 row, 4.00 / 3.18 at 2, 5.17 / 4.35 at 4, 8.30 /
6.84 at 8 with AVX-512; held to AVX2 (`TANDEM_CPU_ISA=avx2`) 4.95 / 3.31, 5.66 / 4.44, 7.11 / 6.45,
11.89 / 11.37; a whole decode step there (`tandem bench step --compare stripes`) 0.72x / 0.83x /
0.94x / 0.96x the time at 1 / 2 / 4 / 8 rows.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from tandem.kernels.block_linear import (BLOCK_MAX_ROWS, BlockWeights, Bytes, Nibbles, NibbleStripes,
                                         bfloat16_blocks_unavailable, block_gemm, block_gemm_bf16, block_gemm_q4,
                                         block_gemm_q4_stripes, block_gemm_q8)
from tandem.kernels.cpu_ops import cpu_ops_unavailable

log = logging.getLogger("tandem.kernels")

# The batch size oneDNN's weight layout is chosen for: 64 measured as good as the best hint at
# every batch size from 1 to 1024 rows.
PACK_BATCH_HINT = 64
# From this many rows, a product asked to run in bfloat16 does so against the blocks too; below it the
# float32 block kernels are bound by the weight's bytes, and rounding would buy little. All of
# SmolLM2's projections on a 2-core AVX512-BF16 EPYC (`tandem bench linear --whole-model`), float32
# int8 blocks against bfloat16 ones: 7.5 / 7.2 ms at 1 row, 10.8 / 8.9 at 4, 12.4 / 10.2 at 5,
# 18.5 / 14.1 at 8 (oneDNN bfloat16 at 8: 15.7; at 12 rows it wins: 16.8 against 19.6). The 4-bit
# blocks on a 2-core Zen 5 EPYC, float32 against bfloat16: 3.15 / 3.73 at 1 row, 4.90 / 4.74 at 4,
# 6.10 / 5.15 at 5, 7.90 / 6.33 at 8; the 8-bit ones 5.51 / 4.95 at 5, 7.72 / 5.83 at 8.
BFLOAT16_MIN_ROWS = 5
# The same for 4-bit blocks held in stripes (`NibbleStripes`), whose bfloat16 form pays from 2 rows:
# all of SmolLM2's projections and LM head in stripes (as above), float32 (AVX-512) against bfloat16:
# 2.89 / 2.63 ms at 1 row, 3.18 / 2.68 at 2, 4.35 / 2.99 at 4, 6.84 / 4.54 at 8. One row, a single
# stream's decode step, stays float32's product.
STRIPES_BFLOAT16_MIN_ROWS = 2


_stripes = [True]


def use_stripes(enabled: bool) -> None:
    """Whether Linears made from now on regroup 4-bit blocks in stripes where their rows allow (the default),
    or keep them as `Nibbles` (the baseline `tandem bench step --compare stripes` measures against)."""
    _stripes[0] = enabled


class Linear:
    """`y = x @ weight.T (+ bias)` for a weight given as [out, in] (HF's layout), and optionally
    the same weight block-quantized (`blocks`, which must dequantize to `weight` exactly) for
    small batches, and products over many rows in `prefill_dtype`. `four_bit`: blocks whose values
    fit 4 bits are kept and multiplied in that form (`Nibbles`), the int8 ones dropped."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, blocks: BlockWeights | None = None,
                 prefill_dtype: torch.dtype | None = None, four_bit: bool = True):
        self.bias = bias
        self.kind = "plain"
        self.blocks: BlockWeights | Nibbles | NibbleStripes | Bytes | None = None
        self.prefill = None  # Linear over the weight in prefill_dtype, for more than BLOCK_MAX_ROWS rows
        self.bfloat16_blocks = False  # products of bfloat16_min_rows to BLOCK_MAX_ROWS rows in bfloat16
        float32_on_cpu = weight.device.type == "cpu" and weight.dtype == torch.float32
        if blocks is not None and float32_on_cpu and cpu_ops_unavailable() is None:
            self.blocks = (four_bit and Nibbles.pack(blocks)) or Bytes.pack(blocks) or blocks
        if prefill_dtype not in (None, torch.float32) and float32_on_cpu:
            self.prefill = Linear(weight.to(prefill_dtype))
            self.bfloat16_blocks = (self.blocks is not None and prefill_dtype == torch.bfloat16
                                    and bfloat16_blocks_unavailable() is None)
        if isinstance(self.blocks, Nibbles) and _stripes[0]:
            self.blocks = NibbleStripes.from_nibbles(self.blocks) or self.blocks
        # from this many rows the blocks multiply in bfloat16 (BLOCK_MAX_ROWS + 1: never)
        self.bfloat16_min_rows = BLOCK_MAX_ROWS + 1
        if self.bfloat16_blocks:
            self.bfloat16_min_rows = STRIPES_BFLOAT16_MIN_ROWS if isinstance(self.blocks, NibbleStripes) else BFLOAT16_MIN_ROWS
        if self.blocks is not None and self.prefill is not None:
            self.weight = None  # every product goes to one of those two: no third copy
            self.kind = "none"
        elif weight.device.type == "cpu" and onednn_supports(weight.dtype):
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT)
            self.kind = "onednn"
        elif weight.device.type == "cpu" and weight.dtype == torch.float32:
            self.weight = weight.t().contiguous()  # [in, out]
            self.kind = "transposed"
        else:
            self.weight = weight.contiguous()

    def describe(self) -> str:
        own = None if self.weight is None else (
            {"onednn": "oneDNN-packed", "transposed": "x @ W ([in, out])", "plain": "F.linear"}[self.kind]
            + f" {str(self.weight.dtype).removeprefix('torch.')}")
        small = own if self.blocks is None else {Nibbles: "4-bit blocks", NibbleStripes: "4-bit blocks in stripes",
                                                 Bytes: "8-bit blocks"}.get(type(self.blocks), "int8 blocks")
        large = self.prefill.describe() if self.prefill is not None else own
        if self.bfloat16_blocks:
            below = self.bfloat16_min_rows - 1
            return (f"{small} up to {below} row{'s' if below > 1 else ''}, {small} in bfloat16 up to {BLOCK_MAX_ROWS}, "
                    f"{large} above")
        return own if small == large else f"{small} up to {BLOCK_MAX_ROWS} rows, {large} above"

    def streamed_bytes(self, rows: int) -> int:
        """Bytes of weight one product over `rows` rows reads."""
        if self.blocks is not None and rows <= BLOCK_MAX_ROWS:
            return self.blocks.nbytes()
        if self.prefill is not None and rows > BLOCK_MAX_ROWS:
            return self.prefill.streamed_bytes(rows)
        return self.weight.numel() * self.weight.element_size()

    def prefill_dtype_for(self, rows: int) -> torch.dtype | None:
        """The dtype a product over `rows` rows rounds its input to and runs in, where that is the
        prefill dtype (above BLOCK_MAX_ROWS rows); else None."""
        return self.prefill.weight.dtype if self.prefill is not None and rows > BLOCK_MAX_ROWS else None

    def __call__(self, x: torch.Tensor, keep: bool = False) -> torch.Tensor:
        """x @ W.T (+ bias), in float32 where the weight is; `keep`: a product run in the prefill
        dtype without a bias returns its result in that dtype, not widened to float32."""
        rows = x.shape[0]
        if self.blocks is not None and rows <= BLOCK_MAX_ROWS:
            if isinstance(self.blocks, NibbleStripes):
                y = block_gemm_q4_stripes(x, self.blocks, exact=rows < self.bfloat16_min_rows)
            elif rows >= self.bfloat16_min_rows:
                y = block_gemm_bf16(x, self.blocks)
            elif isinstance(self.blocks, Nibbles):
                y = block_gemm_q4(x, self.blocks)
            elif isinstance(self.blocks, Bytes):
                y = block_gemm_q8(x, self.blocks)
            else:
                y = block_gemm(x, self.blocks)
            return y if self.bias is None else y + self.bias
        if self.prefill is not None and rows > BLOCK_MAX_ROWS:
            y = self.prefill(x.to(self.prefill.weight.dtype))
            if self.bias is None:
                return y if keep else y.float()
            return y.float() + self.bias
        if self.kind == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        if self.kind == "transposed":
            y = x @ self.weight
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)


_ONEDNN_DTYPES: dict[torch.dtype, bool] = {}


def onednn_supports(dtype: torch.dtype) -> bool:
    """Whether oneDNN multiplies `dtype` natively on this CPU (float32 everywhere; 16-bit types
    only with the instructions for them), checked once per dtype with a small product."""
    if dtype not in _ONEDNN_DTYPES:
        ok = torch.backends.mkldnn.is_available()
        if ok and dtype != torch.float32:
            ok = (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()) or (
                dtype == torch.float16 and torch.ops.mkldnn._is_mkldnn_fp16_supported()
            )
        if ok:
            try:
                w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=dtype), PACK_BATCH_HINT)
                y = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8, dtype=dtype), w, None, "none", [], "")
                ok = bool((y == 8).all())
            except RuntimeError as e:
                log.info("oneDNN cannot multiply %s here (%s); using torch matmul", dtype, e)
                ok = False
        _ONEDNN_DTYPES[dtype] = ok
    return _ONEDNN_DTYPES[dtype]
