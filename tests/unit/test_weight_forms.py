"""The weight forms' registry (`tandem.kernels.weight_forms.WEIGHT_FORMS`): the forms `Linear` holds
for each span of rows, for every kind of weight it takes; a form added by one class and one registry
line is what Linear holds and multiplies with, described and counted as that form."""

from __future__ import annotations

import pytest
import torch

from support.blocks import random_blocks
from support.forms import Float16Copy
from tandem.kernels import weight_forms
from tandem.kernels.block_linear import BLOCK_MAX_ROWS, bfloat16_blocks_unavailable
from tandem.kernels.cpu_ops import cpu_ops_unavailable
from tandem.kernels.linear import Linear, use_stripes
from tandem.kernels.weight_forms import (BFLOAT16_MIN_ROWS, STRIPES_BFLOAT16_MIN_ROWS, BlockForm, EightBitBlocks, FLinear,
                                         FourBitBlocks, FourBitStripes, Int8Blocks, OneDNNPacked, PrefillCopy,
                                         Transposed, onednn_supports)

BF16_COPY = OneDNNPacked if onednn_supports(torch.bfloat16) else FLinear
# (rows, kind of blocks or None, four_bit, prefill_dtype) -> the forms for few rows and for many
CHOICES = [
    ((320, None, True, None), (OneDNNPacked, OneDNNPacked)),
    ((320, "q4_1", True, None), (FourBitStripes, OneDNNPacked)),
    ((312, "q4_1", True, None), (FourBitBlocks, OneDNNPacked)),
    ((320, "q4_0", False, None), (EightBitBlocks, OneDNNPacked)),  # Q4_0 has no offset: it fits 8 bits
    ((320, "q4_1", False, None), (Int8Blocks, OneDNNPacked)),
    ((320, "q8_0", True, None), (EightBitBlocks, OneDNNPacked)),
    ((320, None, True, torch.bfloat16), (OneDNNPacked, PrefillCopy)),
    ((320, "q4_1", True, torch.bfloat16), (FourBitStripes, PrefillCopy)),
    ((320, "q8_0", True, torch.float32), (EightBitBlocks, OneDNNPacked)),  # float32 "prefill": no copy
]


@pytest.mark.parametrize("case, forms", CHOICES, ids=[str(c) for c, _ in CHOICES])
def test_the_registry_gives_each_span_of_rows_its_form(case, forms):
    n, kind, four_bit, prefill_dtype = case
    blocks = None if kind is None else random_blocks(n, 128, kind, seed=n)
    w = torch.randn(n, 128) if blocks is None else blocks.dequantize()
    if blocks is not None and cpu_ops_unavailable() is not None:
        forms = tuple(OneDNNPacked if not f.many_rows else f for f in forms)  # no block kernels: no block forms
    linear = Linear(w, None, blocks, prefill_dtype, four_bit)
    assert (type(linear.small), type(linear.large)) == forms
    assert (linear.small is linear.large) == (forms[0] is forms[1])  # one form serving both is held once
    if forms[1] is PrefillCopy:
        assert type(linear.large.copy) is BF16_COPY and linear.large.rounds_to == torch.bfloat16
        assert linear.prefill_dtype_for(BLOCK_MAX_ROWS + 1) == torch.bfloat16 and linear.prefill_dtype_for(8) is None
        no_copy = isinstance(linear.small, BlockForm)  # no third copy beside blocks and a prefill copy
        assert linear.weight is None if no_copy else linear.weight.dtype == torch.float32


def test_block_forms_turn_to_bfloat16_where_asked_and_native():
    native = bfloat16_blocks_unavailable() is None
    for n, form, rows in ((320, FourBitStripes, STRIPES_BFLOAT16_MIN_ROWS), (312, FourBitBlocks, BFLOAT16_MIN_ROWS)):
        blocks = random_blocks(n, 128, "q4_1", seed=n)
        linear = Linear(blocks.dequantize(), None, blocks, torch.bfloat16)
        assert type(linear.small) is form and linear.small.bfloat16_min_rows == (rows if native else BLOCK_MAX_ROWS + 1)
        assert Linear(blocks.dequantize(), None, blocks).small.bfloat16_min_rows == BLOCK_MAX_ROWS + 1
    use_stripes(False)
    try:
        blocks = random_blocks(320, 128, "q4_1", seed=1)
        assert type(Linear(blocks.dequantize(), None, blocks).small) is FourBitBlocks
    finally:
        use_stripes(True)


