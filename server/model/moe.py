"""Mixture of experts (Qwen3-MoE, Mixtral, DeepSeek-V3): per token, a router picks
`experts_per_token` of `num_experts` SwiGLU experts and sums their outputs weighted by its scores.

Numerics follow HF transformers. Softmax routers (Qwen3-MoE, Mixtral): logits in the compute
dtype, softmax in float32, the top k renormalized to sum to one where the model says so
(`norm_topk_prob`), the weights cast back. DeepSeek-V3's: float32 sigmoid scores; the choice made
on the scores plus a per-expert correction bias, within the `topk_group` groups of experts whose two
best biased scores sum highest; the weights are the chosen experts' unbiased scores, renormalized
and scaled by `routed_scaling_factor`; shared experts (one dense MLP) added for every token.

The experts' weights are stacked as grouped GEMMs take them ([experts, hidden, 2 * width] for
gate|up, [experts, width, hidden] for down), and a pass sorts its (token, expert) pairs by expert,
so that each expert's rows are contiguous: one grouped GEMM (`torch.nn.functional.grouped_mm`) then
runs every expert over its rows, with no per-expert call and no host sync. Where torch has no
grouped GEMM for the device and dtype (CUDA in float32 or float16, or before sm80), the same sorted
rows go through one pair of matmuls per expert that got any (the measurements, against HF
transformers: docs/performance.md, "Mixture of experts").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels.layer_ops import silu_mul
from tandem.kernels.linear import Linear
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
        self.top_k, self.renormalize = config.experts_per_token, config.norm_topk_prob
        self.num_experts = config.num_experts
        self.config = config
        self.router = nn.Parameter(w[prefix + "mlp.gate.weight"], requires_grad=False)  # [experts, hidden]
        bias = w.get(prefix + "mlp.gate.e_score_correction_bias")
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        s = prefix + "mlp.shared_experts."
        self.shared = None
        if config.shared_experts:  # [2 * width, hidden] and [hidden, width], as a dense MLP's
            self.shared = (Linear(torch.cat([w[s + "gate_proj.weight"], w[s + "up_proj.weight"]])),
                           Linear(w[s + "down_proj.weight"]))
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
        if self.config.scoring == "sigmoid":
            return self._route_sigmoid(x)
        probs = torch.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def _route_sigmoid(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c, T = self.config, x.shape[0]
        scores = F.linear(x.float(), self.router.float()).sigmoid()
        biased = scores if self.bias is None else scores + self.bias
        if c.n_group > 1:  # the best topk_group groups by their two best biased scores; the rest out
            groups = biased.view(T, c.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
            chosen = torch.zeros_like(groups).scatter_(1, groups.topk(c.topk_group, dim=-1, sorted=False)[1], 1)
            biased = biased.masked_fill(~chosen.bool().repeat_interleave(self.num_experts // c.n_group, dim=1),
                                        float("-inf"))
        experts = biased.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * c.routed_scaling_factor).to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = self._routed(x)
        if self.shared is None:
            return routed
        gate_up, down = self.shared
        return routed + down(silu_mul(gate_up(x)))

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        # (token, expert) pairs sorted by expert, stably: rows [ends[e - 1], ends[e]) are expert e's
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        tokens = order // self.top_k
        ends = torch.bincount(flat, minlength=self.num_experts).cumsum(0).to(torch.int32)
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
        shared = 0 if self.shared is None else sum(linear.streamed_bytes(rows) for linear in self.shared)
        return self.router.numel() * self.router.element_size() + reached * per_expert + shared
