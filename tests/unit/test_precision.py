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
        Precision.resolve(EngineConfig(gguf_blocks="2bit"), CPU, {})
    with pytest.raises(ValueError, match=r"--dtype='float64' is invalid: choose auto or one of float32, bfloat16"):
        Precision.resolve(EngineConfig(dtype="float64"), CPU, {})


def test_uniform_is_one_dtype_throughout():
    p = Precision.uniform(BF16)
    assert (p.weights, p.compute, p.prefill, p.kv, p.narrow_prefill) == (BF16, BF16, BF16, BF16, None)
