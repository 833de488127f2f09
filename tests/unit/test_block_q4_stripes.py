"""4-bit blocks in stripes of 16 weight rows (`NibbleStripes`, `block_gemm_q4_stripes`): the same bytes
and values as the `Nibbles` they are regrouped from; the float32 forms (AVX512-BF16's three parts, and
AVX2's) are float32's product of the file's weights, the bfloat16 form float32's product of the same
weights with x rounded to bfloat16; a Linear on a CPU with AVX512-BF16 holds 4-bit blocks so and
multiplies one row in float32, more in bfloat16; on a CPU without AVX-512 it holds them so too and
multiplies every row count in float32 (AVX2). Where the CPU lacks AVX512-BF16 the operator refuses its
bfloat16 form by name (checked here instead)."""

from __future__ import annotations

import pytest
import torch

from tandem.common.cpu import cpu_flags
from tandem.kernels.block_linear import (BLOCK_MAX_ROWS, Nibbles, NibbleStripes, avx512_runs,
                                         bfloat16_blocks_unavailable, block_gemm_q4_stripes)
from tandem.kernels.cpu_ops import cpu_ops_unavailable
from tandem.kernels.linear import STRIPES_BFLOAT16_MIN_ROWS, Linear

from support.blocks import assert_float32_product, random_blocks

HAS_BF16 = "avx512_bf16" in cpu_flags()


@pytest.fixture(autouse=True, scope="module")
def kernels():
    """The kernels built and loaded, whichever test runs first."""
    assert cpu_ops_unavailable() is None, cpu_ops_unavailable()


def stripes(n: int, k: int, kind: str, seed: int) -> tuple[NibbleStripes, torch.Tensor]:
    blocks = random_blocks(n, k, kind, seed)
    return NibbleStripes.from_nibbles(Nibbles.pack(blocks)), blocks.dequantize()


@pytest.mark.parametrize("kind", ["q4_0", "q4_1"])
@pytest.mark.parametrize("n,k", [(16, 32), (48, 576), (64, 1536)])
def test_stripes_hold_the_nibbles_bytes_and_values(kind, n, k):
    nibbles = Nibbles.pack(random_blocks(n, k, kind, seed=n + k))
    striped = NibbleStripes.from_nibbles(nibbles)
    assert striped.q.shape == (n // 16, k // 32, 8, 32) and striped.scale.shape == (n // 16, k // 32, 16)
    assert striped.nbytes() == nibbles.nbytes()
    back = striped.to_nibbles()
    assert all(torch.equal(getattr(back, f), getattr(nibbles, f)) for f in ("q", "scale", "offset"))
    assert torch.equal(striped.dequantize(), nibbles.dequantize())


def test_row_counts_that_are_not_whole_stripes_stay_nibbles():
    nibbles = Nibbles.pack(random_blocks(40, 64, "q4_1", seed=1))
    assert NibbleStripes.from_nibbles(nibbles) is None
    linear = Linear(nibbles.dequantize(), None, random_blocks(40, 64, "q4_1", seed=1), prefill_dtype=torch.bfloat16)
    assert isinstance(linear.blocks, Nibbles)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 17])
@pytest.mark.parametrize("kind", ["q4_0", "q4_1"])
@pytest.mark.parametrize("n,k", [(80, 576), (96, 1536)])  # an odd and an even number of stripes
def test_every_form_is_a_float32_product_of_the_file_weights(rows, kind, n, k):
    """float32 (the AVX2 form on every CPU, AVX512-BF16's where it runs): of x as it is; bfloat16: of x
    rounded to bfloat16 (and not within float32's bound of x's own product, so the rounding happened)."""
    w_striped, w = stripes(n, k, kind, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    avx2 = block_gemm_q4_stripes(x, w_striped, exact=True, avx512=0)
    assert avx2.shape == (rows, n) and avx2.dtype == torch.float32
    assert_float32_product(avx2, x, w)
    torch.testing.assert_close(block_gemm_q4_stripes(x.t().contiguous().t(), w_striped, True, avx512=0), avx2,
                               rtol=0, atol=0)
    if not HAS_BF16:
        torch.testing.assert_close(block_gemm_q4_stripes(x, w_striped, exact=True), avx2, rtol=0, atol=0)
        with pytest.raises(RuntimeError, match="block_gemm_q4_stripes' bfloat16 form .* needs a CPU with AVX512-BF16"):
            block_gemm_q4_stripes(x, w_striped, exact=False)
        return
    exact = block_gemm_q4_stripes(x, w_striped, exact=True)
    assert_float32_product(exact, x, w)
    rounded = block_gemm_q4_stripes(x, w_striped, exact=False)
    assert_float32_product(rounded, x.bfloat16().float(), w)
    with pytest.raises(AssertionError, match="the float32 bound"):
        assert_float32_product(rounded, x, w)
    torch.testing.assert_close(block_gemm_q4_stripes(x.t().contiguous().t(), w_striped, exact=True), exact,
                               rtol=0, atol=0)


@pytest.mark.parametrize("column", range(4))
def test_the_avx2_form_reads_each_column_of_a_quad_from_its_own_weights(column):
    """x's four columns of a quad meet the four fields of a row's word, each scaled by its own power of
    two: x one-hot at a column gives that column of w (the block's scale and offset applied to it)."""
    w_striped, w = stripes(32, 64, "q4_1", seed=7)
    for at in (column, 36 + column):
        x = torch.zeros(1, 64)
        x[0, at] = 1.0
        torch.testing.assert_close(block_gemm_q4_stripes(x, w_striped, exact=True, avx512=0)[0], w[:, at],
                                   rtol=2**-22, atol=0)


def test_the_avx2_form_is_exact_under_scaling_by_powers_of_two():
    """Every step (x's columns scaled by 2^-4f, products, sums, the blocks' scales and offsets) scales
    exactly while values stay float32 normals: x times 2^-96 (~1e-29) gives y times 2^-96, bit for bit."""
    w_striped, _ = stripes(48, 576, "q4_0", seed=9)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(9))
    y = block_gemm_q4_stripes(x, w_striped, exact=True, avx512=0)
    tiny = block_gemm_q4_stripes(torch.ldexp(x, torch.tensor(-96)), w_striped, exact=True, avx512=0)
    assert torch.equal(tiny, torch.ldexp(y, torch.tensor(-96)))


