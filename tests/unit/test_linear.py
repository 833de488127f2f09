"""The projection kernel (`tandem.kernels.linear.Linear`) against float64 products: every form a
weight can be held in (oneDNN-packed, transposed, plain), every batch size a step uses."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.linear import Linear
from tandem.kernels.weight_forms import onednn_supports


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().t()
    return y if b is None else y + b.double()


@pytest.mark.parametrize("rows", [1, 3, 8, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_float32_on_cpu_is_onednn_and_exact_to_float32_rounding(rows, with_bias):
    torch.manual_seed(rows)
    w = torch.randn(960, 576) * 0.05
    b = torch.randn(960) if with_bias else None
    x = torch.randn(rows, 576)
    linear = Linear(w, b)
    # Every x86 and arm64 CPU build of torch has oneDNN: the fast path is the one the exactness
    # tests against HF transformers run.
    assert torch.backends.mkldnn.is_available() and linear.kind == "onednn"
    y = linear(x)
    assert y.shape == (rows, 960) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), reference(x, w, b), rtol=1e-5, atol=1e-5)
    # the same products as the plain float32 GEMM, to float32 rounding
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 8, 100])
def test_a_16_bit_dtype_onednn_cannot_take_here_goes_to_f_linear(rows):
    torch.manual_seed(0)
    w = (torch.randn(256, 128) * 0.05).bfloat16()
    b = torch.randn(256).bfloat16()
    x = torch.randn(rows, 128).bfloat16()
    linear = Linear(w, b)
    # not `x @ W`: for bfloat16 on CPU that is 8-40x slower than F.linear (tandem bench linear)
    assert linear.kind == ("onednn" if onednn_supports(torch.bfloat16) else "plain")
    y = linear(x)
    assert y.shape == (rows, 256) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), reference(x, w, b), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("rows", [1, 8, 9, 64])
def test_a_bfloat16_prefill_copy_serves_only_products_over_eight_rows(rows):
    torch.manual_seed(rows)
    w, b = torch.randn(256, 128) * 0.05, torch.randn(256)
    x = torch.randn(rows, 128)
    linear = Linear(w, b, prefill_dtype=torch.bfloat16)
    assert linear.describe().startswith("oneDNN-packed float32 up to 8 rows, ") and linear.describe().endswith(" bfloat16 above")
    y = linear(x)
    assert y.dtype == torch.float32
    if rows <= 8:  # decode steps stay exact
        torch.testing.assert_close(y, Linear(w, b)(x), rtol=0, atol=0)
        assert linear.streamed_bytes(rows) == w.numel() * 4
    else:
        torch.testing.assert_close(y, Linear(w.bfloat16())(x.bfloat16()).float() + b, rtol=0, atol=0)
        assert linear.streamed_bytes(rows) == w.numel() * 2
    # within bfloat16's rounding of both factors (8 bits of mantissa, 128 products)
    torch.testing.assert_close(y.double(), reference(x, w, b), rtol=2e-2, atol=2e-2)


def test_only_float32_weights_on_a_cpu_keep_a_prefill_copy():
    assert Linear(torch.randn(16, 16).bfloat16(), prefill_dtype=torch.bfloat16).prefill is None
    assert Linear(torch.randn(16, 16), prefill_dtype=torch.float32).prefill is None
