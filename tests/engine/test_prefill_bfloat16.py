"""The one inexact fast path of float32 serving: projections over many rows in bfloat16
(`--prefill-dtype`, auto on CPUs with AVX512-BF16): prefill chunks and decode batches of more than
8 rows against a bfloat16 copy of each weight, decode batches of 5 to 8 rows against the GGUF blocks
in whichever form they are held (`block_gemm_bf16`, where the CPU has AVX512-BF16: the file's 4-bit
and 8-bit blocks, or int8 blocks with `--gguf-blocks int8`; the 4-bit blocks, held there in stripes,
from 2 rows); the attention of prompt pieces; and
beside them, where bfloat16 is native, a bfloat16 KV cache (`--kv-cache-dtype auto`). Against HF
transformers in float32 on the same GGUF weights: teacher-forced logits within TOLERANCE, and greedy
output equal up to the first position where the reference's top-2 logit gap is below TOLERANCE.
Loaded with the path forced on, so it runs on every CPU (the copy's products emulated where bfloat16
is not native: slower, within the same tolerance; the blocks' products exact float32 there, as the
CPU lacks the instruction)."""

from __future__ import annotations

import pytest
import torch

from support.checks import assert_greedy_matches_reference
from support.logits import assert_logits_close, teacher_forced_logits
from support.prompts import prompts
from tandem.kernels import layer_ops
from tandem.kernels.block_linear import (BLOCK_MAX_ROWS, BlockWeights, Bytes, Nibbles, NibbleStripes,
                                         bfloat16_blocks_unavailable)
from tandem.kernels.linear import use_stripes
from tandem.kernels.weight_forms import BFLOAT16_MIN_ROWS

NEW_TOKENS = 24
# Measured on the prompts below (19 to 1,710 tokens): this path's logits are off by 0.06-0.08 on
# average; HF transformers' own model with bfloat16 weights by 0.11-0.20, and by up to 1.41 at worst.
# The worst logit of a prompt is a tail statistic: float32 changes of one ulp before a bfloat16
# rounding (RMSNorm summing its squares in another order, or in float64) move it between 0.48 and
# 1.05 on the same prompts. The bound is HF's own bfloat16 model at its worst.
TOLERANCE = 1.4  # largest logit error; also the top-2 gap below which greedy output may diverge
MEAN_TOLERANCE = 0.15


