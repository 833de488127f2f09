"""Mixture of experts: model directories written by HF transformers' Qwen3MoeForCausalLM (the top-k
router weights renormalized or not, a dense layer among the sparse ones) and MixtralForCausalLM
(its own weight names) load through tandem's loader and give HF's float32 logits; a
tensor-parallel rank is refused by name."""

from __future__ import annotations

import pytest
import torch

from support.tiny_models import assert_hf_logits, write_mixtral, write_qwen3_moe
from tandem.server.model.llama import LlamaForCausalLM
from tandem.server.model.loader import load_weights, resolve_model
from tandem.server.model.shard import Shard


@pytest.mark.parametrize("renormalize", [True, False], ids=["norm-topk", "raw-topk"])
def test_qwen3_moe_gives_hf_float32_logits(tmp_path, renormalize):
    hf = write_qwen3_moe(tmp_path, norm_topk_prob=renormalize)
    config, weights = load_weights(resolve_model(str(tmp_path)))
    assert config.architecture == "qwen3_moe" and config.qk_norm
    assert (config.num_experts, config.experts_per_token, config.norm_topk_prob) == (8, 2, renormalize)
    assert config.sparse_layers == (0, 2)  # layer 1 is in mlp_only_layers
    ours = LlamaForCausalLM(config, weights, torch.float32, "cpu")
    assert ours.layers[1].moe is None and ours.layers[0].moe is not None
    ids = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    assert_hf_logits(ours, hf, ids)
    # 40 tokens, 2 experts each, over 8 experts: every layer's pass used several experts
    _, experts = ours.layers[0].moe.route(torch.randn(40, config.hidden_size))
    assert len(experts.unique()) > 2


def test_a_moe_model_is_refused_on_a_tensor_parallel_rank(tmp_path):
    write_qwen3_moe(tmp_path)
    config, weights = load_weights(resolve_model(str(tmp_path)))
    with pytest.raises(ValueError, match=r"--tp-size=2: mixture-of-experts models \(qwen3_moe\) run on one rank"):
        LlamaForCausalLM(config, weights, torch.float32, "cpu", shard=Shard(0, 2), all_reduce=lambda t: t)


def test_mixtral_gives_hf_float32_logits(tmp_path):
    hf = write_mixtral(tmp_path)
    config, weights = load_weights(resolve_model(str(tmp_path)))
    assert config.architecture == "mixtral" and not config.qk_norm
    assert (config.num_experts, config.experts_per_token, config.norm_topk_prob, config.sparse_layers) == (4, 2, True, (0, 1))
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in weights  # read under Qwen3-MoE's names
    ours = LlamaForCausalLM(config, weights, torch.float32, "cpu")
    ids = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(4))
    assert_hf_logits(ours, hf, ids)
