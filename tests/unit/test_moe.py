"""Mixture of experts: model directories written by HF transformers' Qwen3MoeForCausalLM (the top-k
router weights renormalized or not, a dense layer among the sparse ones) and MixtralForCausalLM
(its own weight names) load through tandem's loader and give HF's float32 logits; under tensor
parallelism each rank's experts hold a share of every expert's features, and the ranks' partial
outputs sum to the whole layer's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from support.tiny_models import assert_hf_logits, write_mixtral, write_qwen3_moe
from tandem.server.model.llama import LlamaForCausalLM
from tandem.server.model.loader import load_weights, resolve_model
from tandem.server.model.moe import SparseMoE
from tandem.server.model.precision import Precision
from tandem.server.model.shard import Shard, shard_model


@pytest.mark.parametrize("renormalize", [True, False], ids=["norm-topk", "raw-topk"])
def test_qwen3_moe_gives_hf_float32_logits(tmp_path, renormalize):
    hf = write_qwen3_moe(tmp_path, norm_topk_prob=renormalize)
    config, weights = load_weights(resolve_model(str(tmp_path)))
    assert config.architecture == "qwen3_moe" and config.qk_norm
    assert (config.num_experts, config.experts_per_token, config.norm_topk_prob) == (8, 2, renormalize)
    assert config.sparse_layers == (0, 2)  # layer 1 is in mlp_only_layers
    ours = LlamaForCausalLM(config, weights, Precision.uniform(torch.float32), "cpu")
    assert ours.layers[1].moe is None and ours.layers[0].moe is not None
    ids = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    assert_hf_logits(ours, hf, ids)
    # 40 tokens, 2 experts each, over 8 experts: every layer's pass used several experts
    _, experts = ours.layers[0].moe.route(torch.randn(40, config.hidden_size))
    assert len(experts.unique()) > 2


@pytest.mark.parametrize("writer", [write_qwen3_moe, write_mixtral], ids=["qwen3_moe", "mixtral"])
def test_tensor_parallel_ranks_sum_to_the_whole_moe_layer(tmp_path, writer):
    """Two ranks' shares of a sparse layer: the same router, half of every expert's features; the
    sum of their outputs (what the all-reduce after the MLP computes) is the unsplit layer's."""
    writer(tmp_path)
    config, weights = load_weights(resolve_model(str(tmp_path)))
    whole = SparseMoE(config, "model.layers.0.", weights)
    x = torch.randn(24, config.hidden_size, generator=torch.Generator().manual_seed(5))
    parts = []
    for rank in range(2):
        local, w, _ = shard_model(config, weights, {}, Shard(rank, 2))
        assert local.expert_intermediate_size == config.expert_intermediate_size // 2
        assert torch.equal(w["model.layers.0.mlp.gate.weight"], weights["model.layers.0.mlp.gate.weight"])
        assert w["model.layers.0.mlp.experts.3.down_proj.weight"].shape[1] == local.expert_intermediate_size
        parts.append(SparseMoE(local, "model.layers.0.", w)(x))
    torch.testing.assert_close(parts[0] + parts[1], whole(x), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(parts[0], whole(x), atol=1e-3)


def test_tensor_parallelism_names_an_expert_width_it_cannot_split(tmp_path):
    write_mixtral(tmp_path)
    config, _ = load_weights(resolve_model(str(tmp_path)))
    with pytest.raises(ValueError, match=r"--tp-size=3 is invalid for .*: it must divide the model's 64 features of "
                                         r"each expert"):
        Shard(0, 3).check(dataclasses.replace(config, num_heads=6, num_kv_heads=3, intermediate_size=96))


def test_mixtral_gives_hf_float32_logits(tmp_path):
    hf = write_mixtral(tmp_path)
    config, weights = load_weights(resolve_model(str(tmp_path)))
    assert config.architecture == "mixtral" and not config.qk_norm
    assert (config.num_experts, config.experts_per_token, config.norm_topk_prob, config.sparse_layers) == (4, 2, True, (0, 1))
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in weights  # read under Qwen3-MoE's names
    ours = LlamaForCausalLM(config, weights, Precision.uniform(torch.float32), "cpu")
    ids = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(4))
    assert_hf_logits(ours, hf, ids)


def test_the_per_expert_loop_gives_the_grouped_gemms_output(tmp_path):
    """Where torch has no grouped GEMM for the device and dtype, each expert's rows go through
    their own matmuls: same rows, same order, the same result."""
    write_qwen3_moe(tmp_path)
    config, weights = load_weights(resolve_model(str(tmp_path)))
    moe = SparseMoE(config, "model.layers.2.", weights)
    assert moe.grouped  # on a CPU
    x = torch.randn(33, config.hidden_size, generator=torch.Generator().manual_seed(6))
    grouped = moe(x)
    moe.grouped = False
    torch.testing.assert_close(moe(x), grouped, atol=1e-5, rtol=1e-5)
