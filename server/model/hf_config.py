"""What a HF model directory's config.json (and generation_config.json) says, as a `ModelConfig`.

One function per family that needs more than the Llama fields: the mixture-of-experts fields
(Qwen3-MoE, Mixtral) and Gemma 3's. Gemma 3's config.json leaves much to its config class's
defaults and conversions (the layer pattern, the local RoPE base, the text config inside a
multimodal one), so it is read through transformers' own `Gemma3TextConfig`, which fills them as HF
does. A field a family needs and the file lacks is named in the error.
"""

from __future__ import annotations

import json
from pathlib import Path

from tandem.server.model.config import ROPE_TYPES, SUPPORTED_ARCHITECTURES, ModelConfig, yarn_mscale


class ConfigError(ValueError):
    """config.json cannot describe a model tandem runs; the message names the field."""


def read_config(directory: Path, weight_names: set[str], name: str) -> ModelConfig:
    """The model in `directory`; `weight_names`: the tensors its safetensors hold, under HF names."""
    cfg = json.loads((directory / "config.json").read_text())
    model_type = cfg.get("model_type", "llama")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"model_type {model_type!r} is not one of {SUPPORTED_ARCHITECTURES}")
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?")
        raise ConfigError(f"quantization_config ({method}): tandem loads unquantized weights (float32, bfloat16, "
                          "float16); use a dequantized copy of the checkpoint")
    if model_type in ("gemma3", "gemma3_text"):
        fields = _gemma3_fields(cfg)
    elif model_type == "deepseek_v3":
        fields = _deepseek_v3_fields(cfg)
    else:
        fields = _llama_fields(cfg, model_type)
    if "tie_word_embeddings" not in fields:
        fields["tie_word_embeddings"] = cfg.get("tie_word_embeddings", "lm_head.weight" not in weight_names)
    scaling = fields.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ConfigError(f"rope_scaling type {kind!r} is not supported: tandem runs {', '.join(ROPE_TYPES)}")
    return ModelConfig(architecture=model_type, eos_token_ids=_eos_token_ids(directory, cfg), name=name, **fields)


def _need(cfg: dict, key: str, model_type: str):
    if cfg.get(key) is None:
        raise ConfigError(f"config.json has no {key!r}, which a {model_type} model needs")
    return cfg[key]


def _llama_fields(cfg: dict, model_type: str) -> dict:
    """Llama, Mistral, Qwen2, Qwen3 and, with `_moe_fields`, Qwen3-MoE and Mixtral."""
    num_heads = _need(cfg, "num_attention_heads", model_type)
    hidden = _need(cfg, "hidden_size", model_type)
    # transformers 5 writes rope_theta and any scaling into one rope_parameters; older files, apart
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or _scaling(rope)
    return dict(
        vocab_size=_need(cfg, "vocab_size", model_type),
        hidden_size=hidden,
        intermediate_size=_need(cfg, "intermediate_size", model_type),
        num_layers=_need(cfg, "num_hidden_layers", model_type),
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads", num_heads),
        head_dim=cfg.get("head_dim") or hidden // num_heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=cfg.get("rope_theta") or rope.get("rope_theta", 10000.0),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        attention_bias=model_type == "qwen2" or cfg.get("attention_bias", False),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        rope_scaling=scaling,
        bos_token_id=cfg.get("bos_token_id"),
        **_moe_fields(cfg, model_type),
        **_window_fields(cfg, model_type),
    )


def _window_fields(cfg: dict, model_type: str) -> dict:
    """Sliding-window attention as HF reads these configs: Mistral's and Mixtral's `sliding_window`
    covers every layer (Mistral's is 4096 where the file is silent, as MistralConfig's default);
    Qwen2's and Qwen3's only where `use_sliding_window`, on the layers `layer_types` names, else on
    those from `max_window_layers` on."""
    layers = _need(cfg, "num_hidden_layers", model_type)
    if model_type in ("mistral", "mixtral"):
        window = cfg.get("sliding_window", 4096 if model_type == "mistral" else None)
        sliding = tuple(range(layers))
    elif cfg.get("use_sliding_window"):
        window = cfg.get("sliding_window", 4096)
        types = cfg.get("layer_types") or ["sliding_attention" if i >= cfg.get("max_window_layers", 28)
                                           else "full_attention" for i in range(layers)]
        sliding = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
    else:
        window = None
    return dict(sliding_window=window, sliding_layers=sliding) if window else {}


