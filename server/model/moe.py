"""Mixture of experts (Qwen3-MoE, Mixtral): per token, a router picks `experts_per_token` of
`num_experts` SwiGLU experts and sums their outputs weighted by its probabilities.

Numerics follow HF transformers: router logits in the compute dtype, softmax in float32, the
top k renormalized to sum to one where the model says so (`norm_topk_prob`), the weights cast
back. The experts' weights are stacked ([experts, 2 * width, hidden] for gate|up, [experts, hidden,
width] for down), and a pass sorts its (token, expert) pairs by expert, so that each expert's rows
are contiguous: one grouped GEMM (`torch.nn.functional.grouped_mm`) then runs every expert over
its rows, with no per-expert call and no host sync. Where torch has no grouped GEMM for the device
and dtype (CUDA in float32 or float16, or before sm80), the same sorted rows go through one pair of
matmuls per expert that got any (the measurements, against HF transformers: docs/performance.md,
"Mixture of experts").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels.layer_ops import silu_mul
from tandem.server.model.config import ModelConfig


def grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch multiplies grouped matrices of `dtype` on `device`: on a CPU in any float
    dtype; on CUDA in bfloat16 from sm80 on."""
    if not hasattr(F, "grouped_mm"):
        return False
    if device.type == "cpu":
        return True
    return device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (8, 0)


class SparseMoE(nn.Module):
    """Layer `prefix`'s experts (HF names: mlp.gate is the router, mlp.experts.E.{gate,up,down}_proj)."""

    def __init__(self, config: ModelConfig, prefix: str, w: dict[str, torch.Tensor]):
        super().__init__()
        self.top_k, self.renormalize, self.num_experts = config.experts_per_token, config.norm_topk_prob, config.num_experts
        self.router = nn.Parameter(w[prefix + "mlp.gate.weight"], requires_grad=False)  # [experts, hidden]
        e = prefix + "mlp.experts.{}."
        # Stored as grouped_mm multiplies them, [experts, in, out]: rows of a group times each matrix
        self.gate_up = nn.Parameter(torch.stack([
            torch.cat([w[e.format(i) + "gate_proj.weight"], w[e.format(i) + "up_proj.weight"]]).T
            for i in range(config.num_experts)]).contiguous(), requires_grad=False)
        self.down = nn.Parameter(torch.stack([w[e.format(i) + "down_proj.weight"].T
                                              for i in range(config.num_experts)]).contiguous(), requires_grad=False)
        self.grouped = grouped_mm_runs(self.router.device, self.router.dtype)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] in x's dtype, expert ids [T, k])."""
        probs = torch.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        # (token, expert) pairs sorted by expert, stably: rows [ends[e - 1], ends[e]) are expert e's
        order = experts.flatten().argsort(stable=True)
        tokens = order // self.top_k
        ends = torch.bincount(experts.flatten(), minlength=self.num_experts).cumsum(0).to(torch.int32)
        rows = x[tokens]
        if self.grouped:
            h = F.grouped_mm(rows, self.gate_up, offs=ends)
            y = F.grouped_mm(silu_mul(h), self.down, offs=ends)
        else:
            y = torch.empty_like(rows)
            start = 0
            for e, end in enumerate(ends.tolist()):
                if end > start:
                    y[start:end] = silu_mul(rows[start:end] @ self.gate_up[e]) @ self.down[e]
                start = end
        return torch.zeros_like(x).index_add_(0, tokens, y * weights.flatten()[order, None])

    def streamed_bytes(self, rows: int) -> int:
        """The router's bytes and those of as many experts as `rows` tokens can reach."""
        reached = min(self.num_experts, rows * self.top_k)
        per_expert = (self.gate_up[0].numel() + self.down[0].numel()) * self.down.element_size()
        return self.router.numel() * self.router.element_size() + reached * per_expert
