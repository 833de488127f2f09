"""The architecture of a loaded model, as found in its files (GGUF metadata or config.json)."""

from __future__ import annotations

import math
from dataclasses import dataclass

ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # the rope_scaling types rope_inv_freq computes
# model_type -> the HF class of such a checkpoint (GetModelInfo's `architectures`)
HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
              "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
              "gemma3_text": "Gemma3ForCausalLM", "gemma3": "Gemma3ForConditionalGeneration",
              "deepseek_v3": "DeepseekV3ForCausalLM"}
SUPPORTED_ARCHITECTURES = tuple(HF_CLASSES)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched `factor` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2: biases on q, k and v projections
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's q and k (one weight per head dim), before rotary
    rope_scaling: dict | None = None  # HF rope_scaling (llama3 type supported)
    # Mixture of experts (Qwen3-MoE, Mixtral: server/model/moe.py): which layers' MLPs are sparse
    num_experts: int = 0
    experts_per_token: int = 0
    norm_topk_prob: bool = True  # the top k router probabilities renormalized to sum to one
    sparse_layers: tuple[int, ...] = ()
    expert_intermediate_size: int = 0  # each expert's MLP width (Qwen3-MoE: moe_intermediate_size)
    # DeepSeek-V3's routing: sigmoid scores, a bias that steers the choice (not the weights), the top
    # k taken within the best `topk_group` of `n_group` groups, weights scaled; shared experts beside
    scoring: str = "softmax"  # softmax | sigmoid
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_experts: int = 0  # shared experts, run as one dense MLP of shared_experts x expert width
    # Multi-head latent attention (DeepSeek-V3, server/model/mla.py): the KV cache holds one latent of
    # kv_lora_rank values and qk_rope_head_dim rotated key values per token, shared by every head
    kv_lora_rank: int = 0  # 0: not MLA
    q_lora_rank: int = 0  # 0: one q projection; else a low-rank pair with a norm between
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # the rotary dims in interleaved pairs (DeepSeek); loaded half-split
    # Gemma 3: sliding-window layers with their own RoPE base, norms around the attention and the MLP
    sliding_window: int = 0  # positions a sliding-window layer attends to, its own included
    sliding_layers: tuple[int, ...] = ()
    local_rope_theta: float = 0.0  # the sliding-window layers' RoPE base (no scaling)
    attention_scale: float = 0.0  # of q.k; 0: 1/sqrt(head_dim) (Gemma 3: 1/sqrt(query_pre_attn_scalar))
    hidden_act: str = "silu"  # the MLP's gate activation: silu | gelu_tanh
    norm_offset: bool = False  # Gemma: RMSNorms scale by (1 + weight)
    sandwich_norms: bool = False  # Gemma: the attention's and the MLP's outputs normalized before the residual add
    embed_scale: bool = False  # Gemma: embeddings multiplied by sqrt(hidden_size)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def latent(self) -> bool:
        """MLA: one latent KV per token, shared by all heads and, under tensor parallelism, by all ranks."""
        return self.kv_lora_rank > 0

    @property
    def kv_heads(self) -> int:
        """KV heads the cache holds per token: this config's KV heads, or MLA's one latent."""
        return 1 if self.latent else self.num_kv_heads

    @property
    def kv_dim(self) -> int:
        """Values per cached head and token: head_dim, or MLA's latent and rotated key part."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.latent else self.head_dim

    @property
    def kv_value_dim(self) -> int | None:
        """MLA: the values are the latent, the first kv_lora_rank of each cached row (no V of their
        own); None where the cache holds a V beside each K."""
        return self.kv_lora_rank if self.latent else None

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim if self.latent else self.head_dim

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Per layer, the positions its attention reads back: its sliding window, or 0 for all."""
        return tuple(self.sliding_window if i in self.sliding_layers else 0 for i in range(self.num_layers))

    @property
    def softmax_scale(self) -> float:
        return self.attention_scale or self.head_dim**-0.5

    @property
    def hf_class(self) -> str:
        return HF_CLASSES[self.architecture]

    def describe(self) -> str:
        """One line for the startup log: the architecture and what sets it apart."""
        heads = (f"{self.num_heads} heads of {self.head_dim}" if self.latent else
                 f"{self.num_heads} query / {self.num_kv_heads} KV heads of {self.head_dim}")
        parts = [f"{self.architecture} ({self.hf_class}): {self.num_layers} layers, hidden {self.hidden_size}, {heads}"]
        if self.num_experts:
            parts.append(f"{self.num_experts} experts, top {self.experts_per_token}, on {len(self.sparse_layers)} of "
                         f"{self.num_layers} layers")
        if self.latent:
            parts.append(f"latent attention: KV of {self.kv_lora_rank} + {self.qk_rope_head_dim} per token and layer")
        if self.sliding_layers:
            parts.append(f"sliding window {self.sliding_window} on {len(self.sliding_layers)} of {self.num_layers} "
                         "layers")
        return ", ".join(parts)
