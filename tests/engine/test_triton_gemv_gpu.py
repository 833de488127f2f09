"""Small products on CUDA by the Triton GEMV (`tandem.kernels.triton_gemv`) against cuBLAS's
`F.linear` and against float64, in bfloat16 and float16.

Every configuration must give the same bits (the timed choice between them may not change a
result), each within 16-bit rounding of the exact product, and `Linear` must send decode-sized
batches to it and larger ones to cuBLAS."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels import linear as linear_mod
from tandem.kernels.linear import GEMV_MAX_ROWS, Linear

pytestmark = pytest.mark.gpu

triton_gemv = pytest.importorskip("tandem.kernels.triton_gemv", reason="Triton comes with torch's CUDA build")

DTYPES = [torch.bfloat16, torch.float16]


def operands(rows: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, k, generator=g, device="cuda").to(dtype)
    w = (torch.randn(n, k, generator=g, device="cuda") / k**0.5).to(dtype)
    return x, w


def assert_rounding_of_exact(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y within a few units of 16-bit rounding of the float64 product (float32 sums of K terms)."""
    exact = x.double() @ w.double().T
    scale = (x.double().abs() @ w.double().abs().T)  # bounds the float32 summation error too
    bound = 2 * torch.finfo(y.dtype).eps * exact.abs() + 1e-5 * scale + torch.finfo(y.dtype).tiny
    err = (y.double() - exact).abs()
    assert bool((err <= bound).all()), f"max error {err.max().item()}, bound there {bound.flatten()[err.argmax()]}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 16])
def test_every_configuration_gives_the_same_bits_within_rounding(dtype, rows):
    x, w = operands(rows, 1000, 768, dtype)  # N not a multiple of any BLOCK_N: the masked last program
    outs = [triton_gemv.gemv(x, w, config) for config in triton_gemv.CONFIGS]
    for config, y in zip(triton_gemv.CONFIGS, outs):
        assert y.shape == (rows, 1000) and y.dtype == dtype
        assert torch.equal(y, outs[0]), f"{config} differs from {triton_gemv.CONFIGS[0]}"
    assert_rounding_of_exact(outs[0], x, w)
    assert_rounding_of_exact(F.linear(x, w), x, w)  # the same bound holds for cuBLAS


def test_rows_and_weight_may_be_strided_views():
    x, w = operands(4, 512, 1024, torch.bfloat16)
    wide = torch.zeros(4, 2048, dtype=torch.bfloat16, device="cuda")
    wide[:, 512:1536] = x
    view = wide[:, 512:1536]  # row stride 2048
    assert triton_gemv.takes(view, w)
    assert torch.equal(triton_gemv.gemv(view, w), triton_gemv.gemv(x, w))


def test_takes_only_what_it_can():
    x, w = operands(4, 256, 512, torch.bfloat16)
    assert triton_gemv.takes(x, w)
    assert not triton_gemv.takes(x.float(), w.float())  # float32 keeps cuBLAS (and HF's numerics)
    assert not triton_gemv.takes(torch.cat([x] * 5), w)  # 20 rows > MAX_ROWS
    assert not triton_gemv.takes(x[:, :384], w[:, :384])  # K not a multiple of BLOCK_K
    assert not triton_gemv.takes(x.T.contiguous().T, w)  # columns strided


def test_choose_times_once_and_remembers(caplog):
    x, w = operands(3, 2048, 1024, torch.bfloat16, seed=7)
    with caplog.at_level("INFO", logger="tandem.kernels"):
        config = triton_gemv.choose(x, w)
        assert triton_gemv.choose(x, w) is config
    assert config in triton_gemv.CONFIGS
    assert sum("projection (2048, 1024) at 3 rows" in r.getMessage() for r in caplog.records) == 1
    assert torch.equal(triton_gemv.linear(x, w), triton_gemv.gemv(x, w, config))


@torch.inference_mode()
def test_linear_sends_small_batches_to_the_gemv_and_large_ones_to_cublas():
    _, w = operands(1, 1536, 1024, torch.bfloat16, seed=3)
    bias = torch.randn(1536, device="cuda").to(torch.bfloat16)
    proj = Linear(w, bias)
    small, _ = operands(GEMV_MAX_ROWS, 1536, 1024, torch.bfloat16, seed=4)
    large, _ = operands(GEMV_MAX_ROWS + 1, 1536, 1024, torch.bfloat16, seed=5)
    assert torch.equal(proj(small), triton_gemv.linear(small, w) + bias)
    assert torch.equal(proj(large), F.linear(large, w, bias))
    linear_mod.use_triton_gemv(False)
    try:
        assert torch.equal(proj(small), F.linear(small, w, bias))
    finally:
        linear_mod.use_triton_gemv(True)
