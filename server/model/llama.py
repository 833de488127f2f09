"""Llama-family decoder over a flat batch of tokens: Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3 (its
q/k norms), with routed experts (moe.py) Qwen3-MoE and Mixtral, Gemma 3 (sliding-window layers
with their own RoPE base, norms around the attention and the MLP, (1 + w) norm weights, GeLU,
scaled embeddings: each a `ModelConfig` field), and with latent attention (mla.py) and DeepSeek's
routing DeepSeek-V3.

Numerics follow HF transformers' reference implementation (RMSNorm in float32, half-split RoPE
with float32 tables), so that float32 outputs match it token for token. Projections are fused
(q|k|v, gate|up) to halve the number of GEMM calls; `tandem.kernels.linear.Linear` holds each
weight in the form the device multiplies fastest, including the GGUF file's own blocks where the
weights stay float32. The steps between projections (norms with their residual adds, rotary
embedding, SiLU) are `tandem.kernels.layer_ops`, one native call each on CPUs that run tandem's
kernels.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels.attention import AttentionBackend
from tandem.kernels.block_linear import BlockWeights
from tandem.kernels.fused_decode import FusedDecodeLayer, FusedDecodeStack
from tandem.kernels.layer_ops import add_rms_norm, apply_rope, gelu_tanh_mul, rms_norm, silu_mul
from tandem.kernels.linear import Linear
from tandem.server.model.config import ROPE_TYPES, ModelConfig, yarn_mscale
from tandem.server.model.mla import LatentAttention
from tandem.server.model.moe import SparseMoE
from tandem.server.model.precision import Precision
from tandem.server.model.shard import Shard, shard_model


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None,
                  rope_freqs: torch.Tensor | None = None) -> torch.Tensor:
    """RoPE's inverse frequencies for base `theta`, with HF's `rope_scaling` (`ROPE_TYPES`) or a
    GGUF file's per-frequency divisors (`rope_freqs`) applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_freqs is not None:  # GGUF llama3: per-frequency divisors baked at conversion
        return inv_freq / rope_freqs.float()
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_scaling type {kind!r} is not supported: tandem runs {', '.join(ROPE_TYPES)}")
    if kind == "linear":  # positions divided by the factor
        return inv_freq / scaling["factor"]
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled)
    return inv_freq