def test_where_onednn_cannot_take_the_weight_float32_is_transposed_and_16_bit_goes_to_f_linear(monkeypatch):
    monkeypatch.setattr(weight_forms, "onednn_supports", lambda dtype: False)
    w, b, x = torch.randn(64, 32), torch.randn(64), torch.randn(3, 32)
    linear = Linear(w, b)
    assert type(linear.small) is Transposed and linear.kind == "transposed"
    assert linear.describe() == "x @ W ([in, out]) float32" and linear.weight.shape == (32, 64)
    torch.testing.assert_close(linear(x), x @ w.t().contiguous() + b, rtol=0, atol=0)
    halves = Linear(w, b, prefill_dtype=torch.bfloat16)
    assert type(halves.large.copy) is FLinear and halves.describe() == (
        "x @ W ([in, out]) float32 up to 8 rows, F.linear bfloat16 above")
    assert Linear(w.bfloat16()).kind == "plain"


@pytest.mark.parametrize("rows", [1, BLOCK_MAX_ROWS, BLOCK_MAX_ROWS + 1, 40])
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_form_added_by_one_class_and_one_registry_line_is_what_linear_holds(monkeypatch, rows, with_bias):
    torch.manual_seed(rows)
    blocks = random_blocks(320, 128, "q4_1", seed=rows)
    w, x = blocks.dequantize(), torch.randn(rows, 128)
    b = torch.randn(320) if with_bias else None
    monkeypatch.setattr(weight_forms, "WEIGHT_FORMS", [Float16Copy, *weight_forms.WEIGHT_FORMS])
    linear = Linear(w, b, blocks, prefill_dtype=torch.bfloat16)  # first in the registry: it wins every span
    assert isinstance(linear.small, Float16Copy) and linear.large is linear.small
    assert linear.describe() == "float16 copy" and linear.kind == "float16 copy" and linear.blocks is None
    assert linear.streamed_bytes(rows) == w.numel() * 2  # half float32's
    assert linear.prefill is None and linear.prefill_dtype_for(rows) is None
    y = linear(x)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w.half().float(), b), rtol=0, atol=0)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b), rtol=2e-3, atol=2e-3)  # float16's rounding


def test_a_form_added_after_the_block_forms_serves_only_the_rows_they_leave(monkeypatch):
    blocks = random_blocks(320, 128, "q8_0", seed=3)
    w = blocks.dequantize()
    forms = list(weight_forms.WEIGHT_FORMS)
    monkeypatch.setattr(weight_forms, "WEIGHT_FORMS", [*forms[:forms.index(OneDNNPacked)], Float16Copy,
                                                       *forms[forms.index(OneDNNPacked):]])
    linear = Linear(w, None, blocks)
    many = torch.randn(BLOCK_MAX_ROWS + 1, 128)
    if cpu_ops_unavailable() is None:
        assert type(linear.small) is EightBitBlocks and isinstance(linear.large, Float16Copy)
        assert linear.describe() == "8-bit blocks up to 8 rows, float16 copy above"
        assert linear.streamed_bytes(1) == blocks.q.numel() * 34 // 32 and linear.streamed_bytes(9) == w.numel() * 2
    torch.testing.assert_close(linear(many), torch.nn.functional.linear(many, w.half().float()), rtol=0, atol=0)


def test_a_weight_no_form_takes_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(weight_forms, "WEIGHT_FORMS", [Int8Blocks, Float16Copy])
    with pytest.raises(ValueError, match=r"no weight form takes a torch.bfloat16 weight of shape \(8, 32\) on cpu "
                                         r"\(WEIGHT_FORMS: Int8Blocks, Float16Copy\)"):
        Linear(torch.randn(8, 32).bfloat16())
