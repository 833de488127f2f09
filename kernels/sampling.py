"""Token sampling over a batch of logits rows.

Order per row: penalties on the raw logits, then the row's allowed-token mask (structured output),
then greedy argmax or temperature -> top-k -> top-p -> min-p -> a draw. Each draw uses its own
generator seeded by the caller, so a request's output depends only on its seed and position, never
on what it was batched with. Logprobs, when asked, are log-softmax of the raw logits (before
penalties, mask and temperature).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class RowParams(Protocol):
    """The sampling parameters the kernel reads (a request's SamplingParams has them all)."""

    temperature: float
    top_k: int  # <= 0: disabled
    top_p: float
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float


@dataclass
class SamplingRow:
    """What one row of logits needs: its parameters, its seed and, for penalties, its token history."""

    params: RowParams
    seed: int
    history: list[int] | None = None  # prompt + output tokens, only when a penalty is set
    prompt_len: int = 0

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0.0 or self.params.top_k == 1


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place. Repetition penalty (HF/CTRL style) covers prompt and output; frequency and presence
    penalties (OpenAI style) cover the output only."""
    for i, row in enumerate(rows):
        if row.history is None:
            continue
        device, p = logits.device, row.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(row.history)), dtype=torch.long, device=device)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        output = row.history[row.prompt_len :]
        if output and (p.frequency_penalty or p.presence_penalty):
            counts = torch.bincount(torch.tensor(output, device=device), minlength=logits.shape[1]).to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """In place: -inf for every token of logits row rows[i] that bitmask row i does not allow.
    bitmask: [len(rows), ceil(V / 32)] int32, bit j of word w allowing token 32 * w + j."""
    bitmask = bitmask.to(logits.device)  # packed: 1/32 of the bytes the unpacked mask would move
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().flatten(1)[:, : logits.shape[1]]
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def filter_probs(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero out what top-k / top-p / min-p exclude, per row; renormalize. probs: [B, V] float32."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[1], device=probs.device)[None, :]
    k = torch.where(top_k > 0, top_k, probs.shape[1])[:, None]
    drop = ranks >= k
    before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly above each token
    drop |= (before > top_p[:, None]) & (top_p < 1.0)[:, None]  # cumsum rounding must not trim top_p=1 rows
    drop |= sorted_probs < (min_p * sorted_probs[:, 0])[:, None]
    drop[:, 0] = False  # the most likely token always survives
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    filtered = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
    return filtered / filtered.sum(-1, keepdim=True)


def sample(
    logits: torch.Tensor, rows: list[SamplingRow], num_top_logprobs: int = 0, want_logprobs: bool = False,
    masked: tuple[list[int], torch.Tensor] | None = None,
) -> tuple[list[int], list[float] | None, list[list[tuple[int, float]]] | None]:
    """logits: [B, V]; returns the chosen ids, optionally their logprobs and the top alternatives.
    `masked`: (rows, bitmask) for the rows allowed only some tokens (apply_token_bitmask)."""
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1) if (want_logprobs or num_top_logprobs) else None
    if any(r.history is not None for r in rows) or masked is not None:
        logits = logits.clone()
        apply_penalties(logits, rows)
    if masked is not None:
        apply_token_bitmask(logits, *masked)
    chosen = logits.argmax(dim=-1)
    random_rows = [i for i, r in enumerate(rows) if not r.greedy]
    if random_rows:
        idx = torch.tensor(random_rows, device=logits.device)
        sub = [rows[i] for i in random_rows]
        params = [r.params for r in sub]
        temps = torch.tensor([p.temperature for p in params], device=logits.device)
        probs = torch.softmax(logits[idx] / temps[:, None], dim=-1)
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
            probs = filter_probs(
                probs,
                torch.tensor([p.top_k for p in params], device=logits.device),
                torch.tensor([p.top_p for p in params], device=logits.device),
                torch.tensor([p.min_p for p in params], device=logits.device),
            )
        for j, (i, row) in enumerate(zip(random_rows, sub)):
            gen = torch.Generator(device=logits.device).manual_seed(row.seed)
            # Exponential race: argmax p_i / E_i with E_i ~ Exp(1) draws i with probability p_i.
            noise = torch.empty_like(probs[j]).exponential_(generator=gen)
            chosen[i] = (probs[j] / noise).argmax()
    ids = chosen.tolist()
    chosen_lp = tops = None
    if logprobs is not None:
        chosen_lp = logprobs.gather(1, chosen[:, None]).squeeze(1).tolist() if want_logprobs else None
        if num_top_logprobs:
            vals, top_ids = logprobs.topk(num_top_logprobs, dim=-1)
            tops = [list(zip(t, v)) for t, v in zip(top_ids.tolist(), vals.tolist())]
    return ids, chosen_lp, tops
