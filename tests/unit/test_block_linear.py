"""Block-quantized projections: GGUF's Q4_0, Q4_1 and Q8_0 tensors read into `BlockWeights`
(dequantizing bit for bit to what gguf's own dequantizer gives), and `block_gemm` against float64
products of the dequantized weights, through `Linear` (asked for int8 blocks) at every batch size a
step uses. The 4-bit form of the same blocks: test_block_q4.py."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tandem.common.cpu import cpu_flags
from tandem.kernels.block_linear import (BLOCK_MAX_ROWS, BlockWeights, Bytes, Nibbles, bfloat16_blocks_unavailable,
                                         block_gemm, block_gemm_bf16)
from tandem.kernels.cpu_ops import cpu_ops_unavailable
from tandem.kernels.linear import Linear
from tandem.kernels.weight_forms import BFLOAT16_MIN_ROWS
from tandem.server.model.config import ModelConfig
from tandem.server.model.loader import ModelSource, _unpermute, load_block_weights

from support.blocks import assert_float32_product, random_blocks

if not all(flag in cpu_flags() for flag in ("avx2", "fma")):
    pytest.skip("block_gemm is built for AVX2 + FMA; this CPU lacks them", allow_module_level=True)


def test_the_kernel_builds_here():
    # setup.sh installs g++ and ninja; a CPU with AVX2 and FMA must get the kernel, not a fallback
    assert cpu_ops_unavailable() is None


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16, 64])
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("k", [576, 1536])  # tiles of 8 rows of x, and of 4 (what fits L1 at that width)
def test_block_gemm_matches_float64_products_of_the_dequantized_weight(rows, kind, k):
    blocks = random_blocks(1000, k, kind, seed=rows)  # 1000 rows: chunks of 64 and a remainder
    w = blocks.dequantize()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7))
    y = block_gemm(x, blocks)
    assert y.shape == (rows, 1000) and y.dtype == torch.float32
    assert_float32_product(y, x, w)
    # a transposed (non-contiguous) x gives the same rows
    torch.testing.assert_close(block_gemm(x.t().contiguous().t(), blocks), y, rtol=0, atol=0)


@pytest.mark.parametrize("rows", [1, 4, BLOCK_MAX_ROWS, BLOCK_MAX_ROWS + 1, 100])
def test_linear_uses_blocks_up_to_the_row_limit_and_onednn_above(rows):
    blocks = random_blocks(320, 576, "q4_1", seed=1)
    w = blocks.dequantize()
    bias = torch.randn(320)
    linear = Linear(w, bias, blocks, four_bit=False)
    assert linear.blocks is blocks and "int8 blocks" in linear.describe()
    x = torch.randn(rows, 576)
    y = linear(x)
    if rows <= BLOCK_MAX_ROWS:
        torch.testing.assert_close(y, block_gemm(x, blocks) + bias, rtol=0, atol=0)
    else:
        torch.testing.assert_close(y, Linear(w, bias)(x), rtol=0, atol=0)
    torch.testing.assert_close(y.double(), x.double() @ w.double().t() + bias.double(), rtol=1e-5, atol=1e-5)


def test_linear_ignores_blocks_for_weights_that_are_not_float32():
    blocks = random_blocks(64, 64, "q8_0", seed=2)
    linear = Linear(blocks.dequantize().bfloat16(), None, blocks)
    assert linear.blocks is None


HAS_BF16 = "avx512_bf16" in cpu_flags()


BFLOAT16_FORMS = {"int8": (lambda b: b, "block_gemm_bf16"), "4-bit": (Nibbles.pack, "block_gemm_q4_bf16"),
                  "8-bit": (Bytes.pack, "block_gemm_q8_bf16")}


@pytest.mark.parametrize("rows", [1, 5, 8, 11])
@pytest.mark.parametrize("kind,form", [("q4_1", "int8"), ("q8_0", "int8"), ("q4_1", "4-bit"), ("q4_0", "4-bit"),
                                       ("q8_0", "8-bit")])
@pytest.mark.parametrize("k", [576, 1536])
def test_block_gemm_bf16_matches_float64_products_of_the_rounded_operands(rows, kind, form, k):
    """Each weight rebuilt, then rounded to bfloat16 as torch rounds (nearest even), x likewise, and
    the products summed in float32: equal to float64 sums of the rounded operands to float32's
    accuracy, and nowhere near that close to the unrounded product (so the rounding happened). For
    the int8 blocks and for GGUF's own 4-bit and 8-bit forms of them."""
    pack, op = BFLOAT16_FORMS[form]
    blocks = pack(random_blocks(1000, k, kind, seed=rows))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(8))
    if not HAS_BF16:  # the library is built everywhere; the operator refuses a CPU it cannot run on
        assert bfloat16_blocks_unavailable() == "this CPU lacks AVX512-BF16, or faults on it"
        with pytest.raises(RuntimeError, match=f"{op} needs a CPU with AVX512-BF16"):
            block_gemm_bf16(x, blocks)
        return
    assert bfloat16_blocks_unavailable() is None
    y = block_gemm_bf16(x, blocks)
    assert y.shape == (rows, 1000) and y.dtype == torch.float32
    rounded = x.bfloat16().double() @ blocks.dequantize().bfloat16().double().t()
    torch.testing.assert_close(y.double(), rounded, rtol=1e-5, atol=1e-5)
    exact = x.double() @ blocks.dequantize().double().t()
    assert float((y.double() - exact).abs().max()) > 1e-3
    torch.testing.assert_close(block_gemm_bf16(x.t().contiguous().t(), blocks), y, rtol=0, atol=0)