def _yarn_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN: the high frequencies kept, the low ones divided by the factor, a linear ramp between
    the dims that turn beta_fast and beta_slow times over the original context (HF's numerics)."""
    factor, old_ctx = scaling["factor"], scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_turning(turns: float) -> float:
        return head_dim * math.log(old_ctx / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_turning(fast), dim_turning(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    kept = 1 - ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    wavelengths = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    return 1.0 / (factor * wavelengths) * (1 - kept) + 1.0 / wavelengths * kept


def rope_attention_factor(scaling: dict | None) -> float:
    """What YaRN multiplies cos and sin by (1 for the other types)."""
    scaling = scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    factor, mscale, mscale_all_dim = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def _is_norm(name: str) -> bool:
    return name.endswith(("norm.weight", "layernorm.weight"))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int, w: dict[str, torch.Tensor], blocks: dict[str, BlockWeights],
                 prefill_dtype: torch.dtype | None = None,
                 all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, four_bit: bool = True):
        """`config`: this rank's share of the model; `all_reduce` sums o's and down's partial
        outputs over the tensor-parallel ranks (None for one rank); `four_bit`: as `Linear`'s."""
        super().__init__()
        p = f"model.layers.{index}."
        self.index = index
        self.config = config
        self.all_reduce = all_reduce or (lambda t: t)

        def linear(names: list[str], bias: torch.Tensor | None = None) -> Linear:
            """One projection over the row-concatenation of `names`' weights."""
            keys = [p + name + ".weight" for name in names]
            fused_blocks = BlockWeights.cat([blocks[k] for k in keys]) if all(k in blocks for k in keys) else None
            return Linear(torch.cat([w[k] for k in keys]), bias, fused_blocks, prefill_dtype, four_bit)

        self.mla = LatentAttention(config, p, w, prefill_dtype) if config.latent else None
        if self.mla is None:
            qkv_bias = None
            if config.attention_bias:
                qkv_bias = torch.cat([w[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
            self.qkv = linear([f"self_attn.{n}_proj" for n in "qkv"], qkv_bias)
            self.o = linear(["self_attn.o_proj"])
        self.moe = SparseMoE(config, p, w) if index in config.sparse_layers else None
        if self.moe is None:
            self.gate_up = linear(["mlp.gate_proj", "mlp.up_proj"])
            self.down = linear(["mlp.down_proj"])
        self.act = gelu_tanh_mul if config.hidden_act == "gelu_tanh" else silu_mul

        def norm(name: str) -> nn.Parameter:
            return nn.Parameter(w[p + name + ".weight"], requires_grad=False)

        self.input_norm = norm("input_layernorm")
        if config.sandwich_norms:  # Gemma: post_attention_layernorm normalizes the attention's output
            self.attn_out_norm = norm("post_attention_layernorm")
            self.mlp_norm = norm("pre_feedforward_layernorm")
            self.mlp_out_norm = norm("post_feedforward_layernorm")
        else:
            self.mlp_norm = norm("post_attention_layernorm")
        if config.qk_norm:
            self.q_norm = norm("self_attn.q_norm")
            self.k_norm = norm("self_attn.k_norm")
        # Llama's four projections with a SiLU MLP and plain norms, on one rank
        llama = (self.mla is None and self.moe is None and self.act is silu_mul and all_reduce is None
                 and not config.sandwich_norms)
        # The whole layer in one native call at decode steps, where it is a plain Llama layer
        plain = llama and not config.qk_norm
        # Where a pass's products run in the prefill dtype (a float32 model's prompt pieces), the steps
        # between them hand it to each other (`layer_ops`' out_dtype): the same values as float32 tensors
        # rounded on their way into each product, without the copies. Its qkv products stay float32
        # (RoPE and q/k norms compute in float32).
        self.narrow = llama and all(p.prefill is not None for p in (self.qkv, self.o, self.gate_up, self.down)) and all(
            p.bias is None for p in (self.o, self.gate_up, self.down))
        self.fused = FusedDecodeLayer.build(self.input_norm, self.mlp_norm, config.rms_norm_eps,
                                            (self.qkv, self.o, self.gate_up, self.down), config.num_heads,
                                            config.num_kv_heads) if plain else None

    def forward(self, h: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """h: the residual stream; delta: the previous layer's output, not yet added to it (None
        before the first layer). Returns the same pair after this layer (the add is fused with the
        next RMSNorm)."""
        if self.fused is not None:
            out = self.fused(self.index, h, delta, cos, sin, attn)
            if out is not None:
                return h, out
        c = self.config
        narrow = self.qkv.prefill_dtype_for(h.shape[0]) if self.narrow else None
        if delta is None:
            x = rms_norm(h, self.input_norm, c.rms_norm_eps, narrow)
        else:
            h, x = add_rms_norm(h, delta, self.input_norm, c.rms_norm_eps, narrow)
        o = self.all_reduce(self.attention(x, cos, sin, attn, keep=narrow is not None))
        if c.sandwich_norms:
            o = rms_norm(o, self.attn_out_norm, c.rms_norm_eps)
        h, x = add_rms_norm(h, o, self.mlp_norm, c.rms_norm_eps, narrow)
        if narrow is not None:
            mlp = self.down(silu_mul(self.gate_up(x, keep=True), narrow), keep=True)
        else:
            mlp = self.all_reduce(self.moe(x) if self.moe is not None else self.down(self.act(self.gate_up(x))))
        if c.sandwich_norms:
            mlp = rms_norm(mlp, self.mlp_out_norm, c.rms_norm_eps)
        return h, mlp

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend,
                  keep: bool = False) -> torch.Tensor:
        """This rank's share of the attention's output (before the all-reduce); `keep`: as `Linear`'s,
        for the o projection."""
        c = self.config
        if self.mla is not None:
            return self.mla(self.index, x, cos, sin, attn)
        qkv = self.qkv(x)
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        v = v.view(-1, c.num_kv_heads, c.head_dim)
        if c.qk_norm:  # per head, over its head_dim
            q = rms_norm(q.reshape(-1, c.head_dim), self.q_norm, c.rms_norm_eps)
            k = rms_norm(k.reshape(-1, c.head_dim), self.k_norm, c.rms_norm_eps)
            q = apply_rope(q.view(-1, c.num_heads, c.head_dim), cos, sin)
            k = apply_rope(k.view(-1, c.num_kv_heads, c.head_dim), cos, sin)
            o = attn.forward(self.index, q, k, v)
        else:  # q's heads and k's lie side by side in each row: one rotation (in place where a kernel takes it)
            qk = qkv[:, : c.q_size + c.kv_size].view(-1, c.num_heads + c.num_kv_heads, c.head_dim)
            o = attn.rotate_and_attend(self.index, qk, v, cos, sin)
            if o is None:
                q, k = apply_rope(qk, cos, sin).split([c.num_heads, c.num_kv_heads], dim=1)
                o = attn.forward(self.index, q, k, v)
        return self.o(o.reshape(-1, c.q_size), keep=keep)

    def streamed_bytes(self, rows: int) -> int:
        mlp = self.moe.streamed_bytes(rows) if self.moe is not None else (
            self.gate_up.streamed_bytes(rows) + self.down.streamed_bytes(rows))
        if self.mla is not None:
            return self.mla.streamed_bytes(rows) + mlp
        return self.qkv.streamed_bytes(rows) + self.o.streamed_bytes(rows) + mlp


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
             factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos and sin [T, 1, head_dim] at `positions` (times YaRN's `factor`), computed in
    float32 as HF does."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    if factor != 1.0:
        return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        precision: Precision,
        device,
        blocks: dict[str, BlockWeights] | None = None,
        shard: Shard = Shard(),
        all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        """Weights are rounded to `precision.weights` and held (and computed with) in
        `precision.compute`. `blocks`: the block-quantized form of some weights (the loader's
        `load_block_weights`), used only where the weights stay float32, on the CPU, in 4 bits where
        they fit and `precision.four_bit` (`Linear`); there products over many rows run in
        `precision.narrow_prefill` where it is set (`Linear`'s prefill_dtype).
        `shard`: which tensor-parallel rank this is (`tandem.server.model.shard`): `config` then
        describes the rank's own heads and features, `all_reduce` sums the row-parallel outputs
        across the ranks, and only rank 0 has an lm_head."""
        super().__init__()
        dtype, compute_dtype = precision.weights, precision.compute
        if dtype != torch.float32 or compute_dtype != torch.float32 or torch.device(device).type != "cpu":
            blocks = None
        config, weights, blocks = shard_model(config, weights, blocks or {}, shard)
        if config.norm_offset:  # fold Gemma's (1 + w) into the weights, in float32 before any rounding
            weights = {k: v + 1 if _is_norm(k) else v for k, v in weights.items()}
        self.config = config
        self.shard = shard
        self.prefill_dtype = precision.narrow_prefill  # where set, prompt attention computes in it too (create_backend)
        if shard.size > 1 and all_reduce is None:
            raise ValueError(f"tensor-parallel rank {shard.rank} of {shard.size} needs an all_reduce")
        self.all_reduce = all_reduce or (lambda t: t)
        w = {k: v.to(dtype=dtype).to(compute_dtype).to(device) for k, v in weights.items() if k != "rope_freqs"}
        self.embed = nn.Parameter(w["model.embed_tokens.weight"], requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(config, i, w, blocks, self.prefill_dtype, all_reduce,
                                                 precision.four_bit) for i in range(config.num_layers))
        # Every layer in one native call at decode steps, where each could be fused and all take one RoPE table
        self.fused_stack = (FusedDecodeStack.build([layer.fused for layer in self.layers])
                            if not (config.sliding_layers and config.local_rope_theta) else None)
        self.norm = nn.Parameter(w["model.norm.weight"], requires_grad=False)
        # Kept apart from the embedding even when tied: lookups want plain [vocab, hidden] rows,
        # the logits GEMM its own layout.
        head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        self.lm_head = (Linear(w[head], blocks=blocks.get(head), prefill_dtype=self.prefill_dtype,
                               four_bit=precision.four_bit) if shard.rank == 0 else None)
        # RoPE tables: the global layers', and the sliding-window layers' own where they have one
        self.register_buffer("inv_freq", rope_inv_freq(config.rope_dim, config.rope_theta, config.rope_scaling,
                                                       weights.get("rope_freqs")), persistent=False)
        self.rope_factor = rope_attention_factor(config.rope_scaling)
        self.sliding = frozenset(config.sliding_layers)  # layers that take the local RoPE table
        local = config.sliding_layers and config.local_rope_theta
        local_inv_freq = rope_inv_freq(config.head_dim, config.local_rope_theta) if local else None
        self.register_buffer("local_inv_freq", local_inv_freq, persistent=False)
        self.to(device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden] (normalized)."""
        h = F.embedding(input_ids, self.embed)
        if self.config.embed_scale:  # as HF: sqrt(hidden) rounded to the embedding's dtype
            h = h * torch.tensor(self.config.hidden_size**0.5, dtype=h.dtype)
        rope = _cos_sin(positions, self.inv_freq, h.dtype, self.rope_factor)
        local = rope if self.local_inv_freq is None else _cos_sin(positions, self.local_inv_freq, h.dtype)
        delta = self.fused_stack(h, *rope, attn) if self.fused_stack is not None else None
        if delta is None:
            for layer in self.layers:
                h, delta = layer(h, delta, *(local if layer.index in self.sliding else rope), attn)
        return add_rms_norm(h, delta, self.norm, self.config.rms_norm_eps)[1]

    def streamed_bytes(self, rows: int) -> int:
        """Bytes of weights a forward pass over `rows` rows reads, in the form this module holds them:
        every layer's projections and the LM head (the embedding rows and the norms are negligible)."""
        return self.lm_head.streamed_bytes(rows) + sum(layer.streamed_bytes(rows) for layer in self.layers)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
