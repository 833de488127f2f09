"""Small random models of the architectures tandem loads, written by HF transformers as a model
directory (config.json, safetensors): the reference is HF's own module."""

from __future__ import annotations

from pathlib import Path


def write_qwen3(path: Path, seed: int = 0, vocab_size: int = 320):
    """A 3-layer Qwen3 (6 query heads, 2 KV heads, head_dim 32 unlike hidden/heads, vocabulary of
    320) in `path`, with q/k norm weights away from HF's ones; returns HF's model (float32, eval)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab_size, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                         rope_theta=1e6, max_position_embeddings=512, tie_word_embeddings=False)
    hf = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # HF initializes them to ones: make them matter
        for layer in hf.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    hf.save_pretrained(path)
    return hf


def write_qwen3_moe(path: Path, norm_topk_prob: bool = True, seed: int = 0, vocab_size: int = 320):
    """A 3-layer Qwen3-MoE (8 experts, 2 per token; layer 1 dense through mlp_only_layers) in
    `path`, with q/k norm weights away from HF's ones; returns HF's model (float32, eval)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(vocab_size=vocab_size, hidden_size=96, intermediate_size=192, moe_intermediate_size=48,
                            num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, head_dim=32,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob,
                            decoder_sparse_step=1, mlp_only_layers=[1], rms_norm_eps=1e-6, rope_theta=1e6,
                            max_position_embeddings=512, tie_word_embeddings=False)
    hf = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
            if hasattr(layer.mlp, "gate"):  # routers that prefer some experts, as trained ones do
                layer.mlp.gate.weight.normal_(0, 0.5)
    hf.save_pretrained(path)
    return hf


def write_mixtral(path: Path, seed: int = 0, vocab_size: int = 320):
    """A 2-layer Mixtral (4 experts, 2 per token, every layer sparse) in `path`; returns HF's model."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(vocab_size=vocab_size, hidden_size=96, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=6, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                           num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=512,
                           tie_word_embeddings=False)
    hf = MixtralForCausalLM(config).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    hf.save_pretrained(path)
    return hf


def write_mistral(path: Path, seed: int = 0, vocab_size: int = 320, sliding_window: int | None = 7):
    """A 2-layer Mistral whose sliding window (every layer's) is shorter than the prompts; returns
    HF's model (float32, eval)."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    config = MistralConfig(vocab_size=vocab_size, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                           num_attention_heads=6, num_key_value_heads=2, head_dim=16, sliding_window=sliding_window,
                           rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=512, tie_word_embeddings=False)
    hf = MistralForCausalLM(config).eval()
    hf.save_pretrained(path)
    return hf


def write_qwen2(path: Path, seed: int = 0, vocab_size: int = 320):
    """A 3-layer Qwen2 (biases on q, k and v; a sliding window of 7 from layer 1 on, through
    use_sliding_window and max_window_layers); returns HF's model (float32, eval)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
                         num_attention_heads=6, num_key_value_heads=2, use_sliding_window=True, sliding_window=7,
                         max_window_layers=1, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=512,
                         tie_word_embeddings=True)
    hf = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # HF starts the biases at zero: make them matter
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    hf.save_pretrained(path)
    return hf


GEMMA3_LAYERS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def gemma3_text_config(**overrides):
    """A 5-layer Gemma 3 text config: a sliding window of 7 (prompts are longer), layers of both
    kinds, a query_pre_attn_scalar unlike head_dim, linear RoPE scaling on the global layers and
    another base on the local ones."""
    from transformers import Gemma3TextConfig

    fields = dict(vocab_size=320, hidden_size=96, intermediate_size=192, num_hidden_layers=5, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=7,
                  layer_types=GEMMA3_LAYERS, max_position_embeddings=512, rms_norm_eps=1e-6,
                  rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    return Gemma3TextConfig(**{**fields, **overrides})


def perturb_gemma3_norms(model, seed: int = 0) -> None:
    """Gemma's norm weights start at 0 (a scale of 1 + 0): move every one of them, so that a
    missing or misplaced norm shows in the logits."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.rand(param.shape, generator=generator) - 0.5)


