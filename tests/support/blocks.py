"""Block-quantized weights for the kernel tests, and the accuracy a float32 product must reach."""

from __future__ import annotations

import torch

from tandem.kernels.block_linear import BlockWeights


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
