"""Small random models of the architectures tandem loads, written by HF transformers as a model
directory (config.json, safetensors): the reference is HF's own module."""

from __future__ import annotations

from pathlib import Path


def write_qwen3(path: Path, seed: int = 0):
    """A 3-layer Qwen3 (6 query heads, 2 KV heads, head_dim 32 unlike hidden/heads, vocabulary of
    320) in `path`, with q/k norm weights away from HF's ones; returns HF's model (float32, eval)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=320, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                         rope_theta=1e6, max_position_embeddings=512, tie_word_embeddings=False)
    hf = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # HF initializes them to ones: make them matter
        for layer in hf.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    hf.save_pretrained(path)
    return hf
