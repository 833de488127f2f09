"""The forms a projection's fixed weight is held and multiplied in, one class each, and the registry
(`WEIGHT_FORMS`) `Linear` picks them from.

On CPU the weight is reordered once, at load, into oneDNN's blocked layout and multiplied by
oneDNN (`mkldnn._linear_pointwise`; `OneDNNPacked`). Measured on a 2-core AVX2 EPYC against
`F.linear` (which goes to MKL's sgemm; `tandem bench linear` repeats it): the same at prompt-sized
batches and 1.4-3x faster at decode sizes, 1 to 32 rows, where MKL does not stream the weight at the
machine's bandwidth (the lm_head at 8 rows: 7.7 ms against 22 ms). Where oneDNN cannot take the
weight's dtype on this CPU (bfloat16 without AVX512-BF16), or off the CPU, the weight stays a plain
tensor: `F.linear` on CUDA and for 16-bit weights (`FLinear`), `x @ W` with W stored [in, out] for
float32 on CPU (`Transposed`: faster than F.linear at small batches there; for bfloat16 it is 8-40x
slower).

A weight that came block-quantized from a GGUF file also keeps that form, and batches of up to
`BLOCK_MAX_ROWS` rows multiply it: in 4 bits as the file keeps Q4_0 and Q4_1 (`FourBitBlocks` over
`Nibbles`, `block_gemm_q4`, 0.625 bytes a weight), Q8_0 as the file keeps it (`EightBitBlocks` over
`Bytes`, `block_gemm_q8`, 1.0625), otherwise as int8 blocks (`Int8Blocks` over `BlockWeights`,
`block_gemm`, 1.25), instead of float32's 4. All rebuild the file's values exactly. On a 2-core Xeon
(AVX512-BF16, AMX), all of SmolLM2's projections (`tandem bench linear --whole-model`): 10.98 ms at
1 row against the int8 blocks' 16.71, 24.08 at 8 rows against 30.53 (and against 37.51 for the int8
blocks in bfloat16, so no int8 blocks are kept beside the 4-bit ones).
A float32 weight may also have its products over many rows run in bfloat16 (`prefill_dtype`: prefill
chunks, decode batches of `BFLOAT16_MIN_ROWS` or more), which a CPU with AVX512-BF16 multiplies two
to three times as fast: above `BLOCK_MAX_ROWS` rows against a bfloat16 copy of the weight
(`PrefillCopy`, oneDNN), from `BFLOAT16_MIN_ROWS` up to it against the blocks, in whichever form they
are held (`block_gemm_bf16`). Inputs are rounded on the way in and products returned in float32. That
is the one inexact path here.

4-bit blocks whose rows make whole stripes of 16 are regrouped so (`FourBitStripes` over
`NibbleStripes`), whose kernel multiplies the 4-bit values as they are, 16 weight rows to a vector, the
blocks' scales applied to their sums (`block_gemm_q4_stripes`): in float32 (AVX-512, else AVX2), and
where bfloat16 products are asked and native, from `STRIPES_BFLOAT16_MIN_ROWS` rows with x rounded to
bfloat16. All of SmolLM2's projections and LM head in 4 bits (`tandem bench linear --whole-model`,
2-core Zen 5 EPYC), Nibbles against stripes, both float32: 3.47 / 2.89 ms at 1 row, 4.00 / 3.18 at 2,
5.17 / 4.35 at 4, 8.30 / 6.84 at 8 with AVX-512; held to AVX2 (`TANDEM_CPU_ISA=avx2`) 4.95 / 3.31,
5.66 / 4.44, 7.11 / 6.45, 11.89 / 11.37; a whole decode step there (`tandem bench step --compare
stripes`) 0.72x / 0.83x / 0.94x / 0.96x the time at 1 / 2 / 4 / 8 rows.

Adding a weight form (FP8, int4 with groups, GGUF K-quants, ...):
1. Write one class deriving from `WeightForm` (`DenseForm` for a float copy of the weight,
   `BlockForm` for a GGUF-style block container in block_linear.py): say which products it serves
   (`few_rows`: up to BLOCK_MAX_ROWS rows, `many_rows`: more), and give it `make(weight, blocks,
   options)` (the form of this weight, or None where it does not apply: the wrong dtype or device,
   blocks that do not fit, kernels that cannot run here), `__call__(x, bias, keep)`, `nbytes()` and
   `describe()` (the startup log's words for it).
2. Add the class to `WEIGHT_FORMS`, before the forms it should win over: `Linear` takes, for each
   of its two spans of rows, the first form whose `make` accepts the weight.
A source whose container is new (another block size) brings `rows`, `columns` and `cat` on that
container, as BlockWeights has, for tensor-parallel ranks (server/model/shard.py splits the source
before any form is made); forms are made from a rank's share. tests/unit/test_weight_forms.py and
tests/engine/test_added_weight_form.py add a form this way, inside the test.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tandem.kernels.block_linear import (BLOCK_MAX_ROWS, BlockWeights, Bytes, Nibbles, NibbleStripes,
                                         bfloat16_blocks_unavailable, block_gemm, block_gemm_bf16, block_gemm_q4,
                                         block_gemm_q4_stripes, block_gemm_q8)
from tandem.kernels.cpu_ops import cpu_ops_unavailable

log = logging.getLogger("tandem.kernels")

# The batch size oneDNN's weight layout is chosen for: 64 measured as good as the best hint at
# every batch size from 1 to 1024 rows.
PACK_BATCH_HINT = 64
# From this many rows, a product asked to run in bfloat16 does so against the blocks too; below it the
# float32 block kernels are bound by the weight's bytes, and rounding would buy little. All of
# SmolLM2's projections on a 2-core AVX512-BF16 EPYC (`tandem bench linear --whole-model`), float32
# int8 blocks against bfloat16 ones: 7.5 / 7.2 ms at 1 row, 10.8 / 8.9 at 4, 12.4 / 10.2 at 5,
# 18.5 / 14.1 at 8 (oneDNN bfloat16 at 8: 15.7; at 12 rows it wins: 16.8 against 19.6). The 4-bit
# blocks on a 2-core Zen 5 EPYC, float32 against bfloat16: 3.15 / 3.73 at 1 row, 4.90 / 4.74 at 4,
# 6.10 / 5.15 at 5, 7.90 / 6.33 at 8; the 8-bit ones 5.51 / 4.95 at 5, 7.72 / 5.83 at 8.
BFLOAT16_MIN_ROWS = 5
# The same for 4-bit blocks held in stripes (`NibbleStripes`), whose bfloat16 form pays from 2 rows:
# all of SmolLM2's projections and LM head in stripes (as above), float32 (AVX-512) against bfloat16:
# 2.89 / 2.63 ms at 1 row, 3.18 / 2.68 at 2, 4.35 / 2.99 at 4, 6.84 / 4.54 at 8. One row, a single
# stream's decode step, stays float32's product.
STRIPES_BFLOAT16_MIN_ROWS = 2


@dataclass(frozen=True)
class FormOptions:
    """What a Linear was asked for besides its weight and blocks."""

    prefill_dtype: torch.dtype | None = None  # products over more than BLOCK_MAX_ROWS rows in this dtype
    four_bit: bool = True  # blocks whose values fit 4 bits are kept in 4 bits (else as 8-bit or int8 blocks)
    stripes: bool = True  # 4-bit blocks of whole 16-row stripes are regrouped in stripes (`use_stripes`)
    _packed: dict = field(default_factory=dict, compare=False, repr=False)  # id(blocks) -> `nibbles`' answer

    def nibbles(self, blocks: BlockWeights) -> Nibbles | None:
        """`blocks` in 4 bits (`Nibbles.pack`), or None where they do not fit: packed once however
        many of the 4-bit forms ask."""
        if id(blocks) not in self._packed:
            self._packed[id(blocks)] = Nibbles.pack(blocks) if self.four_bit else None
        return self._packed[id(blocks)]


class WeightForm:
    """A fixed weight [out, in] held one way, and `y = x @ weight.T (+ bias)` over it.

    A form serves products of up to BLOCK_MAX_ROWS rows (`few_rows`), of more (`many_rows`), or both;
    `Linear` holds one form for each span, the same object where one form serves both."""

    few_rows = True
    many_rows = True
    kind = ""  # a short name for a form over the weight as given (`Linear.kind`, benchmark keys)
    weight: torch.Tensor | None = None  # the float weight as this form holds it (None: blocks alone)
    blocks: BlockWeights | Nibbles | NibbleStripes | Bytes | None = None  # the block container it multiplies
    rounds_to: torch.dtype | None = None  # the dtype x is rounded to on the way in (the prefill dtype), if any
    bfloat16_min_rows = BLOCK_MAX_ROWS + 1  # from this many rows its products run in bfloat16 (here: never)

    @classmethod
    def make(cls, weight: torch.Tensor, blocks: BlockWeights | None, options: FormOptions) -> WeightForm | None:
        """This form of `weight` (as [out, in]; `blocks`, where given, dequantize to it exactly), or None
        where the form does not apply to it here."""
        raise NotImplementedError

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None, keep: bool = False) -> torch.Tensor:
        """x [rows, in] @ weight.T (+ bias), in x's dtype (float32 for a float32 weight); `keep`: a form
        that rounds x (`rounds_to`) returns a product without bias in that dtype, not widened."""
        raise NotImplementedError

    def nbytes(self) -> int:
        """Bytes of weight this form holds, all of which every product over it reads."""
        raise NotImplementedError

    def describe(self) -> str:
        """The form in a few words, for the startup log ("oneDNN-packed float32", "4-bit blocks")."""
        raise NotImplementedError


def _float32_on_cpu(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32


class DenseForm(WeightForm):
    """The weight as a float tensor, in the layout its product wants."""

    label = ""  # describe()'s words before the dtype

    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def describe(self) -> str:
        return f"{self.label} {str(self.weight.dtype).removeprefix('torch.')}"


class OneDNNPacked(DenseForm):
    """Reordered once into oneDNN's blocked layout and multiplied by oneDNN: on CPU, for every dtype
    oneDNN multiplies natively here (`onednn_supports`)."""

    kind, label = "onednn", "oneDNN-packed"

    def __init__(self, weight: torch.Tensor):
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT)

    @classmethod
    def make(cls, weight, blocks, options):
        return cls(weight) if weight.device.type == "cpu" and onednn_supports(weight.dtype) else None

    def __call__(self, x, bias, keep=False):
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, bias, "none", [], "")


class Transposed(DenseForm):
    """float32 on a CPU oneDNN cannot serve: W stored [in, out] and `x @ W`."""

    kind, label = "transposed", "x @ W ([in, out])"

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.t().contiguous()

    @classmethod
    def make(cls, weight, blocks, options):
        return cls(weight) if _float32_on_cpu(weight) else None

    def __call__(self, x, bias, keep=False):
        y = x @ self.weight
        return y if bias is None else y + bias


class FLinear(DenseForm):
    """The weight as given and `F.linear`: CUDA, and 16-bit weights oneDNN cannot take here. Takes
    every weight: the registry's last resort."""

    kind, label = "plain", "F.linear"

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.contiguous()

    @classmethod
    def make(cls, weight, blocks, options):
        return cls(weight)

    def __call__(self, x, bias, keep=False):
        return F.linear(x, self.weight, bias)


