"""Attention in plain torch (CPU, or any device): gathers each sequence's pages and calls
scaled_dot_product_attention. Prompt pieces run one sequence at a time (they are few and large);
decodes run as one padded batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels.attention import AttentionBackend, AttentionBatch


def _slots(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """[..., num_pages] page ids -> [..., num_pages * page_size] flat slots, in position order."""
    offsets = torch.arange(page_size, device=pages.device)
    return (pages.unsqueeze(-1) * page_size + offsets).flatten(-2)


class TorchAttention(AttentionBackend):
    def prepare(self, batch: AttentionBatch) -> None:
        P, device = self.kv_cache.page_size, self.kv_cache.device
        self.out_slots = batch.out_slots
        self.extends = []  # (first row, q_len, kv slots [kv_len], mask or None for plain causal)
        row = 0
        for i in range(batch.num_extends):
            q_len, kv_len = batch.q_lens[i], batch.kv_lens[i]
            slots = _slots(torch.tensor(batch.page_tables[i], device=device), P)[:kv_len]
            mask = None
            if q_len != kv_len:  # a cached prefix: new token j sees positions [0, kv_len - q_len + j]
                cols = torch.arange(kv_len, device=device)
                rows = torch.arange(kv_len - q_len, kv_len, device=device)
                mask = cols[None, :] <= rows[:, None]
            self.extends.append((row, q_len, slots, mask))
            row += q_len
        self.decode_start = row
        num_decodes = len(batch.q_lens) - batch.num_extends
        self.decode_slots = self.decode_mask = None
        if num_decodes:
            tables = batch.page_tables[batch.num_extends :]
            kv_lens = torch.tensor(batch.kv_lens[batch.num_extends :], device=device)
            width = max(len(t) for t in tables)
            padded = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables], device=device)
            slots = _slots(padded, P)[:, : int(kv_lens.max())]
            valid = torch.arange(slots.shape[1], device=device)[None, :] < kv_lens[:, None]
            # Padding points at each sequence's position 0: always written, so never NaN garbage.
            self.decode_slots = torch.where(valid, slots, slots[:, :1])
            self.decode_mask = valid[:, None, None, :]

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.kv_cache.write(layer, self.out_slots, k, v)
        k_all, v_all = self.kv_cache.flat_k(layer), self.kv_cache.flat_v(layer)
        out = torch.empty_like(q)
        for row, q_len, slots, mask in self.extends:
            qi = q[row : row + q_len].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
            ki = k_all[slots].transpose(0, 1).unsqueeze(0)  # [1, KVH, kv_len, D]
            vi = v_all[slots].transpose(0, 1).unsqueeze(0)
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=True
            )
            out[row : row + q_len] = oi[0].transpose(0, 1)
        if self.decode_slots is not None:
            qd = q[self.decode_start :].unsqueeze(2)  # [B, H, 1, D]
            kd = k_all[self.decode_slots].transpose(1, 2)  # [B, KVH, L, D]
            vd = v_all[self.decode_slots].transpose(1, 2)
            od = F.scaled_dot_product_attention(
                qd, kd, vd, attn_mask=self.decode_mask, scale=self.scale, enable_gqa=True
            )
            out[self.decode_start :] = od.squeeze(2)
        return out
