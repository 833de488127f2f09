"""4-bit blocks in stripes of 16 weight rows (`NibbleStripes`, `block_gemm_q4_stripes`): the same bytes
and values as the `Nibbles` they are regrouped from; the float32 forms (AVX-512's and AVX2's) are
float32's product of the file's weights, the bfloat16 form float32's product of the same weights with x
rounded to bfloat16; a Linear holds 4-bit blocks so wherever their rows make whole stripes and
multiplies in float32, but from STRIPES_BFLOAT16_MIN_ROWS rows in bfloat16 where that is asked and
native. Where the CPU lacks AVX512-BF16 (or AVX-512) the operator refuses those forms by name (checked
here instead)."""

from __future__ import annotations

import pytest
import torch

from tandem.common.cpu import cpu_flags
from tandem.kernels.block_linear import (BLOCK_MAX_ROWS, Nibbles, NibbleStripes, bfloat16_blocks_unavailable,
                                         block_gemm_q4_stripes)
from tandem.kernels.cpu_ops import cpu_ops_unavailable
from tandem.kernels.linear import Linear, use_stripes
from tandem.kernels.weight_forms import STRIPES_BFLOAT16_MIN_ROWS

from support.blocks import assert_float32_product, random_blocks

HAS_BF16 = "avx512_bf16" in cpu_flags()
HAS_AVX512 = all(flag in cpu_flags() for flag in ("avx512f", "avx512bw"))


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
    """float32 (AVX2's on every CPU, AVX-512's where it runs): of x as it is; bfloat16: of x rounded to
    bfloat16 (and not within float32's bound of x's own product, so the rounding happened)."""
    w_striped, w = stripes(n, k, kind, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    strided = x.t().contiguous().t()
    forms = {0: block_gemm_q4_stripes(x, w_striped, exact=True, avx512=0)}
    if HAS_AVX512:
        forms[1] = block_gemm_q4_stripes(x, w_striped, exact=True, avx512=1)
    for avx512, y in forms.items():
        assert y.shape == (rows, n) and y.dtype == torch.float32
        assert_float32_product(y, x, w)
        torch.testing.assert_close(block_gemm_q4_stripes(strided, w_striped, True, avx512), y, rtol=0, atol=0)
    torch.testing.assert_close(block_gemm_q4_stripes(x, w_striped, exact=True), forms[1 if HAS_AVX512 else 0],
                               rtol=0, atol=0)
    if not HAS_BF16:
        with pytest.raises(RuntimeError, match="block_gemm_q4_stripes' bfloat16 form .* needs a CPU with AVX512-BF16"):
            block_gemm_q4_stripes(x, w_striped, exact=False)
        return
    rounded = block_gemm_q4_stripes(x, w_striped, exact=False)
    assert_float32_product(rounded, x.bfloat16().float(), w)
    with pytest.raises(AssertionError, match="the float32 bound"):
        assert_float32_product(rounded, x, w)
    torch.testing.assert_close(block_gemm_q4_stripes(strided, w_striped, exact=False), rounded, rtol=0, atol=0)


@pytest.mark.parametrize("avx512", [0, 1])
@pytest.mark.parametrize("column", range(4))
def test_the_float32_forms_read_each_column_of_a_quad_from_its_own_weights(column, avx512):
    """x's four columns of a quad meet the four fields of a row's word, each scaled by its own power of
    two: x one-hot at a column gives that column of w (the block's scale and offset applied to it).
    (AVX-512's form on a CPU without it: refused.)"""
    w_striped, w = stripes(32, 64, "q4_1", seed=7)
    if avx512 and not HAS_AVX512:
        assert_avx512_refused(w_striped)
        return
    for at in (column, 36 + column):
        x = torch.zeros(1, 64)
        x[0, at] = 1.0
        torch.testing.assert_close(block_gemm_q4_stripes(x, w_striped, exact=True, avx512=avx512)[0], w[:, at],
                                   rtol=2**-22, atol=0)


@pytest.mark.parametrize("avx512", [0, 1])
def test_the_float32_forms_are_exact_under_scaling_by_powers_of_two(avx512):
    """Every step (x's columns scaled by 2^-4f, products, sums, the blocks' scales and offsets) scales
    exactly while values stay float32 normals: x times 2^-96 (~1e-29) gives y times 2^-96, bit for bit.
    (AVX-512's form on a CPU without it: refused.)"""
    w_striped, _ = stripes(48, 576, "q4_0", seed=9)
    if avx512 and not HAS_AVX512:
        assert_avx512_refused(w_striped)
        return
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(9))
    y = block_gemm_q4_stripes(x, w_striped, exact=True, avx512=avx512)
    tiny = block_gemm_q4_stripes(torch.ldexp(x, torch.tensor(-96)), w_striped, exact=True, avx512=avx512)
    assert torch.equal(tiny, torch.ldexp(y, torch.tensor(-96)))


