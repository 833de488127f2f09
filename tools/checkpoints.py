"""Random checkpoints in the proportions of released models, small enough for a CPU, for the
benchmarks (nothing can be downloaded here, and a speed or a KV size depends on the architecture,
not on trained weights). HF transformers writes each directory (config.json, safetensors); the
built-in model's tokenizer goes beside it, so prompts are SmolLM2 token ids.

    python -m tandem.tools.checkpoints qwen3-moe DIR    # Qwen3-30B-A3B's proportions at a quarter width
    python -m tandem.tools.checkpoints deepseek-v3 DIR  # DeepSeek-V3's latent attention and MoE, ditto
    python -m tandem.tools.checkpoints llama DIR        # a dense Llama of the same hidden size and heads

- qwen3-moe: hidden 512, 64 experts of width 192, 8 per token (Qwen3-30B-A3B: 2048, 128 of 768, 8).
- deepseek-v3: hidden 512, 8 heads, a latent of 128 + a rotated key part of 32 per token and layer
  (V3: 7168, 128 heads, 512 + 64), q through a rank-192 pair, 32 experts in 8 groups, top 8 of the
  best 4 groups, one shared expert, the first layer dense.
- llama: hidden 512, 8 query and 8 KV heads of 64: the KV of multi-head attention at that width.
"""

from __future__ import annotations

import argparse
from pathlib import Path

VOCAB = 49152  # the tokenizer's


def _config(kind: str, layers: int, hidden: int):
    from transformers import DeepseekV3Config, LlamaConfig, Qwen3MoeConfig

    heads = hidden // 64
    if kind == "qwen3-moe":
        return Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=3 * hidden,
                              moe_intermediate_size=3 * hidden // 8, num_hidden_layers=layers, num_attention_heads=heads,
                              num_key_value_heads=max(1, heads // 8), head_dim=64, num_experts=64,
                              num_experts_per_tok=8, norm_topk_prob=True, rope_theta=1e6,
                              max_position_embeddings=4096, tie_word_embeddings=False)
    if kind == "deepseek-v3":
        return DeepseekV3Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=3 * hidden,
                                moe_intermediate_size=hidden // 4, num_hidden_layers=layers, num_attention_heads=heads,
                                num_key_value_heads=heads, kv_lora_rank=hidden // 4, q_lora_rank=3 * hidden // 8,
                                qk_rope_head_dim=hidden // 16, qk_nope_head_dim=hidden // 8, v_head_dim=hidden // 8,
                                n_routed_experts=32, num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1,
                                routed_scaling_factor=2.5, first_k_dense_replace=1, max_position_embeddings=4096,
                                tie_word_embeddings=False,
                                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                 "original_max_position_embeddings": 1024, "mscale": 1.0,
                                                 "mscale_all_dim": 1.0})
    if kind == "llama":
        return LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                           num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=4096,
                           tie_word_embeddings=False)
    raise ValueError(f"unknown checkpoint kind {kind!r}: choose {', '.join(KINDS)}")


KINDS = ("qwen3-moe", "deepseek-v3", "llama")


def write_checkpoint(kind: str, path: Path, layers: int = 4, hidden: int = 512, seed: int = 0) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from tandem.server.config import EngineConfig
    from tandem.server.model.loader import resolve_model
    from tandem.server.model.tokenizer import export_tokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(kind, layers, hidden)).eval()
    with torch.no_grad():  # routers that prefer some experts per token, as trained ones do
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0, 0.5)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    export_tokenizer(resolve_model(EngineConfig.model), path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.tools.checkpoints", description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("path", type=Path)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512, help="a multiple of 64")
    args = parser.parse_args(argv)
    print(write_checkpoint(args.kind, args.path, args.layers, args.hidden))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
