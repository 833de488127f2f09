"""DeepSeek-V3: model directories written by HF transformers' DeepseekV3ForCausalLM load through
tandem's loader and give HF's float32 logits, with the latent KV cache and the absorbed attention
(q through a low-rank pair, or one projection), YaRN, and DeepSeek's routing (sigmoid scores, a
correction bias, expert groups, scaled weights, a shared expert, a dense first layer). Each part
switched off in turn moves the logits; tensor-parallel ranks keep the latent whole and sum to the
whole layer."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from support.tiny_models import assert_hf_logits, forward_logits, write_deepseek_v3
from tandem.server.model.llama import LlamaForCausalLM
from tandem.server.model.loader import ModelLoadError, load_weights, resolve_model
from tandem.server.model.mla import LatentAttention, deinterleave
from tandem.server.model.moe import SparseMoE
from tandem.server.model.precision import Precision
from tandem.server.model.shard import Shard, shard_model


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek")
    return path, write_deepseek_v3(path)


def prompt(n: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed))


def test_the_loader_reads_deepseek_v3s_config(deepseek_dir):
    path, _ = deepseek_dir
    config, _ = load_weights(resolve_model(str(path)))
    assert config.architecture == "deepseek_v3" and config.latent and config.rope_interleave
    assert (config.kv_heads, config.kv_dim, config.kv_value_dim, config.rope_dim) == (1, 48, 32, 16)
    assert (config.q_lora_rank, config.qk_nope_head_dim, config.v_head_dim) == (48, 32, 24)
    assert (config.scoring, config.n_group, config.topk_group, config.routed_scaling_factor) == ("sigmoid", 4, 2, 2.5)
    assert (config.num_experts, config.experts_per_token, config.shared_experts, config.sparse_layers) == (8, 2, 1, (1, 2))
    assert config.rope_scaling["rope_type"] == "yarn"
    # YaRN's temperature correction: 1/sqrt(48) times mscale(4, mscale_all_dim=1) squared
    assert config.softmax_scale == pytest.approx(48**-0.5 * (0.1 * 1.0 * torch.tensor(4.0).log().item() + 1) ** 2)


@pytest.mark.parametrize("q_lora_rank", [48, None], ids=["q-lora", "q-proj"])
def test_deepseek_v3_gives_hf_float32_logits(tmp_path, q_lora_rank):
    hf = write_deepseek_v3(tmp_path, q_lora_rank=q_lora_rank)
    config, weights = load_weights(resolve_model(str(tmp_path)))
    assert config.q_lora_rank == (q_lora_rank or 0)
    assert_hf_logits(LlamaForCausalLM(config, weights, Precision.uniform(torch.float32), "cpu"), hf, prompt())


@pytest.mark.parametrize("change", [
    dict(rope_interleave=False),
    dict(rope_scaling=None),
    dict(attention_scale=0.0),
    dict(n_group=1),
    dict(routed_scaling_factor=1.0),
    dict(scoring="softmax"),
    dict(shared_experts=0),
], ids=lambda change: next(iter(change)))
def test_each_part_of_deepseek_v3_shows_in_the_logits(deepseek_dir, change):
    """Each change moves some logit by over 10x the comparison's tolerance (the tiny model's logits
    are small: ~0.1)."""
    path, hf = deepseek_dir
    config, weights = load_weights(resolve_model(str(path)))
    ids = prompt()
    with torch.inference_mode():
        expected = hf(ids[None]).logits[0]
    other = LlamaForCausalLM(dataclasses.replace(config, **change), weights, Precision.uniform(torch.float32), "cpu")
    assert (forward_logits(other, ids) - expected).abs().max() > 1e-3


def test_the_correction_bias_steers_the_choice_not_the_weights(deepseek_dir):
    path, _ = deepseek_dir
    config, weights = load_weights(resolve_model(str(path)))
    moe = SparseMoE(config, "model.layers.1.", weights)
    x = torch.randn(64, config.hidden_size, generator=torch.Generator().manual_seed(3))
    weights_with, chosen_with = moe.route(x)
    moe.bias = None
    _, chosen_without = moe.route(x)
    assert not torch.equal(chosen_with.sort(-1)[0], chosen_without.sort(-1)[0])
    scores = torch.sigmoid(x @ moe.router.T).gather(1, chosen_with)
    torch.testing.assert_close(weights_with, scores / scores.sum(-1, keepdim=True) * 2.5)
    # within the 2 best of 4 groups of 2 experts: each token's experts span at most 2 groups
    assert all(len(set((experts // 2).tolist())) <= 2 for experts in chosen_with)


def test_deinterleave_turns_pairs_into_halves():
    w = torch.arange(2 * 7, dtype=torch.float32)[:, None]  # 2 heads of 3 plain rows and 4 rotary rows
    assert deinterleave(w, 2, 3, 4)[:, 0].tolist() == [0, 1, 2, 3, 5, 4, 6, 7, 8, 9, 10, 12, 11, 13]


def test_tensor_parallel_ranks_hold_the_whole_latent_and_sum_to_the_layer(deepseek_dir):
    """Two ranks of the attention: each its 2 heads of q, kv_b and o, both the whole latent
    projection; given the same latent cache, their outputs sum to the unsplit attention's."""
    from tandem.kernels.attention import AttentionBatch
    from tandem.kernels.kv_cache import PagedKVCache, flat_slots
    from tandem.kernels.torch_attention import TorchAttention

    path, _ = deepseek_dir
    config, weights = load_weights(resolve_model(str(path)))
    n = 20
    x = torch.randn(n, config.hidden_size, generator=torch.Generator().manual_seed(4))
    cos, sin = torch.ones(n, 1, 16), torch.zeros(n, 1, 16)

    def run(c, w):
        cache = PagedKVCache(1, 3, 16, c.kv_heads, c.kv_dim, torch.float32, "cpu", value_dim=c.kv_value_dim)
        attn = TorchAttention(cache, c.num_heads, c.kv_dim, c.softmax_scale)
        attn.prepare(AttentionBatch([n], [n], [[1, 2]], 1, torch.tensor(flat_slots([1, 2], 0, n, 16))))
        with torch.inference_mode():
            return LatentAttention(c, "model.layers.0.", w)(0, x, cos, sin, attn), cache.k[0].clone()

    whole, latent = run(config, weights)
    parts = []
    for rank in range(2):
        local, w, _ = shard_model(config, weights, {}, Shard(rank, 2))
        assert local.num_heads == 2 and local.kv_heads == 1 and local.kv_dim == config.kv_dim
        assert torch.equal(w["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"],
                           weights["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"])
        out, rank_latent = run(local, w)
        assert torch.equal(rank_latent, latent)  # every rank caches the same latent
        parts.append(out)
    torch.testing.assert_close(parts[0] + parts[1], whole, atol=1e-5, rtol=1e-5)


def test_a_quantized_checkpoint_is_refused_by_name(deepseek_dir, tmp_path):
    path, _ = deepseek_dir
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"quantization_config \(fp8\): tandem loads unquantized weights"):
        load_weights(resolve_model(str(tmp_path)))