def write_gemma3(path: Path, seed: int = 0, **overrides):
    """A Gemma 3 text model (`gemma3_text_config`) in `path`; returns HF's model (float32, eval)."""
    import torch
    from transformers import Gemma3ForCausalLM

    torch.manual_seed(seed)
    hf = Gemma3ForCausalLM(gemma3_text_config(**overrides)).eval()
    perturb_gemma3_norms(hf, seed)
    hf.save_pretrained(path)
    return hf


def deepseek_v3_config(**overrides):
    """A 3-layer DeepSeek-V3: latent attention (kv_lora_rank 32, a rotated part of 16, q through a
    rank-48 pair unless q_lora_rank=None), YaRN on an original context of 128, the first layer dense
    and then 8 routed experts in 4 groups (top 2 of 2 groups) with a shared one."""
    from transformers import DeepseekV3Config

    fields = dict(vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
                  routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=24,
                  qk_nope_head_dim=32, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
                  max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 128, "mscale": 0.707, "mscale_all_dim": 1.0})
    return DeepseekV3Config(**{**fields, **overrides})


def write_deepseek_v3(path: Path, seed: int = 0, vocab_size: int = 320, **overrides):
    """A DeepSeek-V3 (`deepseek_v3_config`) in `path`, its norms, routers and correction biases
    moved off their initial values; returns HF's model (float32, eval)."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    hf = DeepseekV3ForCausalLM(deepseek_v3_config(vocab_size=vocab_size, **overrides)).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0, 0.5, generator=generator)
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "gate"):  # steers the choice, not the weights
                layer.mlp.gate.e_score_correction_bias.copy_(torch.rand(8, generator=generator) * 0.4 - 0.2)
    hf.save_pretrained(path)
    return hf


# Each family's chat template, in the shape its checkpoints ship it (the turn markers are plain text
# to the SmolLM2 tokenizer the tiny models use)
CHAT_TEMPLATES = {
    "qwen3": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}",
    "mixtral": "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
               "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}",
    "deepseek_v3": "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
                   "{% else %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
                   "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}",
    "gemma3": "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' "
              "else m['role'] }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
              "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}",
}


def write_tokenizer(path: Path, family: str) -> None:
    """The built-in model's tokenizer in model directory `path`, with `family`'s chat template in
    tokenizer_config.json, where Qwen3, Mixtral, Gemma 3 and DeepSeek-V3 checkpoints keep it."""
    import json

    from tandem.server.config import EngineConfig
    from tandem.server.model.loader import resolve_model
    from tandem.server.model.tokenizer import export_tokenizer

    export_tokenizer(resolve_model(EngineConfig.model), path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATES[family]}))


def forward_logits(module, ids):
    """Logits at every position of one prompt `ids` through tandem's `module` (LlamaForCausalLM,
    float32), with torch attention over as many 16-token pages as the prompt needs, on the device
    `ids` lie on."""
    import torch

    from tandem.kernels.attention import AttentionBatch
    from tandem.kernels.kv_cache import PagedKVCache, flat_slots
    from tandem.kernels.torch_attention import TorchAttention

    c, n, page, device = module.config, len(ids), 16, ids.device
    pages = list(range(1, -(-n // page) + 1))  # page 0 unused, as in the engine
    cache = PagedKVCache(c.num_layers, len(pages) + 1, page, c.kv_heads, c.kv_dim, torch.float32, device,
                         value_dim=c.kv_value_dim)
    attn = TorchAttention(cache, c.num_heads, c.head_dim, c.softmax_scale, c.layer_windows)
    attn.prepare(AttentionBatch([n], [n], [pages], 1, torch.tensor(flat_slots(pages, 0, n, page), device=device)))
    with torch.inference_mode():
        return module.logits(module(ids, torch.arange(n, device=device), attn))


def assert_hf_logits(module, hf, ids):
    """tandem's `module` gives HF model `hf`'s float32 logits for `ids` (1e-4), and the same argmax
    everywhere; returns HF's logits."""
    import torch

    logits = forward_logits(module, ids)
    with torch.inference_mode():
        expected = hf(ids[None]).logits[0].float()
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    return expected
