"""A random Qwen3-MoE checkpoint in the proportions of Qwen3-30B-A3B, small enough for a CPU, for
`tandem bench offline --model DIR` against HF transformers (nothing can be downloaded here, and
the comparison needs only the architecture: both sides run the same weights).

    python -m tandem.tools.moe_checkpoint DIR [--layers 4] [--hidden 512] [--experts 64] [--top-k 8]

Qwen3-30B-A3B: hidden 2048, 128 experts of width 768, 8 per token, 32 query and 4 KV heads of 128.
The defaults keep its ratios where they matter to the MoE layer's cost (expert width 3/8 of hidden,
top 8 of many), at a quarter of the width. HF's transformers writes the directory (config.json,
safetensors); the built-in model's tokenizer goes beside it, so prompts are SmolLM2 token ids.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def write_moe_checkpoint(path: Path, layers: int = 4, hidden: int = 512, experts: int = 64, top_k: int = 8,
                         seed: int = 0) -> Path:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tandem.server.config import EngineConfig
    from tandem.server.model.loader import resolve_model
    from tandem.server.model.tokenizer import export_tokenizer

    torch.manual_seed(seed)
    heads = hidden // 64
    config = Qwen3MoeConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=3 * hidden,
                            moe_intermediate_size=3 * hidden // 8, num_hidden_layers=layers, num_attention_heads=heads,
                            num_key_value_heads=max(1, heads // 8), head_dim=64, num_experts=experts,
                            num_experts_per_tok=top_k, norm_topk_prob=True, rope_theta=1e6,
                            max_position_embeddings=4096, tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():  # a router that prefers some experts per token, as trained ones do
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    export_tokenizer(resolve_model(EngineConfig.model), path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.tools.moe_checkpoint", description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    args = parser.parse_args(argv)
    path = write_moe_checkpoint(args.path, args.layers, args.hidden, args.experts, args.top_k)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
