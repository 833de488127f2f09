"""Precision.resolve: the four dtype choices made once, in order, and the startup log's words for them."""

import pytest
import torch

from tandem.server.config import EngineConfig
from tandem.server.model import precision
from tandem.server.model.precision import Precision

CPU = torch.device("cpu")
F32, BF16 = torch.float32, torch.bfloat16


def test_auto_on_a_native_bfloat16_cpu_without_blocks_is_bfloat16_throughout(monkeypatch):
    monkeypatch.setattr(precision, "runnable_flags", lambda: ["avx2", "fma", "avx512_bf16"])
    p = Precision.resolve(EngineConfig(), CPU, {})
    assert (p.weights, p.compute, p.prefill, p.kv, p.narrow_prefill) == (BF16, BF16, BF16, BF16, None)
    assert p.describe() == ("bfloat16 weights (auto: this CPU multiplies bfloat16 natively (avx512_bf16)); batched "
                            "projections in bfloat16 (as the weights); KV cache in bfloat16 (auto: as the math)")


def test_auto_over_four_bit_blocks_keeps_float32_weights_with_bfloat16_prompts_and_kv(monkeypatch):
    monkeypatch.setattr(precision, "runnable_flags", lambda: ["avx2", "fma", "avx512_bf16"])
    monkeypatch.setattr(precision, "onednn_supports", lambda dtype: True)
    monkeypatch.setattr(precision, "cpu_ops_unavailable", lambda: None)
    monkeypatch.setattr(precision, "fits_four_bits", lambda blocks: True)
    p = Precision.resolve(EngineConfig(), CPU, {"w": object()})
    assert (p.weights, p.compute, p.prefill, p.kv, p.narrow_prefill, p.four_bit) == (F32, F32, BF16, BF16, BF16, True)
    assert "4-bit blocks" in p.weights_why
    int8 = Precision.resolve(EngineConfig(gguf_blocks="int8"), CPU, {"w": object()})
    assert not int8.four_bit and "int8 blocks" in int8.weights_why
    exact = Precision.resolve(EngineConfig(dtype="float32"), CPU, {"w": object()})  # asked: float32 throughout
    assert (exact.weights, exact.prefill, exact.kv, exact.narrow_prefill) == (F32, F32, F32, None)


def test_emulated_bfloat16_computes_in_float32_and_says_so(monkeypatch):
    monkeypatch.setattr(precision, "runnable_flags", lambda: ["avx2", "fma"])
    p = Precision.resolve(EngineConfig(dtype="bfloat16"), CPU, {})
    assert (p.weights, p.compute, p.kv) == (BF16, F32, F32)
    assert p.describe().startswith("bfloat16 weights (asked for; float32 math and KV cache: this CPU has no native "
                                   "bfloat16 instructions); ")


def test_flags_no_precision_can_follow_are_refused_by_name():
    with pytest.raises(ValueError, match=r"--gguf-blocks='2bit' is invalid: choose 4bit or int8"):
        precision.check(EngineConfig(gguf_blocks="2bit"))
    with pytest.raises(ValueError, match=r"--dtype='float64' is invalid: choose auto or one of float32, bfloat16"):
        precision.check(EngineConfig(dtype="float64"))


def test_uniform_is_one_dtype_throughout():
    p = Precision.uniform(BF16)
    assert (p.weights, p.compute, p.prefill, p.kv, p.narrow_prefill) == (BF16, BF16, BF16, BF16, None)


def test_auto_dtype_is_bfloat16_only_where_it_is_native(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(precision, "runnable_flags", lambda: ["avx2", "fma", "avx512f"])
    dtype, why = precision.resolve_dtype("auto", cpu)
    assert dtype == "float32" and "neither AVX512-BF16 nor AMX" in why
    monkeypatch.setattr(precision, "runnable_flags", lambda: ["avx2", "avx512f", "avx512_bf16"])
    assert precision.resolve_dtype("auto", cpu) == ("bfloat16", "auto: this CPU multiplies bfloat16 natively (avx512_bf16)")
    assert precision.resolve_dtype("auto", cuda)[0] == "bfloat16"
    assert precision.resolve_dtype("float32", cpu) == ("float32", "asked for")


def test_auto_dtype_is_float32_where_the_block_kernels_decode(monkeypatch):
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


def test_prefill_dtype_auto_rounds_only_where_dtype_was_auto_and_bfloat16_is_native(monkeypatch):
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