class PrefillCopy(WeightForm):
    """Products over more than BLOCK_MAX_ROWS rows in the prefill dtype (a float32 weight on a CPU):
    x rounded to it and multiplied by a copy of the weight in it, held in the form the registry picks
    for that copy (oneDNN where it takes the dtype); returned in float32, or, where `keep` asks and
    there is no bias, in the prefill dtype."""

    few_rows = False

    def __init__(self, copy: WeightForm):
        self.copy = copy
        self.weight, self.rounds_to = copy.weight, copy.weight.dtype

    @classmethod
    def make(cls, weight, blocks, options):
        if options.prefill_dtype in (None, torch.float32) or not _float32_on_cpu(weight):
            return None
        return cls(choose(weight.to(options.prefill_dtype), None, FormOptions())[1])

    def __call__(self, x, bias, keep=False):
        y = self.copy(x.to(self.rounds_to), None)
        if bias is None:
            return y if keep else y.float()
        return y.float() + bias

    def nbytes(self) -> int:
        return self.copy.nbytes()

    def describe(self) -> str:
        return self.copy.describe()


class BlockForm(WeightForm):
    """A float32 weight's GGUF blocks in a container of block_linear.py, for products of up to
    BLOCK_MAX_ROWS rows on a CPU that runs tandem's kernels: float32 products rebuilding the file's
    values exactly, and where bfloat16 products are asked and native, from `bfloat16_min_rows` rows
    the same blocks with x rounded to bfloat16 (`block_gemm_bf16`)."""

    many_rows = False
    label = ""  # describe()'s words
    bfloat16_from = BFLOAT16_MIN_ROWS  # bfloat16_min_rows where bfloat16 products are asked and native

    def __init__(self, blocks, bfloat16: bool):
        self.blocks = blocks
        self.bfloat16_min_rows = self.bfloat16_from if bfloat16 else BLOCK_MAX_ROWS + 1

    @classmethod
    def make(cls, weight, blocks, options):
        if blocks is None or not _float32_on_cpu(weight) or cpu_ops_unavailable() is not None:
            return None
        held = cls.hold(blocks, options)
        bfloat16 = options.prefill_dtype == torch.bfloat16 and bfloat16_blocks_unavailable() is None
        return None if held is None else cls(held, bfloat16)

    @staticmethod
    def hold(blocks: BlockWeights, options: FormOptions):
        """The blocks in this form's container, or None where they do not fit it."""
        raise NotImplementedError

    @staticmethod
    def product(x: torch.Tensor, blocks) -> torch.Tensor:
        """float32's product over the container: the file's values exactly."""
        raise NotImplementedError

    def __call__(self, x, bias, keep=False):
        y = block_gemm_bf16(x, self.blocks) if x.shape[0] >= self.bfloat16_min_rows else self.product(x, self.blocks)
        return y if bias is None else y + bias

    def nbytes(self) -> int:
        return self.blocks.nbytes()

    def describe(self) -> str:
        return self.label


