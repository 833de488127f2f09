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



def test_auto_dtype_is_bfloat16_only_where_it_is_native(monkeypatch):
    from tandem.server.model import precision

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(precision, "runnable_flags", lambda: ["avx2", "fma", "avx512f"])
    dtype, why = precision.resolve_dtype("auto", cpu)
    assert dtype == "float32" and "neither AVX512-BF16 nor AMX" in why
    monkeypatch.setattr(precision, "runnable_flags", lambda: ["avx2", "avx512f", "avx512_bf16"])
    assert precision.resolve_dtype("auto", cpu) == ("bfloat16", "auto: this CPU multiplies bfloat16 natively (avx512_bf16)")
    assert precision.resolve_dtype("auto", cuda)[0] == "bfloat16"
    assert precision.resolve_dtype("float32", cpu) == ("float32", "asked for")


def test_auto_dtype_is_float32_where_the_block_kernels_decode(monkeypatch):
    from tandem.server.model import precision

    cpu = torch.device("cpu")
    monkeypatch.setattr(precision, "runnable_flags", lambda: ["avx2", "fma", "avx512f", "avx512_bf16"])
    monkeypatch.setattr(precision, "cpu_ops_unavailable", lambda: None)
    dtype, why = precision.resolve_dtype("auto", cpu, block_weights=True)
    assert dtype == "float32" and "int8 blocks" in why
    assert precision.resolve_dtype("auto", cpu, block_weights=False)[0] == "bfloat16"  # safetensors: no blocks
    assert precision.resolve_dtype("auto", torch.device("cuda"), block_weights=True)[0] == "bfloat16"
    monkeypatch.setattr(precision, "runnable_flags", lambda: ["avx2", "fma", "avx512_bf16", "amx_bf16"])
    dtype, why = precision.resolve_dtype("auto", cpu, block_weights=True)
    assert dtype == "bfloat16" and why.endswith("with AMX, faster than float32 with the GGUF file's int8 blocks")
    dtype, why = precision.resolve_dtype("auto", cpu, block_weights=True, four_bit=True)  # 4-bit blocks beat AMX too
    assert dtype == "float32" and "4-bit blocks" in why
    # AMX listed but faulting is left out of runnable_flags (tandem.kernels.isa): no AMX, so the blocks
    monkeypatch.setattr(precision, "runnable_flags", lambda: ["avx2", "fma", "avx512_bf16"])
    dtype, why = precision.resolve_dtype("auto", cpu, block_weights=True)
    assert dtype == "float32" and "int8 blocks" in why
    monkeypatch.setattr(precision, "cpu_ops_unavailable", lambda: "TANDEM_CPU_KERNELS=0")
    dtype, why = precision.resolve_dtype("auto", cpu, block_weights=True)
    assert dtype == "bfloat16" and why.endswith("cannot run: TANDEM_CPU_KERNELS=0")


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


def test_prefill_dtype_auto_rounds_only_where_dtype_was_auto_and_bfloat16_is_native(monkeypatch):
    from tandem.server.model import precision

    cpu = torch.device("cpu")
    monkeypatch.setattr(precision, "onednn_supports", lambda dtype: True)
    monkeypatch.setattr(precision, "runnable_flags", lambda: ["avx2", "fma", "avx512_bf16"])
    assert precision.resolve_prefill_dtype("auto", "auto", "float32", cpu)[0] == "bfloat16"
    assert precision.resolve_prefill_dtype("auto", "float32", "float32", cpu) == (
        "float32", "auto: --dtype float32 asked for exact math")
    assert precision.resolve_prefill_dtype("float32", "auto", "float32", cpu) == ("float32", "asked for")
    assert precision.resolve_prefill_dtype("auto", "auto", "bfloat16", cpu) == ("bfloat16", "as the weights")
    monkeypatch.setattr(precision, "runnable_flags", lambda: ["avx2", "fma"])
    assert precision.resolve_prefill_dtype("auto", "auto", "float32", cpu)[0] == "float32"
    assert precision.resolve_prefill_dtype("bfloat16", "float32", "float32", cpu) == ("bfloat16", "asked for")
    with pytest.raises(ValueError, match=r"--prefill-dtype=bfloat16 applies to float32 weights on a CPU; "
                                         r"here they are bfloat16 on cuda"):
        precision.resolve_prefill_dtype("bfloat16", "auto", "bfloat16", torch.device("cuda"))


def test_kv_cache_dtype_auto_is_bfloat16_only_beside_bfloat16_prompt_products_on_a_native_cpu(monkeypatch):
    from tandem.server.model import precision

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    f32, bf16 = torch.float32, torch.bfloat16
    monkeypatch.setattr(precision, "runnable_flags", lambda: ["avx2", "fma", "avx512_bf16"])
    assert precision.resolve_kv_dtype("auto", f32, bf16, cpu) == (
        bf16, "auto: prompt products in bfloat16 on this CPU (avx512_bf16); half the bytes for decode attention")
    assert precision.resolve_kv_dtype("auto", f32, f32, cpu) == (f32, "auto: as the math")  # --dtype float32: exact
    assert precision.resolve_kv_dtype("auto", bf16, bf16, cpu)[0] == bf16
    assert precision.resolve_kv_dtype("float32", f32, bf16, cpu) == (f32, "asked for")
    assert precision.resolve_kv_dtype("bfloat16", f32, f32, cpu) == (bf16, "asked for")
    assert precision.resolve_kv_dtype("auto", bf16, bf16, cuda)[0] == bf16
    monkeypatch.setattr(precision, "runnable_flags", lambda: ["avx2", "fma"])  # bfloat16 prompts forced, not native
    assert precision.resolve_kv_dtype("auto", f32, bf16, cpu)[0] == f32
    with pytest.raises(ValueError, match=r"--kv-cache-dtype='float16' is invalid: choose auto, float32 or bfloat16"):
        precision.resolve_kv_dtype("float16", f32, f32, cpu)
    with pytest.raises(ValueError, match=r"--kv-cache-dtype=float32 on cuda: the KV cache there keeps the compute "
                                         r"dtype, bfloat16"):
        precision.resolve_kv_dtype("float32", bf16, bf16, cuda)
    with pytest.raises(ValueError, match=r"--kv-cache-dtype=bfloat16 with float16 math"):
        precision.resolve_kv_dtype("bfloat16", torch.float16, torch.float16, cpu)
