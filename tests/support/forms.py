"""A weight form for the tests to add the way a new one is added (kernels/weight_forms.py, "Adding a
weight form"): one class here, one registry line in the test."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels.weight_forms import WeightForm


class Float16Copy(WeightForm):
    """A float32 weight on a CPU kept as float16, half the bytes, widened to float32 for each product."""

    kind = "float16 copy"

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.half()

    @classmethod
    def make(cls, weight, blocks, options):
        return cls(weight) if weight.device.type == "cpu" and weight.dtype == torch.float32 else None

    def __call__(self, x, bias, keep=False):
        return F.linear(x, self.weight.float(), bias)

    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def describe(self) -> str:
        return "float16 copy"