class FourBitStripes(BlockForm):
    """4-bit blocks (Q4_0, Q4_1) whose rows make whole stripes of 16, regrouped so (`NibbleStripes`)."""

    label, bfloat16_from = "4-bit blocks in stripes", STRIPES_BFLOAT16_MIN_ROWS

    @staticmethod
    def hold(blocks, options):
        nibbles = options.nibbles(blocks) if options.stripes else None
        return None if nibbles is None else NibbleStripes.from_nibbles(nibbles)

    def __call__(self, x, bias, keep=False):
        """The stripes' own kernel in float32 or, from bfloat16_min_rows, with x rounded to bfloat16."""
        y = block_gemm_q4_stripes(x, self.blocks, exact=x.shape[0] < self.bfloat16_min_rows)
        return y if bias is None else y + bias


class FourBitBlocks(BlockForm):
    """4-bit blocks (Q4_0, Q4_1) as the file keeps them (`Nibbles`)."""

    label = "4-bit blocks"
    product = staticmethod(block_gemm_q4)

    @staticmethod
    def hold(blocks, options):
        return options.nibbles(blocks)


class EightBitBlocks(BlockForm):
    """Q8_0 blocks as the file keeps them (`Bytes`)."""

    label = "8-bit blocks"
    product = staticmethod(block_gemm_q8)

    @staticmethod
    def hold(blocks, options):
        return Bytes.pack(blocks)


