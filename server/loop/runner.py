"""The model runner: turns a StepPlan into tensors, runs the forward pass and samples.

`execute(plan)` is `run(prepare(plan))`. `prepare` copies out of the plan, in plain Python, all
that the pass needs, so the scheduler may go on changing its requests once it returns; `run`
does the torch work. Under overlap scheduling they run on different threads, and `run` fills in
each FUTURE_TOKEN with what the step before sampled for that request.

Structured output: before sampling, `run` masks each constrained request's logits row with what its
grammar allows next (`tandem.server.loop.grammar`), and after, advances its matcher by the token drawn.
Steps run one after another on one thread, so a step always sees its requests' matchers advanced
by the step before.

On CUDA, decode steps replay CUDA graphs (`graphs`, `tandem.server.loop.cuda_graphs`) where the engine
captured them; other steps, and every step without them, run the model eagerly.

With tensor parallelism the runner is rank 0's: each forward pass's `ForwardInputs` go to the
other ranks (`peers`) first, every rank runs `forward_pass` over its heads, and rank 0 alone
computes logits and samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.kernels.attention import AttentionBackend, AttentionBatch
from tandem.kernels.attention_backends import create_backend
from tandem.kernels.kv_cache import PagedKVCache, flat_slots
from tandem.kernels.sampling import SamplingRow, sample
from tandem.server.loop.cuda_graphs import DecodeGraphs
from tandem.server.loop.grammar import Matcher, token_bitmask
from tandem.server.model.llama import LlamaForCausalLM
from tandem.server.scheduling.plan import FUTURE_TOKEN, StepOutput, StepPlan


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


@dataclass
class PreparedStep:
    """A StepPlan copied into what `ModelRunner.run` needs; shares nothing the scheduler changes."""

    inputs: ForwardInputs
    futures: list[tuple[int, str]]  # (index into inputs.input_ids, rid): FUTURE_TOKENs to fill in
    samples: list[tuple[int, int, str]]  # (seq index, row of the hidden states, rid) per sequence that samples
    rows: list[SamplingRow]  # aligned with `samples`; a history ending in FUTURE_TOKEN is filled in too
    num_seqs: int
    grammars: list[Matcher | None]  # aligned with `samples`: the constrained requests' grammar states


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: PagedKVCache, attention_backend: str = "auto",
                 peers: Peers | None = None):
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.peers = peers
        c = model.config
        self.attn = create_backend(attention_backend, kv_cache, c.num_heads, c.head_dim, c.softmax_scale,
                                   c.layer_windows, prompt_dtype=model.prefill_dtype)
        self.graphs: DecodeGraphs | None = None  # set by the engine once captured
        self._sampled: dict[str, int] = {}  # rid -> token the last pass sampled (for FUTURE_TOKENs)

    def execute(self, plan: StepPlan) -> StepOutput:
        return self.run(self.prepare(plan))

    @staticmethod
    def prepare(plan: StepPlan) -> PreparedStep:
        inputs = ForwardInputs.of(plan)
        futures, samples, rows, grammars = [], [], [], []
        end = 0
        for i, seq in enumerate(plan.seqs):
            end += len(seq.token_ids)
            if seq.token_ids[-1] == FUTURE_TOKEN:
                futures.append((end - 1, seq.rid))
            if seq.sample:
                samples.append((i, end - 1, seq.rid))
                history = seq.history[: seq.start_pos] + seq.token_ids if seq.params.has_penalties else None
                rows.append(SamplingRow(seq.params, seq.seed, history, seq.prompt_len))
                grammars.append(seq.grammar)
        return PreparedStep(inputs, futures, samples, rows, len(plan.seqs), grammars)

    @torch.inference_mode()
    def run(self, step: PreparedStep) -> StepOutput:
        sampled, self._sampled = self._sampled, {}  # a pass that fails leaves nothing to fill in from
        for index, rid in step.futures:
            if rid not in sampled:
                raise RuntimeError(f"request {rid}'s input token was to come from the pass before, which did not sample it")
            step.inputs.input_ids[index] = sampled[rid]
        for row, (_, _, rid) in zip(step.rows, step.samples):
            if row.history and row.history[-1] == FUTURE_TOKEN:
                row.history[-1] = sampled[rid]
        if self.peers is not None:
            self.peers.send(step.inputs)
        inputs = step.inputs
        if self.graphs is not None and self.graphs.fits(len(inputs.q_lens), inputs.num_extends):
            hidden = self.graphs.run(inputs.input_ids, inputs.positions, inputs.slots, inputs.kv_lens,
                                     inputs.page_tables)
        else:
            hidden = forward_pass(self.model, self.attn, inputs, self.device)
        # Only the last position of each sequence that samples needs logits.
        next_tokens: list[int | None] = [None] * step.num_seqs
        if not step.samples:
            return StepOutput(next_tokens)
        logits = self.model.logits(hidden[torch.tensor([r for _, r, _ in step.samples], device=self.device)])
        want_lp, num_top = any(r.params.logprobs for r in step.rows), max(r.params.top_logprobs for r in step.rows)
        # A terminated grammar's request ended at the update before this step; its sample is dropped.
        constrained = [j for j, g in enumerate(step.grammars) if g is not None and not g.terminated]
        masked = None
        if constrained:
            masked = constrained, token_bitmask([step.grammars[j] for j in constrained], logits.shape[1])
        ids, lps, tops = sample(logits, step.rows, num_top, want_lp, masked)
        for j in constrained:
            if not step.grammars[j].accept(ids[j]):
                raise RuntimeError(f"request {step.samples[j][2]} sampled token {ids[j]}, which its grammar forbids")
        logprobs: list[float | None] = [None] * step.num_seqs if want_lp else []
        top_logprobs: list = [None] * step.num_seqs if num_top else []
        for j, ((i, _, rid), row) in enumerate(zip(step.samples, step.rows)):
            next_tokens[i] = self._sampled[rid] = ids[j]
            if row.params.logprobs:
                logprobs[i] = lps[j]
            if row.params.top_logprobs:
                top_logprobs[i] = tops[j][: row.params.top_logprobs]
        return StepOutput(next_tokens, logprobs, top_logprobs)
