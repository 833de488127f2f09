"""Mixture of experts (Qwen3-MoE): per token, a router picks `experts_per_token` of
`num_experts` SwiGLU experts and sums their outputs weighted by its probabilities.

Numerics follow HF transformers: router logits in the compute dtype, softmax in float32, the
top k renormalized to sum to one where the model says so (`norm_topk_prob`), the weights cast
back. The tokens routed to one expert run through it together: one gate|up and one down
projection per expert that got any token in the pass, each a `Linear` like the dense layers'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels.layer_ops import silu_mul
from tandem.kernels.linear import Linear
from tandem.server.model.config import ModelConfig


class SparseMoE(nn.Module):
    """Layer `prefix`'s experts (HF names: mlp.gate is the router, mlp.experts.E.{gate,up,down}_proj)."""

    def __init__(self, config: ModelConfig, prefix: str, w: dict[str, torch.Tensor],
                 prefill_dtype: torch.dtype | None = None):
        super().__init__()
        self.top_k, self.renormalize = config.experts_per_token, config.norm_topk_prob
        self.router = nn.Parameter(w[prefix + "mlp.gate.weight"], requires_grad=False)  # [experts, hidden]
        e = prefix + "mlp.experts.{}."
        self.gate_up = [Linear(torch.cat([w[e.format(i) + "gate_proj.weight"], w[e.format(i) + "up_proj.weight"]]),
                               prefill_dtype=prefill_dtype) for i in range(config.num_experts)]
        self.down = [Linear(w[e.format(i) + "down_proj.weight"], prefill_dtype=prefill_dtype)
                     for i in range(config.num_experts)]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] in x's dtype, expert ids [T, k])."""
        probs = torch.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():
            rows, pick = (experts == e).nonzero(as_tuple=True)
            y = self.down[e](silu_mul(self.gate_up[e](x[rows])))
            out.index_add_(0, rows, y * weights[rows, pick, None])
        return out

    def streamed_bytes(self, rows: int) -> int:
        """The router's bytes and those of as many experts as `rows` tokens can reach."""
        reached = min(len(self.down), rows * self.top_k)
        expert = self.gate_up[0].streamed_bytes(rows) + self.down[0].streamed_bytes(rows)
        return self.router.numel() * self.router.element_size() + reached * expert
