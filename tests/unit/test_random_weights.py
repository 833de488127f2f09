"""`--model random:<shape>`: the shapes, the spec's errors, and weights that load into HF
transformers' Llama under their own names and give its float32 forward pass."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.attention import AttentionBatch
from tandem.kernels.kv_cache import PagedKVCache, flat_slots
from tandem.kernels.torch_attention import TorchAttention
from tandem.server.model.llama import LlamaForCausalLM
from tandem.server.model.loader import ModelLoadError, resolve_model
from tandem.server.model.precision import Precision
from tandem.server.model.random_weights import SHAPES, parameter_shapes, parse_spec, random_weights, shape_config


def test_shapes_are_the_real_models():
    c = SHAPES["llama3-8b"]
    params = sum(torch.Size(s).numel() for s in parameter_shapes(c).values())
    assert c.num_heads // c.num_kv_heads == 4 and c.head_dim == 128
    assert 8.0e9 < params < 8.1e9  # Llama-3-8B: 8.03B
    one_b = sum(torch.Size(s).numel() for s in parameter_shapes(SHAPES["llama3.2-1b"]).values())
    assert 1.2e9 < one_b < 1.3e9  # Llama-3.2-1B: 1.24B (tied embeddings)


def test_spec_names_shape_and_tokenizer(tmp_path):
    assert parse_spec("random:llama3-8b") == ("llama3-8b", None)
    assert parse_spec(f"random:llama3.2-1b:{tmp_path}") == ("llama3.2-1b", tmp_path)
    with pytest.raises(ModelLoadError, match=r"unknown random shape 'llama9'; known: llama3-8b, llama3.2-1b"):
        resolve_model("random:llama9")
    with pytest.raises(ModelLoadError, match="no tokenizer.json in"):
        resolve_model(f"random:llama3-8b:{tmp_path}")
    source = resolve_model("random:llama3-8b")
    assert source.kind == "random" and source.name == "llama3-8b" and source.path.suffix == ".gguf"


def test_same_seed_same_weights():
    c = shape_config("llama3-8b", num_layers=1, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                     head_dim=16, vocab_size=100)
    a, b = random_weights(c, torch.bfloat16, "cpu"), random_weights(c, torch.bfloat16, "cpu")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], random_weights(c, torch.bfloat16, "cpu", seed=1)["model.embed_tokens.weight"])
    assert a["model.norm.weight"].eq(1).all() and a["lm_head.weight"].dtype == torch.bfloat16


def test_random_weights_run_as_hf_llama_does():
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    c = shape_config("llama3-8b", num_layers=2, hidden_size=128, intermediate_size=256, num_heads=8, num_kv_heads=2,
                     head_dim=16, vocab_size=500)
    weights = random_weights(c, torch.float32, "cpu")
    hf = HFLlama(LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                             num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                             num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                             rope_theta=c.rope_theta, max_position_embeddings=c.max_position_embeddings,
                             tie_word_embeddings=False)).eval()
    hf.load_state_dict(weights, strict=True)  # every name and shape is HF's
    ours = LlamaForCausalLM(c, weights, Precision.uniform(torch.float32), "cpu")
    ids = torch.randint(0, c.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    cache = PagedKVCache(c.num_layers, 4, 16, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    attn = TorchAttention(cache, c.num_heads, c.head_dim, c.head_dim**-0.5)
    attn.prepare(AttentionBatch([12], [12], [[1]], 1, torch.tensor(flat_slots([1], 0, 12, 16))))
    with torch.inference_mode():
        logits = ours.logits(ours(ids, torch.arange(12), attn))
        expected = hf(ids[None]).logits[0].float()
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