def assert_close_to_reference(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert_logits_close(got, want, what, TOLERANCE, MEAN_TOLERANCE, rounding=1e-3)


def test_every_projection_over_eight_rows_is_bfloat16(smollm_bf16_prefill):
    module = smollm_bf16_prefill.module
    linears = [module.lm_head] + [getattr(layer, n) for layer in module.layers for n in ("qkv", "o", "gate_up", "down")]
    assert all(linear.prefill is not None and linear.prefill.weight.dtype == torch.bfloat16 for linear in linears)


def test_prompt_steps_hand_bfloat16_between_the_products_without_changing_a_bit(smollm_bf16_prefill, monkeypatch):
    """Between a prompt piece's bfloat16 products, the norms and SiLU products hand over bfloat16 and
    the o and down products their bfloat16 results (`DecoderLayer.narrow`): the same logits, bit for
    bit, as float32 tensors rounded on their way into each product. Decode-sized pieces stay float32."""
    from tandem.server.model import llama

    module = smollm_bf16_prefill.module
    assert all(layer.narrow for layer in module.layers)
    ids = prompts(smollm_bf16_prefill.tokenizer)[5]
    assert len(ids) > BLOCK_MAX_ROWS
    handed = []  # what each layer's SiLU products were rounded to

    def silu_mul(gate_up, out_dtype=None):
        handed.append((gate_up.dtype, out_dtype))
        return layer_ops.silu_mul(gate_up, out_dtype)

    monkeypatch.setattr(llama, "silu_mul", silu_mul)
    narrow = teacher_forced_logits(smollm_bf16_prefill, ids, decode_steps=2)
    layers = len(module.layers)  # the prompt piece in bfloat16; decode steps (fused where they can be) in float32
    assert handed[:layers] == [(torch.bfloat16, torch.bfloat16)] * layers
    assert all(out_dtype is None for _, out_dtype in handed[layers:])
    try:
        for layer in module.layers:
            layer.narrow = False
        wide = teacher_forced_logits(smollm_bf16_prefill, ids, decode_steps=2)
    finally:
        for layer in module.layers:
            layer.narrow = True
    assert torch.equal(narrow, wide)


def test_teacher_forced_logits_are_close_to_the_float32_reference(smollm_bf16_prefill, hf_reference):
    ids = prompts(smollm_bf16_prefill.tokenizer)
    for p in (ids[3], ids[5], ids[7], ids[9]):  # ~20 to 1,200+ tokens: every one a product of more than 8 rows
        with torch.inference_mode():
            want = hf_reference.model(torch.tensor([p])).logits[0].float()
        assert_close_to_reference(teacher_forced_logits(smollm_bf16_prefill, p), want, f"{len(p)} tokens")


@pytest.mark.parametrize("gguf_blocks", ["4bit", "int8"])
def test_decode_sized_products_round_against_the_blocks(hf_reference, smollm_bf16_prefill, gguf_blocks):
    """Prompts fed 6 tokens at a time: every product has as many rows as a 6-request decode step,
    which from BFLOAT16_MIN_ROWS multiplies the GGUF blocks in bfloat16: the file's own forms (the
    layers' Q4_1 blocks in 4 bits, in stripes; the LM head's Q8_0 in 8), or, with `--gguf-blocks int8`,
    int8 blocks. Without AVX512-BF16 they stay float32 products."""
    from tandem.server.config import EngineConfig
    from tandem.server.model.load import load_model

    loaded = smollm_bf16_prefill if gguf_blocks == "4bit" else load_model(EngineConfig(
        model="builtin:smollm2-135m", dtype="float32", device="cpu", prefill_dtype="bfloat16", gguf_blocks="int8"))
    piece = 6
    assert BFLOAT16_MIN_ROWS <= piece <= BLOCK_MAX_ROWS
    why = bfloat16_blocks_unavailable()
    module = loaded.module
    form = NibbleStripes if gguf_blocks == "4bit" else BlockWeights
    assert all(isinstance(layer.gate_up.blocks, form) and layer.gate_up.bfloat16_blocks == (why is None)
               for layer in module.layers)
    assert isinstance(module.lm_head.blocks, Bytes) and module.lm_head.bfloat16_blocks == (why is None)
    ids = prompts(loaded.tokenizer)
    for p in (ids[3], ids[5], ids[7]):
        with torch.inference_mode():
            want = hf_reference.model(torch.tensor([p])).logits[0].float()
        got = teacher_forced_logits(loaded, p, piece=piece)
        assert_close_to_reference(got, want, f"{len(p)} tokens, {piece} at a time")
        if why is not None:  # no AVX512-BF16 (the reason is the CPU's): the products stay float32, exact;
            # what rounds is the prompt pieces' attention (bfloat16 on every CPU, emulated there)
            assert why == "this CPU lacks AVX512-BF16, or faults on it" or why.startswith(
                "tandem's CPU kernels are unavailable")
            exact = teacher_forced_logits(loaded, p, piece=piece, float32_prompt_attention=True)
            torch.testing.assert_close(exact, want, rtol=1e-3, atol=1e-3)


def test_one_row_decode_steps_over_a_bfloat16_kv_cache_stay_within_the_tolerance(smollm_bf16_prefill, hf_reference):
    """`--kv-cache-dtype auto` keeps the cache in bfloat16 beside bfloat16 prompts where the CPU
    multiplies bfloat16 natively (forced here elsewhere): one-row decode steps, whose products are
    float32 and exact, then read K and V rounded to bfloat16, and write theirs rounded."""
    from tandem.server.config import EngineConfig
    from tandem.server.model.load import load_model

    loaded = smollm_bf16_prefill
    if loaded.precision.kv != torch.bfloat16:
        assert bfloat16_blocks_unavailable() is not None  # auto chose float32 only where bfloat16 is not native
        loaded = load_model(EngineConfig(model="builtin:smollm2-135m", dtype="float32", device="cpu",
                                         prefill_dtype="bfloat16", kv_cache_dtype="bfloat16"))
    assert loaded.precision.kv == torch.bfloat16
    ids = prompts(loaded.tokenizer)
    for p in (ids[3], ids[7]):
        with torch.inference_mode():
            want = hf_reference.model(torch.tensor([p])).logits[0].float()
        got = teacher_forced_logits(loaded, p, decode_steps=16)
        assert_close_to_reference(got, want, f"{len(p)} tokens, the last 16 one decode step each")


def test_greedy_output_matches_the_reference_up_to_a_near_tie(smollm_bf16_prefill, hf_reference):
    # 6 running at a time: prefill chunks in bfloat16, decode steps of 5 and 6 rows too (the file's
    # 4-bit and 8-bit blocks in bfloat16; the 4-bit ones in stripes from 2 rows), one-row steps exact
    assert_greedy_matches_reference(smollm_bf16_prefill, hf_reference, prompts(smollm_bf16_prefill.tokenizer),
                                    NEW_TOKENS, TOLERANCE, max_total_tokens=16384, page_size=16,
                                    chunked_prefill_size=256, max_running_requests=6)


def test_one_row_steps_over_the_stripes_are_float32s_product(hf_reference):
    """The 4-bit layers are held in stripes (`NibbleStripes`), whose steps of one row multiply in
    float32 (each column of x against the 4-bit values, the scales applied to the blocks' sums): every
    token of a prompt fed as a one-row decode step over a float32 KV cache gives HF's float32 logits as
    closely as the same model held as `Nibbles` (whose kernels rebuild every float32 weight) does."""
    from tandem.server.config import EngineConfig
    from tandem.server.model.load import load_model

    def load():
        return load_model(EngineConfig(model="builtin:smollm2-135m", dtype="float32", device="cpu",
                                       prefill_dtype="bfloat16", kv_cache_dtype="float32"))

    loaded = load()
    assert isinstance(loaded.module.layers[0].qkv.blocks, NibbleStripes)
    use_stripes(False)
    try:
        nibbles = load()
    finally:
        use_stripes(True)
    assert isinstance(nibbles.module.layers[0].qkv.blocks, Nibbles)
    ids = prompts(loaded.tokenizer)[5]
    with torch.inference_mode():
        want = hf_reference.model(torch.tensor([ids])).logits[0].float()
    errors = {}
    for name, model in (("stripes", loaded), ("nibbles", nibbles)):
        errors[name] = float((teacher_forced_logits(model, ids, decode_steps=len(ids)) - want).abs().max())
    assert errors["stripes"] < 2 * errors["nibbles"] + 1e-4 and errors["stripes"] < 1e-3, errors
