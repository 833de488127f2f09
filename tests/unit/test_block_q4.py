"""4-bit blocks (`Nibbles`, `block_gemm_q4`): GGUF's Q4_0 and Q4_1 kept two values to a byte. Packing
keeps every weight's value bit for bit (against gguf's own dequantizer); the AVX2 kernel gives
block_gemm's products bit for bit (the same sums in the same order); the AVX-512 one is float32's
product of the same weights; `Linear` uses it for every step of up to 8 rows. The kernels need
AVX2, FMA and F16C (x86-64 CPUs since 2013): without them these tests fail, they do not skip."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tandem.common.cpu import cpu_flags
from tandem.kernels.block_linear import (BLOCK_MAX_ROWS, BlockWeights, Nibbles, NibbleStripes, block_gemm, block_gemm_q4,
                                         block_gemm_q4_stripes)
from tandem.kernels.cpu_ops import cpu_ops_unavailable
from tandem.kernels.linear import Linear
from tandem.server.model.loader import gguf_block_parts

from support.blocks import assert_bfloat16_products, assert_float32_product, random_blocks

HAS_AVX512 = all(flag in cpu_flags() for flag in ("avx512f", "avx512bw"))
Q = gguf.GGMLQuantizationType


@pytest.fixture(autouse=True, scope="module")
def kernels():
    """The kernels built and loaded, whichever test runs first."""
    assert cpu_ops_unavailable() is None, cpu_ops_unavailable()


def from_gguf(qtype, n: int, k: int, seed: int) -> tuple[BlockWeights, torch.Tensor]:
    """An [n, k] tensor quantized by gguf, as the loader reads it (int8 blocks), and gguf's own
    dequantization of it."""
    data = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = gguf.quants.quantize(data, qtype)
    blocks = BlockWeights(*(torch.from_numpy(np.ascontiguousarray(a)) for a in gguf_block_parts(raw, qtype, n)))
    return blocks, torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(n, k))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_packing_keeps_every_weight_of_a_gguf_tensor(qtype):
    blocks, want = from_gguf(qtype, 96, 576, seed=int(qtype))
    assert torch.equal(blocks.dequantize(), want)
    nibbles = Nibbles.pack(blocks)
    assert nibbles is not None and nibbles.q.dtype == torch.uint8 and nibbles.q.shape == (96, 288)
    assert torch.equal(nibbles.dequantize(), want)
    assert nibbles.nbytes() == 96 * 576 * 5 // 8  # 0.625 bytes a weight


def test_blocks_that_do_not_fit_four_bits_stay_int8():
    q8 = random_blocks(64, 64, "q8_0", seed=1)
    assert Nibbles.pack(q8) is None
    q4 = random_blocks(64, 64, "q4_1", seed=1)
    assert Nibbles.pack(BlockWeights(q4.q, q4.scale * (1 + 2**-20), q4.offset)) is None  # a scale float16 cannot hold
    centred = BlockWeights(q4.q - 8, q4.scale, q4.offset)  # -8..7 with an offset: no exact shift
    assert Nibbles.pack(centred) is None
    assert Linear(centred.dequantize(), None, centred).blocks is centred  # Linear keeps what does not pack


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16])
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
@pytest.mark.parametrize("k", [576, 1536])
def test_the_avx2_kernel_gives_block_gemms_products_bit_for_bit(rows, qtype, k):
    blocks, _ = from_gguf(qtype, 1000, k, seed=rows)  # 1000 weight rows: chunks of 64 and a remainder
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    y = block_gemm_q4(x, Nibbles.pack(blocks), avx512=0)
    assert y.shape == (rows, 1000) and y.dtype == torch.float32
    assert torch.equal(y, block_gemm(x, blocks))


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16])
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
@pytest.mark.parametrize("k", [576, 1536])
def test_the_avx512_kernel_gives_float32_products(rows, qtype, k):
    # 1003 weight rows: chunks of 64 and a remainder of 43;
    # K = 576 is 18 blocks, a group of 16 and one of 2
    blocks, w = from_gguf(qtype, 1003, k, seed=rows)
    nibbles = Nibbles.pack(blocks)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    if not HAS_AVX512:
        with pytest.raises(RuntimeError, match="avx512=1 on a CPU without AVX-512 F and BW"):
            block_gemm_q4(x, nibbles, avx512=1)
        return
    y = block_gemm_q4(x, nibbles, avx512=1)
    assert_float32_product(y, x, w)
    assert torch.equal(block_gemm_q4(x, nibbles), y)  # where the CPU has it, the default
    torch.testing.assert_close(block_gemm_q4(x.t().contiguous().t(), nibbles, avx512=1), y, rtol=0, atol=0)


@pytest.mark.parametrize("tile_rows", range(1, 9))
def test_every_tile_height_gives_the_product(tile_rows):
    blocks, w = from_gguf(Q.Q4_1, 200, 1536, seed=tile_rows)
    x = torch.randn(11, 1536, generator=torch.Generator().manual_seed(9))  # whole tiles and a remainder
    for avx512 in (0, 1) if HAS_AVX512 else (0,):
        assert_float32_product(block_gemm_q4(x, Nibbles.pack(blocks), tile_rows, avx512), x, w)


@pytest.mark.parametrize("rows", [1, 2, 4, 5, BLOCK_MAX_ROWS, BLOCK_MAX_ROWS + 1, 40])
def test_linear_multiplies_four_bit_blocks_up_to_the_row_limit(rows):
    """Also with bfloat16 products asked for: no int8 blocks are kept, the 4-bit blocks are multiplied
    in bfloat16 from BFLOAT16_MIN_ROWS rows where the CPU has AVX512-BF16, in float32 below. Rows that
    make whole stripes of 16 are held so (`NibbleStripes`, block_gemm_q4_stripes), the rest as Nibbles."""
    for n, form, name in ((320, NibbleStripes, "4-bit blocks in stripes"), (312, Nibbles, "4-bit blocks")):
        blocks, w = from_gguf(Q.Q4_1, n, 576, seed=rows)
        bias = torch.randn(n)
        linear = Linear(w, bias, blocks)
        assert isinstance(linear.blocks, form) and linear.describe() == f"{name} up to 8 rows, oneDNN-packed float32 above"
        x = torch.randn(rows, 576)
        if rows <= BLOCK_MAX_ROWS:
            product = block_gemm_q4_stripes(x, linear.blocks, exact=True) if form is NibbleStripes else block_gemm_q4(x, linear.blocks)
            torch.testing.assert_close(linear(x), product + bias, rtol=0, atol=0)
            assert linear.streamed_bytes(rows) == n * 576 * 5 // 8
        else:
            torch.testing.assert_close(linear(x), Linear(w, bias)(x), rtol=0, atol=0)
        assert_bfloat16_products(w, blocks, x, Nibbles, block_gemm_q4)


def test_block_gemm_q4_refuses_what_it_cannot_take_by_name():
    nibbles = Nibbles.pack(from_gguf(Q.Q4_1, 64, 64, seed=3)[0])
    with pytest.raises(RuntimeError, match=r"q must be contiguous uint8 \[N, K / 2\] with K = x.size\(1\)"):
        block_gemm_q4(torch.randn(2, 96), nibbles)
    with pytest.raises(RuntimeError, match="x must be a 2-D float32 tensor"):
        block_gemm_q4(torch.randn(2, 64).double(), nibbles)
    with pytest.raises(RuntimeError, match=r"scale and offset must be contiguous float16 \[N, K / 32\]"):
        block_gemm_q4(torch.randn(2, 64), Nibbles(nibbles.q, nibbles.scale.float(), nibbles.offset))
    with pytest.raises(RuntimeError, match="tile_rows must be 0"):
        block_gemm_q4(torch.randn(2, 64), nibbles, tile_rows=9)
