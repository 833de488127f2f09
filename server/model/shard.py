"""Megatron-style tensor parallelism: which slice of each weight a rank holds.

Rank r of `size` holds heads [r * H / size, (r + 1) * H / size) of the query heads and the same
share of the KV heads, and the same share of the MLP's intermediate features:
- column-parallel (rows of the [out, in] weight): q, k, v (and their biases), gate, up;
- row-parallel (columns): o and down, whose partial outputs the ranks sum (an all-reduce);
- mixture of experts: every rank holds the same share of every expert's features, split as the
  dense MLP's (gate, up by rows; down by columns), and the whole router, so that all ranks route
  each token alike and the one all-reduce after the MLP sums the experts' partial outputs too;
- multi-head latent attention: q (or q_b) and kv_b split by heads, o by columns; the latent's
  projections (q_a, kv_a) and its cache replicated, every rank holding all of it;
- replicated: the embedding, the norms; the lm_head lives on rank 0 only, which alone samples
  (vocab-parallel logits would add a gather of [rows, vocab] per step to save 1/size of a
  [hidden, vocab] product that only rank 0 needs).

A rank's layers are then an ordinary model with fewer heads: `shard_model` returns the
`ModelConfig` that describes them (the rank's own head and feature counts) with its weights, so
the layer code is the same at every tensor-parallel size.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from tandem.kernels.block_linear import BLOCK, BlockWeights
from tandem.server.model.config import ModelConfig

_COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj",
           "self_attn.q_b_proj", "self_attn.kv_b_proj")  # the last two: MLA's, per head
_ROW = ("self_attn.o_proj", "mlp.down_proj")
# an expert's projections, and DeepSeek's shared experts, split as the dense MLP's
_EXPERT = re.compile(r"^mlp\.(experts\.\d+|shared_experts)\.")


@dataclass(frozen=True)
class Shard:
    """This process's place among the ranks of one server."""

    rank: int = 0
    size: int = 1

    def check(self, config: ModelConfig) -> None:
        """Raise ValueError naming the numbers when `config` cannot be split `size` ways."""
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} of {self.size} is invalid")
        kv_heads = () if config.latent else (("KV heads", config.num_kv_heads),)  # a latent is not split
        for what, count in (("query heads", config.num_heads), *kv_heads,
                            ("MLP intermediate features", config.intermediate_size),
                            ("features of each expert", config.expert_intermediate_size)):
            if count % self.size:
                raise ValueError(f"--tp-size={self.size} is invalid for {config.name}: it must divide the model's "
                                 f"{count} {what} (KV heads are not replicated across ranks)")

    def span(self, total: int) -> slice:
        """This rank's share of `total` items (heads, rows, features)."""
        per = total // self.size
        return slice(self.rank * per, (self.rank + 1) * per)


def local_config(config: ModelConfig, shard: Shard) -> ModelConfig:
    """The rank's layers as a model of their own: its heads and features, everything else alike."""
    shard.check(config)
    return replace(config, num_heads=config.num_heads // shard.size, num_kv_heads=config.num_kv_heads // shard.size,
                   intermediate_size=config.intermediate_size // shard.size,
                   expert_intermediate_size=config.expert_intermediate_size // shard.size)


def shard_model(config: ModelConfig, weights: dict[str, torch.Tensor], blocks: dict[str, BlockWeights],
                shard: Shard) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, BlockWeights]]:
    """Rank `shard.rank`'s weights (HF names, as the loader returns them) and its local config.
    Block weights follow their matrix where the split falls on block boundaries, else are dropped
    (that projection then runs over the float weights)."""
    local = local_config(config, shard)
    if shard.size == 1:
        return local, weights, blocks
    w, b = dict(weights), dict(blocks)
    for name in list(w):
        module, _, kind = name.rpartition(".")
        if not module.startswith("model.layers."):
            continue
        proj = _EXPERT.sub("mlp.", module.split(".", 3)[3])
        if proj in _COLUMN:
            rows = shard.span(w[name].shape[0])
            w[name] = w[name][rows].contiguous()
            if name in b:
                b[name] = b[name].rows(rows)
        elif proj in _ROW and kind == "weight":
            cols = shard.span(w[name].shape[1])
            w[name] = w[name][:, cols].contiguous()
            if name in b:
                if cols.start % BLOCK or cols.stop % BLOCK:
                    del b[name]
                else:
                    b[name] = b[name].columns(cols.start // BLOCK, cols.stop // BLOCK)
    if shard.rank != 0:  # only rank 0 computes logits
        head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        b.pop(head, None)
        w.pop("lm_head.weight", None)
    return local, w, b
