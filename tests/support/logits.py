"""Teacher-forced logits of a loaded tandem model, for the tests of its inexact fast paths against
HF transformers in float32."""

from __future__ import annotations

import torch

from tandem.kernels.attention import AttentionBatch
from tandem.kernels.attention_backends import create_backend
from tandem.kernels.kv_cache import PagedKVCache, flat_slots


def teacher_forced_logits(loaded, ids: list[int], piece: int | None = None, decode_steps: int = 0,
                          page_size: int = 16, float32_prompt_attention: bool = False) -> torch.Tensor:
    """Every position's logits, [len(ids), vocab]: forward passes over `piece` tokens at a time
    (default: one pass) up to the last `decode_steps` tokens (all of them: no pass), then one decode
    step per token. The prompt pieces' attention computes in the model's prefill dtype, or in float32
    with `float32_prompt_attention`."""
    c = loaded.config
    pages = list(range(-(-len(ids) // page_size)))
    cache = PagedKVCache(c.num_layers, len(pages), page_size, c.num_kv_heads, c.head_dim, loaded.precision.kv,
                         loaded.device)
    attn = create_backend("torch", cache, c.num_heads, c.head_dim,
                          prompt_dtype=None if float32_prompt_attention else loaded.module.prefill_dtype)
    prompt = len(ids) - decode_steps
    piece = piece or prompt
    steps = [(start, min(start + piece, prompt), True) for start in range(0, prompt, piece)] if prompt else []
    steps += [(t, t + 1, False) for t in range(prompt, len(ids))]
    logits = []
    for start, end, extend in steps:
        attn.prepare(AttentionBatch(q_lens=[end - start], kv_lens=[end], page_tables=[pages], num_extends=int(extend),
                                    out_slots=torch.tensor(flat_slots(pages, start, end, page_size))))
        with torch.inference_mode():
            hidden = loaded.module(torch.tensor(ids[start:end]), torch.arange(start, end), attn)
            logits.append(loaded.module.logits(hidden).float())
    return torch.cat(logits)


def assert_logits_close(got: torch.Tensor, want: torch.Tensor, what: str, tolerance: float, mean_tolerance: float,
                        rounding: float) -> None:
    """The largest error below `tolerance` and the mean below `mean_tolerance`; the largest above
    `rounding` too (float32 agrees to ~1e-4: an error that size shows the rounding path ran)."""
    error, mean = float((got - want).abs().max()), float((got - want).abs().mean())
    assert rounding < error < tolerance and mean < mean_tolerance, f"{what}: logit error {error:.3g}, mean {mean:.3g}"
