"""Multi-head latent attention (DeepSeek-V2/V3): each token's keys and values come from one latent
vector (`kv_lora_rank` values, RMS-normalized) and one rotated key part (`qk_rope_head_dim`)
shared by every head, and only those two are cached: 576 values per token and layer in the full
model, where its 128 heads would otherwise cache 2 x 128 x 192.

Attention runs on the latent as it lies in the cache, with the up-projections absorbed (as DeepSeek
and SGLang decode): head h's key over the latent c is [c W_UK[h] ; k_rope], so q_h . k_h =
(q_nope_h W_UK[h]^T) . c + q_rope_h . k_rope, and its value is c W_UV[h]. Each query becomes a
[kv_lora_rank + rope] vector against one shared KV head whose values are the latent, the attention
backends attend it like any one-KV-head model, and the output per head goes through W_UV before
o_proj. Prefill runs the same way (no [tokens, heads, dim] K and V are ever expanded), which reads
the prompt's latent once per head group instead of materializing 128 heads' K and V; the order of the
multiplications differs from HF's expanded form, within float32 rounding.

DeepSeek stores the rotary dims in interleaved pairs; the rows of the projections that produce them
are reordered at load (pairs' first elements, then their second), so the half-split rotary of every
other model rotates them exactly as DeepSeek's interleaved one.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.kernels.attention import AttentionBackend
from tandem.kernels.layer_ops import apply_rope, rms_norm
from tandem.kernels.linear import Linear
from tandem.server.model.config import ModelConfig


def deinterleave(w: torch.Tensor, heads: int, first: int, rope: int) -> torch.Tensor:
    """`w`'s rows as `heads` groups of `first` rows then `rope` interleaved rotary rows, with each
    group's rotary rows reordered even-first (a half-split layout)."""
    groups = w.view(heads, first + rope, *w.shape[1:])
    head, rotary = groups[:, :first], groups[:, first:]
    rotary = torch.cat([rotary[:, 0::2], rotary[:, 1::2]], dim=1)
    return torch.cat([head, rotary], dim=1).reshape(w.shape)


class LatentAttention(nn.Module):
    """Layer `prefix`'s attention (HF names: self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj},
    kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj). `config` is this rank's: its heads."""

    def __init__(self, config: ModelConfig, prefix: str, w: dict[str, torch.Tensor],
                 prefill_dtype: torch.dtype | None = None):
        super().__init__()
        c, p = config, prefix + "self_attn."
        self.config = c
        self.eps = c.rms_norm_eps
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        q_name = "q_b_proj" if c.q_lora_rank else "q_proj"
        q_weight, kv_a = w[p + q_name + ".weight"], w[p + "kv_a_proj_with_mqa.weight"]
        if c.rope_interleave:
            q_weight = deinterleave(q_weight, c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim)
            kv_a = deinterleave(kv_a, 1, c.kv_lora_rank, c.qk_rope_head_dim)
        self.q_a = Linear(w[p + "q_a_proj.weight"], prefill_dtype=prefill_dtype) if c.q_lora_rank else None
        self.q_a_norm = nn.Parameter(w[p + "q_a_layernorm.weight"], requires_grad=False) if c.q_lora_rank else None
        self.q = Linear(q_weight, prefill_dtype=prefill_dtype)  # [heads * qk, q_lora_rank or hidden]
        self.kv_a = Linear(kv_a, prefill_dtype=prefill_dtype)  # [kv_lora_rank + rope, hidden]
        self.kv_a_norm = nn.Parameter(w[p + "kv_a_layernorm.weight"], requires_grad=False)
        # kv_b_proj [heads * (nope + v), kv_lora_rank]: per head, W_UK's rows then W_UV's
        kv_b = w[p + "kv_b_proj.weight"].view(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        self.w_uk = nn.Parameter(kv_b[:, : c.qk_nope_head_dim].contiguous(), requires_grad=False)  # [H, nope, rank]
        self.w_uv = nn.Parameter(kv_b[:, c.qk_nope_head_dim :].transpose(1, 2).contiguous(),
                                 requires_grad=False)  # [H, rank, v]
        self.o = Linear(w[p + "o_proj.weight"], prefill_dtype=prefill_dtype)
        self.qk = qk

    def forward(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionBackend) -> torch.Tensor:
        """x [T, hidden] (normalized) -> this rank's share of the attention's output [T, hidden]
        (before the all-reduce); writes the tokens' latents into the cache."""
        c, T = self.config, x.shape[0]
        q_in = rms_norm(self.q_a(x), self.q_a_norm, self.eps) if self.q_a is not None else x
        q = self.q(q_in).view(T, c.num_heads, self.qk)
        q_nope, q_rope = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a(x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        kv = torch.cat([rms_norm(latent.contiguous(), self.kv_a_norm, self.eps),
                        apply_rope(k_rope.reshape(T, 1, c.qk_rope_head_dim), cos, sin)[:, 0]], dim=-1)
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [T, H, rank]
        q = torch.cat([q_latent, apply_rope(q_rope.contiguous(), cos, sin)], dim=-1)
        o = attn.forward(layer, q, kv[:, None, :], None)  # [T, H, rank]: weights over the latents
        o = torch.bmm(o.transpose(0, 1), self.w_uv).transpose(0, 1)  # [T, H, v]
        return self.o(o.reshape(T, c.num_heads * c.v_head_dim))

    def streamed_bytes(self, rows: int) -> int:
        absorbed = (self.w_uk.numel() + self.w_uv.numel()) * self.w_uk.element_size()
        q_a = self.q_a.streamed_bytes(rows) if self.q_a is not None else 0
        projections = sum(linear.streamed_bytes(rows) for linear in (self.q, self.kv_a, self.o))
        return q_a + projections + absorbed
