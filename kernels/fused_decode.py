"""A decoder layer's whole decode step in one native call (`csrc/decode_layer.cpp`), where the
layer and the step allow it: float32 on a CPU that runs tandem's kernels, the four projections in
4-bit blocks without biases (`Linear` over `Nibbles` or `NibbleStripes`), a plain Llama layer (SiLU MLP, no extra
norms, one rank), and a step of decodes alone that the attention backend reads in place from the
paged cache (`AttentionBackend.decode_in_place`), of at most `BLOCK_MAX_ROWS` rows. Where the
layer's projections take steps of `Linear.bfloat16_min_rows` rows or more in bfloat16
(`Linear.bfloat16_blocks`), so does the call.

The call runs the kernels the Python layer runs, in the same order, on the same values: its output
equals that layer's bit for bit (tests/engine/test_fused_decode.py). What it saves is the glue: ~25
calls per layer through Python and torch's dispatcher, most of the serial time of a one-sequence
decode step on a small model.
"""

from __future__ import annotations

import weakref

import torch

from tandem.kernels import layer_ops
from tandem.kernels.attention import AttentionBackend
from tandem.kernels.block_linear import BLOCK_MAX_ROWS, Nibbles, NibbleStripes
from tandem.kernels.linear import Linear

CACHE_DTYPES = (torch.float32, torch.bfloat16)  # KV caches decode_layer_q4 writes (bfloat16: rounded) and reads

_enabled = [True]


def use_fused_decode(enabled: bool) -> None:
    """Whether layers that can take the fused call do (the default), or run op by op (a baseline
    to measure and test against)."""
    _enabled[0] = enabled


class FusedDecodeLayer:
    """The fixed operands of one layer's `decode_layer_q4` call (`build`), called per step."""

    def __init__(self, input_norm: torch.Tensor, mlp_norm: torch.Tensor, eps: float,
                 projections: tuple[Linear, Linear, Linear, Linear], num_heads: int, num_kv_heads: int):
        self.input_norm, self.mlp_norm, self.eps = input_norm, mlp_norm, eps
        self.qkv, self.o, self.gate_up, self.down = ([p.blocks.q, p.blocks.scale, p.blocks.offset] for p in projections)
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        # steps of this many rows multiply in bfloat16, as the Linears do (0: never)
        self.bfloat16_rows = projections[0].bfloat16_min_rows if projections[0].bfloat16_blocks else 0

    @staticmethod
    def build(input_norm: torch.Tensor, mlp_norm: torch.Tensor, eps: float,
              projections: tuple[Linear, Linear, Linear, Linear], num_heads: int,
              num_kv_heads: int) -> FusedDecodeLayer | None:
        """The fused form of a layer with these parts, or None where they do not allow it (the
        projections not all 4-bit blocks without bias or not all turning to bfloat16 at the same rows,
        the norms not float32 on the CPU)."""
        if not all(isinstance(p.blocks, (Nibbles, NibbleStripes)) and p.bias is None for p in projections):
            return None
        if len({p.bfloat16_min_rows for p in projections}) > 1:
            return None
        if input_norm.device.type != "cpu" or input_norm.dtype != torch.float32:
            return None
        return FusedDecodeLayer(input_norm, mlp_norm, eps, projections, num_heads, num_kv_heads)

    def __call__(self, layer: int, h: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor,
                 sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor | None:
        """The layer's output for this step (h updated in place as `DecoderLayer.forward` updates
        it), or None where the step does not fit: the caller runs the layer op by op."""
        if not _enabled[0] or h.shape[0] > BLOCK_MAX_ROWS or not layer_ops.native_kernels(h):
            return None
        paged = attn.decode_in_place(layer)
        if paged is None or paged.k_cache.dtype not in CACHE_DTYPES or not cos.is_contiguous():
            return None
        return torch.ops.tandem.decode_layer_q4(
            h, delta, self.input_norm, self.mlp_norm, self.eps, self.qkv, self.o, self.gate_up, self.down, cos, sin,
            paged.k_cache, paged.v_cache, paged.slots, paged.page_table, paged.kv_lens, self.num_heads,
            self.num_kv_heads, paged.scale, paged.window, self.bfloat16_rows)


class FusedDecodeStack:
    """Every layer of a model as `FusedDecodeLayer` runs it, in one native call per decode step
    (`torch.classes.tandem.DecodeStackQ4`): the per-layer checks and calls from Python are made once
    per step. Bit for bit the layers called one by one (tests/engine/test_fused_decode.py)."""

    def __init__(self, layers: list[FusedDecodeLayer]):
        first = layers[0]
        weights = [t for f in layers for t in (f.input_norm, f.mlp_norm, *f.qkv, *f.o, *f.gate_up, *f.down)]
        self.stack = torch.classes.tandem.DecodeStackQ4(weights, first.eps, first.num_heads, first.num_kv_heads,
                                                        first.bfloat16_rows)
        self.num_layers = len(layers)
        # per attention backend: each layer's K and V caches and window (dropped with the backend)
        self._caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @staticmethod
    def build(layers: list[FusedDecodeLayer | None]) -> FusedDecodeStack | None:
        """The stack of these layers, or None where one of them cannot be fused or they differ in
        their eps, heads or bfloat16 rows."""
        if not layers or any(f is None for f in layers):
            return None
        first = layers[0]
        shape = (first.eps, first.num_heads, first.num_kv_heads, first.bfloat16_rows)
        if any((f.eps, f.num_heads, f.num_kv_heads, f.bfloat16_rows) != shape for f in layers):
            return None
        return FusedDecodeStack(layers)

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 attn: AttentionBackend) -> torch.Tensor | None:
        """The last layer's output (h updated in place), or None where the step does not fit, as
        for `FusedDecodeLayer`: the caller runs the layers one by one."""
        if not _enabled[0] or h.shape[0] > BLOCK_MAX_ROWS or not layer_ops.native_kernels(h) or not cos.is_contiguous():
            return None
        paged = attn.decode_in_place(0)
        if paged is None or paged.k_cache.dtype not in CACHE_DTYPES:
            return None
        caches = self._caches.get(attn)
        if caches is None:
            per_layer = [attn.decode_in_place(i) for i in range(self.num_layers)]
            caches = self._caches[attn] = ([p.k_cache for p in per_layer], [p.v_cache for p in per_layer],
                                           [p.window for p in per_layer])
        k_caches, v_caches, windows = caches
        return self.stack.forward(h, cos, sin, k_caches, v_caches, paged.slots, paged.page_table, paged.kv_lens,
                                  paged.scale, windows)
