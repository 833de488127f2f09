"""The model runner: turns a StepPlan into tensors, runs the forward pass and samples.

With tensor parallelism the runner is rank 0's: each forward pass's `ForwardInputs` go to the
other ranks (`peers`) first, every rank runs `forward_pass` over its heads, and rank 0 alone
computes logits and samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.kernels.attention import AttentionBackend, AttentionBatch, create_backend
from tandem.kernels.kv_cache import PagedKVCache, flat_slots
from tandem.kernels.sampling import SamplingRow, sample
from tandem.server.model.llama import LlamaForCausalLM
from tandem.server.plan import StepOutput, StepPlan


@dataclass
class ForwardInputs:
    """One forward pass at token level: all that a rank needs to run its layers (no sampling)."""

    input_ids: list[int]  # every token of the pass, sequence after sequence
    positions: list[int]  # position of each token
    slots: list[int]  # flat KV slot (page * page_size + offset) each token's K and V go to
    q_lens: list[int]  # tokens per sequence
    kv_lens: list[int]  # tokens with KV per sequence after the pass
    page_tables: list[list[int]]  # pages covering each sequence's [0, kv_len)
    num_extends: int  # sequences [0, num_extends) are prompt pieces

    @classmethod
    def of(cls, plan: StepPlan) -> "ForwardInputs":
        P = plan.page_size
        input_ids, positions, slots = [], [], []
        for seq in plan.seqs:
            input_ids.extend(seq.token_ids)
            positions.extend(range(seq.start_pos, seq.kv_len))
            slots.extend(flat_slots(seq.pages, seq.start_pos, seq.kv_len, P))
        return cls(input_ids, positions, slots, [len(s.token_ids) for s in plan.seqs], [s.kv_len for s in plan.seqs],
                   [s.pages[: -(-s.kv_len // P)] for s in plan.seqs], plan.num_extends)


def forward_pass(model: LlamaForCausalLM, attn: AttentionBackend, inputs: ForwardInputs,
                 device: torch.device) -> torch.Tensor:
    """Run the model's layers over `inputs` (writing their KV) -> final hidden states [T, hidden]."""
    attn.prepare(AttentionBatch(inputs.q_lens, inputs.kv_lens, inputs.page_tables, inputs.num_extends,
                                torch.tensor(inputs.slots, dtype=torch.long, device=device)))
    return model(torch.tensor(inputs.input_ids, dtype=torch.long, device=device),
                 torch.tensor(inputs.positions, dtype=torch.long, device=device), attn)


class Peers(Protocol):
    """The other tensor-parallel ranks, as rank 0's runner sees them."""

    def send(self, inputs: ForwardInputs) -> None:
        """Hand every other rank the next forward pass."""


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: PagedKVCache, attention_backend: str = "auto",
                 peers: Peers | None = None):
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.peers = peers
        c = model.config
        self.attn = create_backend(attention_backend, kv_cache, c.num_heads, c.head_dim)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        inputs = ForwardInputs.of(plan)
        if self.peers is not None:
            self.peers.send(inputs)
        hidden = forward_pass(self.model, self.attn, inputs, self.device)
        # Only the last position of each sequence that samples needs logits.
        dev = self.device
        ends, last_rows = 0, []
        for i, seq in enumerate(plan.seqs):
            ends += len(seq.token_ids)
            if seq.sample:
                last_rows.append((i, ends - 1))
        next_tokens: list[int | None] = [None] * len(plan.seqs)
        if not last_rows:
            return StepOutput(next_tokens)
        logits = self.model.logits(hidden[torch.tensor([r for _, r in last_rows], device=dev)])
        seqs = [plan.seqs[i] for i, _ in last_rows]
        rows = [SamplingRow(s.params, s.seed, s.history if s.params.has_penalties else None, s.prompt_len) for s in seqs]
        want_lp = any(s.params.logprobs for s in seqs)
        num_top = max(s.params.top_logprobs for s in seqs)
        ids, lps, tops = sample(logits, rows, num_top, want_lp)
        logprobs: list[float | None] = [None] * len(plan.seqs) if want_lp else []
        top_logprobs: list = [None] * len(plan.seqs) if num_top else []
        for j, (i, _) in enumerate(last_rows):
            next_tokens[i] = ids[j]
            if want_lp and plan.seqs[i].params.logprobs:
                logprobs[i] = lps[j]
            if num_top and plan.seqs[i].params.top_logprobs:
                top_logprobs[i] = tops[j][: plan.seqs[i].params.top_logprobs]
        return StepOutput(next_tokens, logprobs, top_logprobs)
