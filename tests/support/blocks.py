"""Block-quantized weights for the kernel tests, the accuracy a float32 product must reach, and what a
Linear asked for bfloat16 products gives."""

from __future__ import annotations

import torch

from tandem.kernels.block_linear import (BLOCK_MAX_ROWS, BlockWeights, Nibbles, NibbleStripes,
                                         bfloat16_blocks_unavailable, block_gemm_bf16, block_gemm_q4_stripes)
from tandem.kernels.linear import Linear
from tandem.kernels.weight_forms import BFLOAT16_MIN_ROWS, STRIPES_BFLOAT16_MIN_ROWS


def random_blocks(n: int, k: int, kind: str, seed: int) -> BlockWeights:
    g = torch.Generator().manual_seed(seed)
    shape = (n, k // 32)
    scale = (torch.rand(shape, generator=g) * 0.02).half().float()  # 16-bit scales, as in GGUF
    if kind == "q8_0":
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        offset = torch.zeros(shape)
    elif kind == "q4_0":  # values -8..7, no offset
        q = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
        offset = torch.zeros(shape)
    else:  # q4_1
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int8)
        offset = (-torch.rand(shape, generator=g) * 0.1).half().float()
    return BlockWeights(q, scale, offset)


def assert_float32_product(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y is x @ w.T summed in float32: within two float32 roundings of the sum of |x * w| of the
    float64 product (a sum in another order, or in float32 pieces, stays well inside that)."""
    ref = x.double() @ w.double().t()
    bound = 2 * 2.0**-24 * (x.double().abs() @ w.double().abs().t())
    worst = float(((y.double() - ref).abs() / bound).max())
    assert worst <= 1, f"off by {worst:.2f}x the float32 bound"


def assert_bfloat16_products(w: torch.Tensor, blocks: BlockWeights, x: torch.Tensor, form: type, float32_kernel) -> None:
    """A Linear over `w` and `blocks` asked for bfloat16 products keeps the blocks in `form` (no copy
    of w beside them; 4-bit blocks of whole stripes in stripes) and
    multiplies x's rows: above BLOCK_MAX_ROWS against a bfloat16 copy, from the Linear's
    `bfloat16_min_rows` (BFLOAT16_MIN_ROWS, STRIPES_BFLOAT16_MIN_ROWS for stripes) up to it the same
    blocks in bfloat16 where the CPU has AVX512-BF16, otherwise with `float32_kernel` over them (in
    stripes, their float32 form)."""
    halves = Linear(w, None, blocks, prefill_dtype=torch.bfloat16)
    native = bfloat16_blocks_unavailable() is None
    striped = form is Nibbles and w.shape[0] % NibbleStripes.STRIPE == 0
    assert isinstance(halves.blocks, NibbleStripes if striped else form)
    assert halves.bfloat16_blocks == native and halves.weight is None
    if native:
        assert halves.bfloat16_min_rows == (STRIPES_BFLOAT16_MIN_ROWS if striped else BFLOAT16_MIN_ROWS)
    rows = x.shape[0]
    if rows > BLOCK_MAX_ROWS:
        want = Linear(w.bfloat16())(x.bfloat16()).float()
    elif native and rows >= halves.bfloat16_min_rows:
        want = block_gemm_bf16(x, halves.blocks)
    elif striped:
        want = block_gemm_q4_stripes(x, halves.blocks, exact=True)
    else:
        want = float32_kernel(x, halves.blocks)
    torch.testing.assert_close(halves(x), want, rtol=0, atol=0)