class Int8Blocks(BlockForm):
    """Any blocks, as the loader gives them (`BlockWeights`: int8 values, float32 scale and offset)."""

    label = "int8 blocks"
    product = staticmethod(block_gemm)

    @staticmethod
    def hold(blocks, options):
        return blocks


# The forms Linear picks from, in order: for each span of rows, the first whose `make` accepts the weight.
WEIGHT_FORMS: list[type[WeightForm]] = [
    FourBitStripes, FourBitBlocks, EightBitBlocks, Int8Blocks,  # up to BLOCK_MAX_ROWS rows
    PrefillCopy,  # more rows
    OneDNNPacked, Transposed, FLinear,  # any rows
]


def choose(weight: torch.Tensor, blocks: BlockWeights | None,
           options: FormOptions) -> tuple[WeightForm, WeightForm]:
    """The forms of `weight` for products of up to BLOCK_MAX_ROWS rows and of more: for each, the first
    class in WEIGHT_FORMS that serves those rows and accepts the weight. One object where a form serves
    both spans; a form that would serve neither span left is not made (no copy nobody multiplies)."""
    few = many = None
    for form_class in WEIGHT_FORMS:
        for_few, for_many = few is None and form_class.few_rows, many is None and form_class.many_rows
        if (for_few or for_many) and (form := form_class.make(weight, blocks, options)) is not None:
            few, many = (form if for_few else few), (form if for_many else many)
        if few is not None and many is not None:
            return few, many
    raise ValueError(f"no weight form takes a {weight.dtype} weight of shape {tuple(weight.shape)} on "
                     f"{weight.device} (WEIGHT_FORMS: {', '.join(c.__name__ for c in WEIGHT_FORMS)})")


_ONEDNN_DTYPES: dict[torch.dtype, bool] = {}


def onednn_supports(dtype: torch.dtype) -> bool:
    """Whether oneDNN multiplies `dtype` natively on this CPU (float32 everywhere; 16-bit types
    only with the instructions for them), checked once per dtype with a small product."""
    if dtype not in _ONEDNN_DTYPES:
        ok = torch.backends.mkldnn.is_available()
        if ok and dtype != torch.float32:
            ok = (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()) or (
                dtype == torch.float16 and torch.ops.mkldnn._is_mkldnn_fp16_supported()
            )
        if ok:
            try:
                w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=dtype), PACK_BATCH_HINT)
                y = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8, dtype=dtype), w, None, "none", [], "")
                ok = bool((y == 8).all())
            except RuntimeError as e:
                log.info("oneDNN cannot multiply %s here (%s); using torch matmul", dtype, e)
                ok = False
        _ONEDNN_DTYPES[dtype] = ok
    return _ONEDNN_DTYPES[dtype]
