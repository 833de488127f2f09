"""The model runner: turns a StepPlan into tensors, runs the forward pass and samples."""

from __future__ import annotations

import torch

from tandem.kernels.attention import AttentionBatch, create_backend
from tandem.kernels.kv_cache import PagedKVCache, flat_slots
from tandem.kernels.sampling import SamplingRow, sample
from tandem.server.model.llama import LlamaForCausalLM
from tandem.server.plan import StepOutput, StepPlan


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: PagedKVCache, attention_backend: str = "auto"):
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        c = model.config
        self.attn = create_backend(attention_backend, kv_cache, c.num_heads, c.head_dim)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        P = plan.page_size
        input_ids, positions, slots = [], [], []
        for seq in plan.seqs:
            input_ids.extend(seq.token_ids)
            positions.extend(range(seq.start_pos, seq.kv_len))
            slots.extend(flat_slots(seq.pages, seq.start_pos, seq.kv_len, P))
        dev = self.device
        batch = AttentionBatch(
            q_lens=[len(s.token_ids) for s in plan.seqs],
            kv_lens=[s.kv_len for s in plan.seqs],
            page_tables=[s.pages[: -(-s.kv_len // P)] for s in plan.seqs],
            num_extends=plan.num_extends,
            out_slots=torch.tensor(slots, dtype=torch.long, device=dev),
        )
        self.attn.prepare(batch)
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.attn,
        )
        # Only the last position of each sequence that samples needs logits.
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
