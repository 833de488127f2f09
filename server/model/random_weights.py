"""Random weights in the shape of a real model, made on the device that will run them.

`--model random:<shape>` serves a model no file holds: the architecture of a known model
(`SHAPES`), its weights drawn from a seeded normal distribution directly on the target device in
the target dtype (an 8B model in bfloat16 is 16 GB, which a CPU would take minutes to draw and
copy). What such a model says is noise, but it makes the same GEMMs, reads the same bytes of
weights and KV cache per step and fills the same memory as the real one: that is what the GPU
benchmarks (`tandem bench gpu`) and the tests of serving at a real size need, where no weights
can be downloaded.

The spec may name a tokenizer after a second colon, `random:llama3-8b:/path/to/tokenizer-dir`
(a directory AutoTokenizer loads, as `tandem export-tokenizer` writes); without one the built-in
model's tokenizer is used. Token ids beyond the tokenizer's vocabulary decode to nothing.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from tandem.server.model.config import ModelConfig

_LLAMA3 = dict(architecture="llama", vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
               max_position_embeddings=8192, attention_bias=False, bos_token_id=128000, eos_token_ids=())

SHAPES: dict[str, ModelConfig] = {
    # Llama-3-8B: GQA (32 query heads over 8 KV heads), head dim 128.
    "llama3-8b": ModelConfig(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                             head_dim=128, tie_word_embeddings=False, name="llama3-8b-random", **_LLAMA3),
    # Llama-3.2-1B: the 1B class, tied embeddings, head dim 64.
    "llama3.2-1b": ModelConfig(hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                               num_kv_heads=8, head_dim=64, tie_word_embeddings=True, name="llama3.2-1b-random",
                               **_LLAMA3),
}

INIT_STD = 0.02  # of every projection and embedding (HF's initializer_range); norm weights are 1
SEED = 0


def parse_spec(spec: str) -> tuple[str, Path | None]:
    """`random:<shape>[:<tokenizer dir>]` -> (shape, tokenizer dir or None). ValueError names the
    known shapes."""
    shape, _, tokenizer = spec.removeprefix("random:").partition(":")
    if shape not in SHAPES:
        raise ValueError(f"--model {spec!r}: unknown random shape {shape!r}; known: {', '.join(SHAPES)}")
    return shape, Path(tokenizer).expanduser() if tokenizer else None


def shape_config(shape: str, **overrides) -> ModelConfig:
    """The config of `shape`, with fields replaced (tests use smaller layers)."""
    return dataclasses.replace(SHAPES[shape], **overrides)


def parameter_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight a Llama-family model of config `c` has, under HF's names."""
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (c.q_size, c.hidden_size),
            p + "self_attn.k_proj.weight": (c.kv_size, c.hidden_size),
            p + "self_attn.v_proj.weight": (c.kv_size, c.hidden_size),
            p + "self_attn.o_proj.weight": (c.hidden_size, c.q_size),
            p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
            p + "input_layernorm.weight": (c.hidden_size,),
            p + "post_attention_layernorm.weight": (c.hidden_size,),
        })
    return shapes


def random_weights(config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                   seed: int = SEED) -> dict[str, torch.Tensor]:
    """Weights for `config` drawn on `device` in `dtype`: N(0, INIT_STD) for matrices, ones for
    norms. The same seed, dtype and device give the same weights."""
    device = torch.device(device)
    generator = torch.Generator(device).manual_seed(seed)
    weights = {}
    for name, shape in parameter_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=dtype, device=device)
        else:
            weights[name] = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, INIT_STD, generator=generator)
    return weights
