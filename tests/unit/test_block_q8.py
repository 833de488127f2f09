"""8-bit blocks (`Bytes`, `block_gemm_q8`): GGUF's Q8_0 kept as the file keeps it, int8 values and a
float16 scale per block. Packing keeps every weight's value bit for bit (against gguf's own
dequantizer); the AVX2 kernel gives block_gemm's products bit for bit (the same sums in the same
order); the AVX-512 one is float32's product of the same weights; `Linear` uses it for every step of
up to 8 rows, float32 even where bfloat16 products are asked for. The kernels need AVX2, FMA and F16C:
without them these tests fail, they do not skip."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tandem.common.cpu import cpu_flags
from tandem.kernels.block_linear import BLOCK_MAX_ROWS, BlockWeights, Bytes, block_gemm, block_gemm_q8
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


def from_gguf(n: int, k: int, seed: int) -> tuple[BlockWeights, torch.Tensor]:
    """An [n, k] tensor quantized to Q8_0 by gguf, as the loader reads it (int8 blocks), and gguf's
    own dequantization of it."""
    data = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = gguf.quants.quantize(data, Q.Q8_0)
    blocks = BlockWeights(*(torch.from_numpy(np.ascontiguousarray(a)) for a in gguf_block_parts(raw, Q.Q8_0, n)))
    return blocks, torch.from_numpy(gguf.quants.dequantize(raw, Q.Q8_0).reshape(n, k))


def test_packing_keeps_every_weight_of_a_gguf_tensor():
    blocks, want = from_gguf(96, 576, seed=0)
    assert torch.equal(blocks.dequantize(), want)
    packed = Bytes.pack(blocks)
    assert packed is not None and packed.q.dtype == torch.int8 and packed.scale.dtype == torch.float16
    assert torch.equal(packed.dequantize(), want)
    assert packed.nbytes() == 96 * 576 * 34 // 32  # 1.0625 bytes a weight, as the file


def test_blocks_with_an_offset_or_a_wide_scale_stay_int8_blocks():
    q4 = random_blocks(64, 64, "q4_1", seed=1)
    assert Bytes.pack(q4) is None  # Q4_1's offsets
    q8 = random_blocks(64, 64, "q8_0", seed=1)
    wide = BlockWeights(q8.q, q8.scale * (1 + 2**-20), q8.offset)  # a scale float16 cannot hold
    assert Bytes.pack(wide) is None
    assert Linear(wide.dequantize(), None, wide).blocks is wide  # Linear keeps what does not pack


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16])
@pytest.mark.parametrize("k", [576, 1536])
def test_the_avx2_kernel_gives_block_gemms_products_bit_for_bit(rows, k):
    blocks, _ = from_gguf(1000, k, seed=rows)  # 1000 weight rows: chunks of 64 and a remainder
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    y = block_gemm_q8(x, Bytes.pack(blocks), avx512=0)
    assert y.shape == (rows, 1000) and y.dtype == torch.float32
    assert torch.equal(y, block_gemm(x, blocks))


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16])
@pytest.mark.parametrize("k", [576, 1536])
def test_the_avx512_kernel_gives_float32_products(rows, k):
    # 1003 weight rows: chunks of 64 and a remainder of 43;
    # K = 576 is 18 blocks, a group of 16 and one of 2
    blocks, w = from_gguf(1003, k, seed=rows)
    packed = Bytes.pack(blocks)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    if not HAS_AVX512:
        with pytest.raises(RuntimeError, match="avx512=1 on a CPU without AVX-512 F and BW"):
            block_gemm_q8(x, packed, avx512=1)
        return
    y = block_gemm_q8(x, packed, avx512=1)
    assert_float32_product(y, x, w)
    assert torch.equal(block_gemm_q8(x, packed), y)  # where the CPU has it, the default
    torch.testing.assert_close(block_gemm_q8(x.t().contiguous().t(), packed, avx512=1), y, rtol=0, atol=0)


@pytest.mark.parametrize("tile_rows", range(1, 9))
def test_every_tile_height_gives_the_product(tile_rows):
    blocks, w = from_gguf(200, 1536, seed=tile_rows)
    x = torch.randn(11, 1536, generator=torch.Generator().manual_seed(9))  # whole tiles and a remainder
    for avx512 in (0, 1) if HAS_AVX512 else (0,):
        assert_float32_product(block_gemm_q8(x, Bytes.pack(blocks), tile_rows, avx512), x, w)


@pytest.mark.parametrize("rows", [1, 4, 5, BLOCK_MAX_ROWS, BLOCK_MAX_ROWS + 1, 40])
def test_linear_multiplies_eight_bit_blocks_up_to_the_row_limit(rows):
    """Also with bfloat16 products asked for: no int8 blocks are kept (the float32 kernel over these
    blocks beat them in bfloat16: SmolLM2's LM head at 8 rows, 2.70 against 4.27 ms on a 2-core Xeon
    with AVX512-BF16); these blocks are multiplied in bfloat16 from BFLOAT16_MIN_ROWS rows where the
    CPU has AVX512-BF16, in float32 below."""
    blocks, w = from_gguf(320, 576, seed=rows)
    bias = torch.randn(320)
    linear = Linear(w, bias, blocks)
    assert isinstance(linear.blocks, Bytes) and linear.describe() == "8-bit blocks up to 8 rows, oneDNN-packed float32 above"
    x = torch.randn(rows, 576)
    if rows <= BLOCK_MAX_ROWS:
        torch.testing.assert_close(linear(x), block_gemm_q8(x, linear.blocks) + bias, rtol=0, atol=0)
        assert linear.streamed_bytes(rows) == 320 * 576 * 34 // 32
    else:
        torch.testing.assert_close(linear(x), Linear(w, bias)(x), rtol=0, atol=0)
    assert_bfloat16_products(w, blocks, x, Bytes, block_gemm_q8)


def test_block_gemm_q8_refuses_what_it_cannot_take_by_name():
    packed = Bytes.pack(from_gguf(64, 64, seed=3)[0])
    with pytest.raises(RuntimeError, match=r"q must be contiguous int8 \[N, K\] with K = x.size\(1\)"):
        block_gemm_q8(torch.randn(2, 96), packed)
    with pytest.raises(RuntimeError, match="x must be a 2-D float32 tensor"):
        block_gemm_q8(torch.randn(2, 64).double(), packed)
    with pytest.raises(RuntimeError, match=r"scale must be contiguous float16 \[N, K / 32\]"):
        block_gemm_q8(torch.randn(2, 64), Bytes(packed.q, packed.scale.float()))
    with pytest.raises(RuntimeError, match="tile_rows must be 0"):
        block_gemm_q8(torch.randn(2, 64), packed, tile_rows=9)
