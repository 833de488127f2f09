"""Projections with a fixed weight (`y = x @ W.T`), held in the form that runs fastest on the device.

`Linear` holds two forms of its weight (kernels/weight_forms.py, which gives the forms and their
measurements): one for products of up to `BLOCK_MAX_ROWS` rows, decode steps, where the GGUF file's
blocks win by streaming fewer bytes, and one for more rows, where a bfloat16 copy may serve prompt
pieces; the same form serves both where nothing else applies. It picks them once, at load, from the
registry (`WEIGHT_FORMS`), and per call by the rows of x alone.
"""

from __future__ import annotations

import torch

from tandem.kernels.block_linear import BLOCK_MAX_ROWS, BlockWeights, Bytes, Nibbles, NibbleStripes
from tandem.kernels.weight_forms import FormOptions, WeightForm, choose

_stripes = [True]


def use_stripes(enabled: bool) -> None:
    """Whether Linears made from now on regroup 4-bit blocks in stripes where their rows allow (the default),
    or keep them as `Nibbles` (the baseline `tandem bench step --compare stripes` measures against)."""
    _stripes[0] = enabled


class Linear:
    """`y = x @ weight.T (+ bias)` for a weight given as [out, in] (HF's layout), and optionally
    the same weight block-quantized (`blocks`, which must dequantize to `weight` exactly) for
    small batches, and products over many rows in `prefill_dtype`. `four_bit`: blocks whose values
    fit 4 bits are kept and multiplied in that form (`Nibbles`), the int8 ones dropped."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, blocks: BlockWeights | None = None,
                 prefill_dtype: torch.dtype | None = None, four_bit: bool = True):
        self.bias = bias
        # products of up to BLOCK_MAX_ROWS rows go to `small`, of more to `large` (one object where one form serves all)
        self.small, self.large = choose(weight, blocks, FormOptions(prefill_dtype, four_bit, _stripes[0]))
        # the form over the weight in its own dtype serving every row, if any (none beside blocks and a prefill copy)
        self._whole = next((form for form in (self.small, self.large) if form.few_rows and form.many_rows), None)

    def __call__(self, x: torch.Tensor, keep: bool = False) -> torch.Tensor:
        """x @ W.T (+ bias), in float32 where the weight is; `keep`: a product run in the prefill
        dtype without a bias returns its result in that dtype, not widened to float32."""
        return (self.small if x.shape[0] <= BLOCK_MAX_ROWS else self.large)(x, self.bias, keep)

    def describe(self) -> str:
        small, large = self.small.describe(), self.large.describe()
        if self.small is self.large:
            return small
        if self.bfloat16_blocks:
            below = self.bfloat16_min_rows - 1
            return (f"{small} up to {below} row{'s' if below > 1 else ''}, {small} in bfloat16 up to {BLOCK_MAX_ROWS}, "
                    f"{large} above")
        return f"{small} up to {BLOCK_MAX_ROWS} rows, {large} above"

    def streamed_bytes(self, rows: int) -> int:
        """Bytes of weight one product over `rows` rows reads."""
        return (self.small if rows <= BLOCK_MAX_ROWS else self.large).nbytes()

    def prefill_dtype_for(self, rows: int) -> torch.dtype | None:
        """The dtype a product over `rows` rows rounds its input to and runs in, where that is the
        prefill dtype (above BLOCK_MAX_ROWS rows); else None."""
        return self.large.rounds_to if rows > BLOCK_MAX_ROWS else None

    # What the model, the fused decode layer, the tools and the tests read of the forms held.

    @property
    def blocks(self) -> BlockWeights | Nibbles | NibbleStripes | Bytes | None:
        """The blocks products of up to BLOCK_MAX_ROWS rows multiply, in the container they are held in."""
        return self.small.blocks

    @property
    def bfloat16_min_rows(self) -> int:
        """From this many rows the blocks multiply in bfloat16 (BLOCK_MAX_ROWS + 1: never)."""
        return self.small.bfloat16_min_rows

    @property
    def bfloat16_blocks(self) -> bool:
        """Whether products of bfloat16_min_rows to BLOCK_MAX_ROWS rows run in bfloat16."""
        return self.bfloat16_min_rows <= BLOCK_MAX_ROWS

    @property
    def prefill(self) -> WeightForm | None:
        """The form over the weight in the prefill dtype that products of more than BLOCK_MAX_ROWS rows
        go to (its `weight` in that dtype), or None where they stay in the weight's own."""
        return self.large if self.large.rounds_to is not None else None

    @property
    def weight(self) -> torch.Tensor | None:
        """The weight in its own dtype as held (`kind` says how), or None where blocks serve the few
        rows and a prefill copy the many: no third copy."""
        return None if self._whole is None else self._whole.weight

    @property
    def kind(self) -> str:
        """How the weight in its own dtype is held: "onednn", "transposed", "plain", or "none"."""
        return "none" if self._whole is None else self._whole.kind