@pytest.mark.parametrize("tile_rows", range(1, 9))
def test_every_tile_height_gives_the_product(tile_rows):
    blocks = random_blocks(200, 1536, "q4_1", seed=tile_rows)
    x = torch.randn(11, 1536, generator=torch.Generator().manual_seed(9))  # whole tiles and a remainder
    assert_float32_product(block_gemm(x, blocks, tile_rows=tile_rows), x, blocks.dequantize())


def test_block_gemm_rejects_tile_heights_it_has_no_kernel_for():
    blocks = random_blocks(64, 64, "q8_0", seed=3)
    for bad in (-1, 9):
        with pytest.raises(RuntimeError, match=f"tile_rows must be 0 \\(as many as fit L1\\) or 1-8, got {bad}"):
            block_gemm(torch.randn(2, 64), blocks, tile_rows=bad)


def test_block_gemm_rejects_shapes_it_cannot_take():
    blocks = random_blocks(64, 64, "q8_0", seed=3)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        block_gemm(torch.randn(2, 48), BlockWeights(blocks.q[:, :48].contiguous(), blocks.scale, blocks.offset))
    with pytest.raises(RuntimeError, match="float32"):
        block_gemm(torch.randn(2, 64).double(), blocks)


def test_gguf_blocks_read_back_exactly_as_gguf_dequantizes_them(tmp_path):
    """A GGUF with Q4_0, Q4_1 and Q8_0 tensors (q and k rows reordered the llama.cpp way)."""
    config = ModelConfig(architecture="llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=1,
                         num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                         max_position_embeddings=128, tie_word_embeddings=True, attention_bias=False,
                         bos_token_id=None, eos_token_ids=(), name="tiny")
    rng = np.random.default_rng(0)
    Q = gguf.GGMLQuantizationType
    tensors = {
        "blk.0.attn_q.weight": (Q.Q4_0, (64, 64), "model.layers.0.self_attn.q_proj.weight", 4),
        "blk.0.attn_k.weight": (Q.Q4_1, (32, 64), "model.layers.0.self_attn.k_proj.weight", 2),
        "blk.0.ffn_up.weight": (Q.Q4_1, (128, 64), "model.layers.0.mlp.up_proj.weight", None),
        "token_embd.weight": (Q.Q8_0, (96, 64), "model.embed_tokens.weight", None),
        "output_norm.weight": (Q.F32, (64,), "model.norm.weight", None),
    }
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    expected = {}
    for name, (qtype, shape, key, heads) in tensors.items():
        data = rng.standard_normal(shape).astype(np.float32)
        stored = gguf.quants.quantize(data, qtype) if qtype != Q.F32 else data
        writer.add_tensor(name, stored, raw_shape=stored.shape if qtype == Q.F32 else None, raw_dtype=qtype)
        if qtype != Q.F32:
            dequantized = gguf.quants.dequantize(stored, qtype)
            expected[key] = torch.from_numpy(_unpermute(dequantized, heads) if heads else dequantized)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    blocks = load_block_weights(ModelSource("gguf", path, "tiny"), config)
    assert set(blocks) == set(expected)  # the float32 norm has no blocks
    for key, want in expected.items():
        got = blocks[key].dequantize()
        assert torch.equal(got, want), key
    assert blocks["model.layers.0.self_attn.q_proj.weight"].q.min() < 0  # Q4_0 is centred: q - 8
    assert load_block_weights(ModelSource("hf", tmp_path, "tiny"), config) == {}


def test_the_kernels_run_on_torchs_thread_pool():
    """at::parallel_for built without OpenMP runs serially without a word: the kernels would use
    one core of many. They share torch's pool, and follow torch.set_num_threads."""
    before = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert torch.ops.tandem.parallel_threads() == n
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, BFLOAT16_MIN_ROWS - 1, BFLOAT16_MIN_ROWS, BLOCK_MAX_ROWS, BLOCK_MAX_ROWS + 1, 40])
def test_with_blocks_and_a_bfloat16_copy_no_float32_copy_is_kept(rows):
    """Asked for bfloat16 products: exact float32 blocks for few rows, bfloat16 against the blocks
    from BFLOAT16_MIN_ROWS (where the CPU has AVX512-BF16), against the bfloat16 copy above."""
    blocks = random_blocks(256, 128, "q4_1", seed=rows)
    w = blocks.dequantize()
    linear = Linear(w, None, blocks, prefill_dtype=torch.bfloat16, four_bit=False)
    assert linear.weight is None and linear.bfloat16_blocks == HAS_BF16
    assert linear.describe().startswith(f"int8 blocks up to {BFLOAT16_MIN_ROWS - 1 if HAS_BF16 else 8} rows, ")
    x = torch.randn(rows, 128)
    if rows > BLOCK_MAX_ROWS:
        want = Linear(w.bfloat16())(x.bfloat16()).float()
    elif HAS_BF16 and rows >= BFLOAT16_MIN_ROWS:
        want = block_gemm_bf16(x, blocks)
    else:
        want = block_gemm(x, blocks)
    torch.testing.assert_close(linear(x), want, rtol=0, atol=0)
    assert linear.streamed_bytes(rows) == (blocks.q.numel() + 8 * blocks.scale.numel() if rows <= 8 else 2 * w.numel())
