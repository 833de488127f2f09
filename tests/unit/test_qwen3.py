"""Qwen3 (dense): a model directory written by HF transformers' Qwen3ForCausalLM loads through
tandem's loader and gives its float32 logits. What Qwen3 adds to the Llama family is an RMSNorm
over each head's q and k before rotary, and a head_dim that is not hidden_size / heads."""

from __future__ import annotations

import pytest
import torch

from support.tiny_models import assert_hf_logits, forward_logits, write_qwen3
from tandem.server.model.llama import LlamaForCausalLM
from tandem.server.model.loader import load_weights, resolve_model
from tandem.server.model.precision import Precision
from tandem.server.model.shard import Shard, shard_model


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A small random Qwen3 written by HF (safetensors + config.json), and HF's model."""
    path = tmp_path_factory.mktemp("qwen3")
    return path, write_qwen3(path)


def test_the_loader_reads_qwen3s_config(qwen3_dir):
    path, _ = qwen3_dir
    config, weights = load_weights(resolve_model(str(path)))
    assert config.architecture == "qwen3" and config.qk_norm and not config.attention_bias
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.hidden_size) == (6, 2, 32, 96)
    assert weights["model.layers.0.self_attn.q_norm.weight"].shape == (32,)


def test_qwen3_gives_hf_float32_logits(qwen3_dir):
    path, hf = qwen3_dir
    config, weights = load_weights(resolve_model(str(path)))
    ours = LlamaForCausalLM(config, weights, Precision.uniform(torch.float32), "cpu")
    ids = torch.randint(0, config.vocab_size, (20,), generator=torch.Generator().manual_seed(1))
    expected = assert_hf_logits(ours, hf, ids)
    # Without the q/k norms the same weights give other logits: the test sees them.
    plain = LlamaForCausalLM(config.__class__(**{**config.__dict__, "qk_norm": False}), weights, Precision.uniform(torch.float32), "cpu")
    assert not torch.allclose(forward_logits(plain, ids), expected, atol=1e-2)


def test_tensor_parallel_ranks_keep_the_whole_qk_norms(qwen3_dir):
    """The norms act on each head's head_dim, so every rank holds all of them, unsplit."""
    path, _ = qwen3_dir
    config, weights = load_weights(resolve_model(str(path)))
    local, w, _ = shard_model(config, weights, {}, Shard(1, 2))
    assert local.num_heads == 3 and local.num_kv_heads == 1
    for name in ("q_norm", "k_norm"):
        key = f"model.layers.2.self_attn.{name}.weight"
        assert torch.equal(w[key], weights[key])


GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def test_a_qwen3_gguf_gives_hf_float32_logits(qwen3_dir, tmp_path):
    """The same weights written as llama.cpp names them (float32 GGUF: llama.cpp leaves Qwen's q/k
    rows in HF's order)."""
    import gguf

    path, hf = qwen3_dir
    c = hf.config
    writer = gguf.GGUFWriter(str(tmp_path / "qwen3.gguf"), "qwen3")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(1e6)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_vocab_size(c.vocab_size)
    for name, t in hf.state_dict().items():
        if name.startswith("model.layers."):
            _, _, layer, module = name.removesuffix(".weight").split(".", 3)
            name = f"blk.{layer}.{GGUF_NAMES[module]}.weight"
        else:
            name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                    "lm_head.weight": "output.weight"}[name]
        writer.add_tensor(name, t.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config, weights = load_weights(resolve_model(str(tmp_path / "qwen3.gguf")))
    assert config.architecture == "qwen3" and config.qk_norm and config.head_dim == 32
    ours = LlamaForCausalLM(config, weights, Precision.uniform(torch.float32), "cpu")
    ids = torch.randint(0, c.vocab_size, (20,), generator=torch.Generator().manual_seed(2))
    assert_hf_logits(ours, hf, ids)