def test_block_gemm_q4_stripes_refuses_what_it_cannot_take_by_name():
    """Where the CPU lacks AVX512-BF16, that is what it names for the bfloat16 form; the float32 one runs."""
    w_striped, _ = stripes(32, 64, "q4_1", seed=4)
    if not HAS_BF16:
        with pytest.raises(RuntimeError, match="block_gemm_q4_stripes' bfloat16 form .* needs a CPU with AVX512-BF16"):
            block_gemm_q4_stripes(torch.randn(2, 64), w_striped, exact=False)
        with pytest.raises(RuntimeError, match="block_gemm_q4_stripes' AVX512-BF16 forms need a CPU with AVX512-BF16"):
            block_gemm_q4_stripes(torch.randn(2, 64), w_striped, exact=True, avx512=1)
    with pytest.raises(RuntimeError, match=r"avx512 must be -1 \(where it runs\), 0 or 1, got 2"):
        block_gemm_q4_stripes(torch.randn(2, 64), w_striped, exact=True, avx512=2)
    with pytest.raises(RuntimeError, match=r"block_gemm_q4_stripes' bfloat16 form \(exact=false\) needs"):
        block_gemm_q4_stripes(torch.randn(2, 64), w_striped, exact=False, avx512=0)
    for avx512 in (0, -1):
        with pytest.raises(RuntimeError, match=r"q must be contiguous uint8 \[N / 16, K / 32, 8, 32\] with K = x.size\(1\)"):
            block_gemm_q4_stripes(torch.randn(2, 96), w_striped, exact=True, avx512=avx512)
        with pytest.raises(RuntimeError, match="x must be a 2-D float32 tensor"):
            block_gemm_q4_stripes(torch.randn(2, 64).double(), w_striped, exact=True, avx512=avx512)
        with pytest.raises(RuntimeError, match=r"scale and offset must be contiguous float16 \[N / 16, K / 32, 16\]"):
            block_gemm_q4_stripes(torch.randn(2, 64), NibbleStripes(w_striped.q, w_striped.scale.float(),
                                                                    w_striped.offset), exact=True, avx512=avx512)


@pytest.mark.parametrize("rows", [1, 2, BLOCK_MAX_ROWS, BLOCK_MAX_ROWS + 1])
def test_linear_holds_stripes_where_they_pay(rows):
    """With AVX512-BF16: one row in float32 (a single sequence's decode stays float32's product), from
    STRIPES_BFLOAT16_MIN_ROWS in bfloat16, above BLOCK_MAX_ROWS against a bfloat16 copy. Without AVX-512:
    up to BLOCK_MAX_ROWS in float32 (the AVX2 form). With AVX-512 but not AVX512-BF16: Nibbles."""
    blocks = random_blocks(320, 576, "q4_1", seed=rows)
    w = blocks.dequantize()
    linear = Linear(w, None, blocks, prefill_dtype=torch.bfloat16)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(5))
    if bfloat16_blocks_unavailable() is not None:
        assert not linear.bfloat16_blocks
        if avx512_runs():
            assert isinstance(linear.blocks, Nibbles)
            return
        assert isinstance(linear.blocks, NibbleStripes)
        assert linear.describe().startswith("4-bit blocks in stripes up to 8 rows, ")
        if rows <= BLOCK_MAX_ROWS:
            y = linear(x)
            assert_float32_product(y, x, w)
            torch.testing.assert_close(y, block_gemm_q4_stripes(x, linear.blocks, exact=True, avx512=0), rtol=0, atol=0)
        return
    assert isinstance(linear.blocks, NibbleStripes) and linear.bfloat16_min_rows == STRIPES_BFLOAT16_MIN_ROWS
    assert linear.describe() == ("4-bit blocks in stripes up to 1 row, 4-bit blocks in stripes in bfloat16 up to 8, "
                                 "oneDNN-packed bfloat16 above")
    assert linear.streamed_bytes(rows) == (320 * 576 * 5 // 8 if rows <= BLOCK_MAX_ROWS else 320 * 576 * 2)
    y = linear(x)
    if rows == 1:
        assert_float32_product(y, x, w)
    elif rows <= BLOCK_MAX_ROWS:
        assert_float32_product(y, x.bfloat16().float(), w)
    else:
        torch.testing.assert_close(y, Linear(w.bfloat16())(x.bfloat16()).float(), rtol=0, atol=0)


def test_a_float32_linear_holds_stripes_only_without_avx512():
    """No bfloat16 products asked (a float32 model throughout): stripes where the CPU lacks AVX-512 (whose
    Nibbles would take the slower AVX2 kernel), Nibbles where it has it; float32's product either way."""
    blocks = random_blocks(64, 576, "q4_0", seed=3)
    linear = Linear(blocks.dequantize(), None, blocks)
    assert isinstance(linear.blocks, Nibbles if avx512_runs() else NibbleStripes)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(3))
    assert_float32_product(linear(x), x, blocks.dequantize())