def _moe_fields(cfg: dict, model_type: str) -> dict:
    """ModelConfig's mixture-of-experts fields (none for a dense model): a layer's MLP is sparse
    unless listed in mlp_only_layers, every decoder_sparse_step-th layer."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0  # the latter as transformers 5 writes it
    if not experts:
        return {}
    layers = _need(cfg, "num_hidden_layers", model_type)
    step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
    sparse = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    width = cfg.get("moe_intermediate_size") or _need(cfg, "intermediate_size", model_type)  # Mixtral: one width
    return dict(num_experts=experts, experts_per_token=_need(cfg, "num_experts_per_tok", model_type),
                norm_topk_prob=cfg.get("norm_topk_prob", True), sparse_layers=sparse, expert_intermediate_size=width)


def _gemma3_fields(cfg: dict) -> dict:
    """Gemma 3's text model, from a gemma3_text config or the text_config of a multimodal gemma3
    one, with Gemma3TextConfig's defaults where the file is silent."""
    from transformers import Gemma3TextConfig

    text = cfg.get("text_config", {}) if cfg.get("model_type") == "gemma3" else cfg
    c = Gemma3TextConfig(**{k: v for k, v in text.items() if k != "model_type"})
    for field in ("final_logit_softcapping", "attn_logit_softcapping"):
        if getattr(c, field) is not None:
            raise ConfigError(f"{field}={getattr(c, field)}: tandem runs Gemma 3 without softcapping (as released)")
    if c.use_bidirectional_attention:
        raise ConfigError("use_bidirectional_attention=true (an embedding model): tandem serves causal models")
    if c.hidden_activation != "gelu_pytorch_tanh":
        raise ConfigError(f"hidden_activation={c.hidden_activation!r}: tandem runs Gemma 3's gelu_pytorch_tanh")
    unknown = set(c.layer_types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ConfigError(f"layer_types {sorted(unknown)}: tandem runs sliding_attention and full_attention layers")
    full, local = c.rope_parameters["full_attention"], c.rope_parameters["sliding_attention"]
    if local.get("rope_type", "default") != "default":
        raise ConfigError(f"rope_parameters.sliding_attention: rope_type {local['rope_type']!r} is not supported "
                          "on sliding-window layers (default only)")
    sliding = tuple(i for i, kind in enumerate(c.layer_types) if kind == "sliding_attention")
    if sliding and not c.sliding_window:
        raise ConfigError("config.json has no 'sliding_window', which gemma3's sliding_attention layers need")
    return dict(
        **_shape_fields(c),
        num_kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        rope_theta=full["rope_theta"],
        rope_scaling=_scaling(full),
        tie_word_embeddings=cfg.get("tie_word_embeddings", c.tie_word_embeddings),
        attention_bias=c.attention_bias,
        qk_norm=True,
        sliding_window=c.sliding_window if sliding else 0,
        sliding_layers=sliding,
        local_rope_theta=local["rope_theta"],
        attention_scale=c.query_pre_attn_scalar**-0.5,
        hidden_act="gelu_tanh",
        norm_offset=True,
        sandwich_norms=True,
        embed_scale=True,
    )


def _deepseek_v3_fields(cfg: dict) -> dict:
    """DeepSeek-V3 (and models of its architecture, Kimi K2 among them): latent attention, the first
    `first_k_dense_replace` layers dense and the rest DeepSeek's mixture of experts; read through
    transformers' DeepseekV3Config, which fills its defaults and converts the rope settings."""
    from transformers import DeepseekV3Config

    c = DeepseekV3Config(**{k: v for k, v in cfg.items() if k != "model_type"})
    if getattr(c, "moe_layer_freq", 1) != 1:
        raise ConfigError(f"moe_layer_freq={c.moe_layer_freq}: tandem runs DeepSeek-V3 with every layer after the "
                          "dense ones sparse")
    rope = c.rope_parameters
    scaling = _scaling(rope)
    scale = (c.qk_nope_head_dim + c.qk_rope_head_dim) ** -0.5
    if scaling and scaling.get("mscale_all_dim"):  # YaRN's correction of the attention's temperature
        scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    return dict(
        **_shape_fields(c),
        num_kv_heads=c.num_attention_heads,  # each head's K and V come from the one shared latent
        head_dim=c.qk_nope_head_dim + c.qk_rope_head_dim,
        rope_theta=rope["rope_theta"],
        rope_scaling=scaling,
        attention_bias=False,
        attention_scale=scale,
        num_experts=c.n_routed_experts,
        experts_per_token=c.num_experts_per_tok,
        norm_topk_prob=c.norm_topk_prob,
        sparse_layers=tuple(range(c.first_k_dense_replace, c.num_hidden_layers)),
        expert_intermediate_size=c.moe_intermediate_size,
        scoring="sigmoid",
        n_group=c.n_group or 1,
        topk_group=c.topk_group or 1,
        routed_scaling_factor=c.routed_scaling_factor,
        shared_experts=c.n_shared_experts or 0,
        kv_lora_rank=c.kv_lora_rank,
        q_lora_rank=c.q_lora_rank or 0,
        qk_nope_head_dim=c.qk_nope_head_dim,
        qk_rope_head_dim=c.qk_rope_head_dim,
        v_head_dim=c.v_head_dim,
        rope_interleave=bool(c.rope_interleave),
    )


def _shape_fields(c) -> dict:
    """The fields every family's transformers config object gives alike."""
    return dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads, rms_norm_eps=c.rms_norm_eps,
                max_position_embeddings=c.max_position_embeddings, bos_token_id=c.bos_token_id)


def _scaling(rope: dict) -> dict | None:
    """HF's rope parameters as ModelConfig.rope_scaling: None for plain RoPE."""
    return rope if rope.get("rope_type", "default") != "default" else None


def _eos_token_ids(directory: Path, cfg: dict) -> tuple[int, ...]:
    """config.json's eos_token_id and generation_config.json's, which instruction-tuned models use
    for their end-of-turn tokens (Gemma 3's <end_of_turn>, Llama 3's <|eot_id|>)."""
    ids: list[int] = []
    generation = directory / "generation_config.json"
    sources = [cfg.get("eos_token_id"), (cfg.get("text_config") or {}).get("eos_token_id")]
    if generation.is_file():
        sources.append(json.loads(generation.read_text()).get("eos_token_id"))
    for eos in sources:
        for i in eos if isinstance(eos, list) else [eos] if eos is not None else []:
            if i not in ids:
                ids.append(int(i))
    return tuple(ids)
