"""The architecture of a loaded model, as found in its files (GGUF metadata or config.json)."""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe")


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
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim
