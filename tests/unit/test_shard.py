"""Tensor-parallel sharding (tandem.server.model.shard): each rank's slices put together give the
whole weight back, the row-parallel partial products sum to the whole product, block weights
follow their matrix, and a size that does not divide the heads is refused with the numbers."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.block_linear import BLOCK, BlockWeights
from tandem.server.model.config import ModelConfig
from tandem.server.model.shard import Shard, local_config, shard_model

CONFIG = ModelConfig("llama", vocab_size=96, hidden_size=64, intermediate_size=192, num_layers=2, num_heads=6,
                     num_kv_heads=3, head_dim=8, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=128,
                     tie_word_embeddings=True, attention_bias=True, name="toy")


def toy_weights(config: ModelConfig) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h, i, q, kv = config.hidden_size, config.intermediate_size, config.q_size, config.kv_size
    shapes = {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
              "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
              "self_attn.o_proj.weight": (h, q), "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h),
              "mlp.down_proj.weight": (h, i), "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
    w = {f"model.layers.{n}.{name}": torch.randn(shape, generator=g, dtype=torch.float64)
         for n in range(config.num_layers) for name, shape in shapes.items()}
    w["model.embed_tokens.weight"] = torch.randn(config.vocab_size, h, generator=g, dtype=torch.float64)
    w["model.norm.weight"] = torch.randn(h, generator=g, dtype=torch.float64)
    return w


def blocks_of(w: torch.Tensor) -> BlockWeights:
    n, k = w.shape
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    return BlockWeights(q, torch.rand(n, k // BLOCK) + 0.5, torch.rand(n, k // BLOCK))


def shards(size: int, weights, blocks=None):
    return [shard_model(CONFIG, weights, blocks or {}, Shard(rank, size)) for rank in range(size)]


@pytest.mark.parametrize("size", [1, 3])
def test_column_slices_put_together_give_the_weight_back(size):
    w = toy_weights(CONFIG)
    parts = shards(size, w)
    for name in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias", "v_proj.bias"):
        key = f"model.layers.1.self_attn.{name}"
        assert torch.equal(torch.cat([p[1][key] for p in parts]), w[key])
    key = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(torch.cat([p[1][key] for p in parts], dim=1), w[key])
    # Replicated: every rank holds the embedding and the norms whole.
    for _, ws, _ in parts:
        assert torch.equal(ws["model.embed_tokens.weight"], w["model.embed_tokens.weight"])
        assert torch.equal(ws["model.layers.0.input_layernorm.weight"], w["model.layers.0.input_layernorm.weight"])


def test_partial_products_sum_to_the_whole_layer():
    """The MLP of one layer, split 3 ways: gate/up by rows, down by columns, outputs summed."""
    w = toy_weights(CONFIG)
    x = torch.randn(5, CONFIG.hidden_size, dtype=torch.float64)
    p = "model.layers.0.mlp."

    def mlp(ws):
        return (torch.nn.functional.silu(x @ ws[p + "gate_proj.weight"].T) * (x @ ws[p + "up_proj.weight"].T)) @ ws[
            p + "down_proj.weight"].T

    total = sum(mlp(ws) for _, ws, _ in shards(3, w))
    torch.testing.assert_close(total, mlp(w), rtol=1e-12, atol=1e-12)


def test_heads_stay_whole_and_the_local_config_counts_them():
    local, ws, _ = shard_model(CONFIG, toy_weights(CONFIG), {}, Shard(2, 3))
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 64)
    assert (local.hidden_size, local.head_dim, local.vocab_size) == (64, 8, 96)
    assert ws["model.layers.0.self_attn.q_proj.weight"].shape == (local.q_size, 64)
    assert ws["model.layers.0.self_attn.k_proj.weight"].shape == (local.kv_size, 64)
    assert ws["model.layers.0.self_attn.o_proj.weight"].shape == (64, local.q_size)


def test_block_weights_follow_their_slices():
    w = toy_weights(CONFIG)
    down = "model.layers.0.mlp.down_proj.weight"  # [64, 192]: 6 blocks per row, 2 per rank
    gate = "model.layers.0.mlp.gate_proj.weight"
    blocks = {down: blocks_of(w[down]), gate: blocks_of(w[gate])}
    for rank, (_, _, bs) in enumerate(shards(3, w, blocks)):
        torch.testing.assert_close(bs[down].dequantize(), blocks[down].dequantize()[:, 64 * rank : 64 * (rank + 1)])
        torch.testing.assert_close(bs[gate].dequantize(), blocks[gate].dequantize()[64 * rank : 64 * (rank + 1)])
    # A split off block boundaries drops the blocks and keeps the float weight: o_proj is [64, 48],
    # 16 columns per rank. (Its blocks here are a stand-in of another width: they are never read.)
    o = "model.layers.0.self_attn.o_proj.weight"
    _, ws, bs = shard_model(CONFIG, w, {o: blocks_of(torch.zeros(64, 64))}, Shard(1, 3))
    assert o not in bs and torch.equal(ws[o], w[o][:, 16:32])


def test_only_rank_zero_keeps_the_lm_head():
    w = toy_weights(CONFIG)
    untied = CONFIG.__class__(**{**CONFIG.__dict__, "tie_word_embeddings": False})
    w["lm_head.weight"] = torch.randn(96, 64, dtype=torch.float64)
    assert "lm_head.weight" in shard_model(untied, w, {}, Shard(0, 3))[1]
    assert "lm_head.weight" not in shard_model(untied, w, {}, Shard(1, 3))[1]


@pytest.mark.parametrize("size, what", [(2, "3 KV heads"), (6, "3 KV heads"), (4, "6 query heads")])
def test_a_size_that_does_not_divide_the_heads_is_refused_with_the_numbers(size, what):
    with pytest.raises(ValueError, match=f"--tp-size={size} is invalid for toy: it must divide the model's {what}"):
        local_config(CONFIG, Shard(0, size))


def test_smollm2_splits_three_ways_not_two():
    smollm = CONFIG.__class__(**{**CONFIG.__dict__, "num_heads": 9, "num_kv_heads": 3, "intermediate_size": 1536,
                                 "name": "SmolLM2-135M"})
    assert local_config(smollm, Shard(0, 3)).num_kv_heads == 1
    with pytest.raises(ValueError, match="must divide the model's 9 query heads"):
        local_config(smollm, Shard(0, 2))