def assert_avx512_refused(w_striped: NibbleStripes) -> None:
    """On a CPU without AVX-512 (or under TANDEM_CPU_ISA=avx2), asking for its form is refused by name."""
    with pytest.raises(RuntimeError, match=r"block_gemm_q4_stripes' AVX-512 forms \(avx512=1\) need a CPU with AVX-512"):
        block_gemm_q4_stripes(torch.randn(1, w_striped.q.shape[1] * 32), w_striped, exact=True, avx512=1)


def test_block_gemm_q4_stripes_refuses_what_it_cannot_take_by_name():
    """Where the CPU lacks AVX512-BF16 or AVX-512, that is what it names for those forms; float32 runs."""
    w_striped, _ = stripes(32, 64, "q4_1", seed=4)
    x = torch.randn(2, 64)
    if not HAS_BF16:
        with pytest.raises(RuntimeError, match="block_gemm_q4_stripes' bfloat16 form .* needs a CPU with AVX512-BF16"):
            block_gemm_q4_stripes(x, w_striped, exact=False)
    if not HAS_AVX512:
        assert_avx512_refused(w_striped)
    with pytest.raises(RuntimeError, match=r"avx512 must be -1 \(where it runs\), 0 or 1, got 2"):
        block_gemm_q4_stripes(x, w_striped, exact=True, avx512=2)
    with pytest.raises(RuntimeError, match=r"block_gemm_q4_stripes' bfloat16 form \(exact=false\) needs .* avx512 -1 or 1"):
        block_gemm_q4_stripes(x, w_striped, exact=False, avx512=0)
    for avx512 in (0, -1):
        with pytest.raises(RuntimeError, match=r"q must be contiguous uint8 \[N / 16, K / 32, 8, 32\] with K = x.size\(1\)"):
            block_gemm_q4_stripes(torch.randn(2, 96), w_striped, exact=True, avx512=avx512)
        with pytest.raises(RuntimeError, match="x must be a 2-D float32 tensor"):
            block_gemm_q4_stripes(x.double(), w_striped, exact=True, avx512=avx512)
        with pytest.raises(RuntimeError, match=r"scale and offset must be contiguous float16 \[N / 16, K / 32, 16\]"):
            block_gemm_q4_stripes(x, NibbleStripes(w_striped.q, w_striped.scale.float(), w_striped.offset),
                                  exact=True, avx512=avx512)


@pytest.mark.parametrize("rows", [1, 2, BLOCK_MAX_ROWS, BLOCK_MAX_ROWS + 1])
def test_linear_holds_stripes_and_multiplies_in_bfloat16_where_native(rows):
    """With AVX512-BF16: one row in float32 (a single sequence's decode stays float32's product), from
    STRIPES_BFLOAT16_MIN_ROWS in bfloat16, above BLOCK_MAX_ROWS against a bfloat16 copy. Without it: up
    to BLOCK_MAX_ROWS in float32."""
    blocks = random_blocks(320, 576, "q4_1", seed=rows)
    w = blocks.dequantize()
    linear = Linear(w, None, blocks, prefill_dtype=torch.bfloat16)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(5))
    assert isinstance(linear.blocks, NibbleStripes)
    assert linear.streamed_bytes(rows) == (320 * 576 * 5 // 8 if rows <= BLOCK_MAX_ROWS else 320 * 576 * 2)
    y = linear(x)
    if bfloat16_blocks_unavailable() is not None:
        assert not linear.bfloat16_blocks
        assert linear.describe().startswith("4-bit blocks in stripes up to 8 rows, ")
        if rows <= BLOCK_MAX_ROWS:
            assert_float32_product(y, x, w)
            torch.testing.assert_close(y, block_gemm_q4_stripes(x, linear.blocks, exact=True), rtol=0, atol=0)
        return
    assert linear.bfloat16_min_rows == STRIPES_BFLOAT16_MIN_ROWS
    assert linear.describe() == ("4-bit blocks in stripes up to 1 row, 4-bit blocks in stripes in bfloat16 up to 8, "
                                 "oneDNN-packed bfloat16 above")
    if rows == 1:
        assert_float32_product(y, x, w)
    elif rows <= BLOCK_MAX_ROWS:
        assert_float32_product(y, x.bfloat16().float(), w)
    else:
        torch.testing.assert_close(y, Linear(w.bfloat16())(x.bfloat16()).float(), rtol=0, atol=0)


def test_a_float32_linear_holds_stripes_and_multiplies_in_float32():
    """No bfloat16 products asked (a float32 model throughout): stripes all the same, float32's product
    at every row count; `use_stripes(False)` keeps Nibbles (the baseline `bench step` compares with)."""
    blocks = random_blocks(64, 576, "q4_0", seed=3)
    linear = Linear(blocks.dequantize(), None, blocks)
    assert isinstance(linear.blocks, NibbleStripes)
    for rows in (1, 3, BLOCK_MAX_ROWS):
        x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
        assert_float32_product(linear(x), x, blocks.dequantize())
    use_stripes(False)
    try:
        assert isinstance(Linear(blocks.dequantize(), None, blocks).blocks, Nibbles)
    finally:
        use_stripes(True)
