"""Each decoder layer of a decode step as one native call (`tandem.kernels.fused_decode`) against
the same layer run op by op, on the built-in model (float32, its projections in 4-bit blocks): the
hidden states and the KV written equal bit for bit, for every batch size the call takes; steps it
does not take (prompt pieces, more rows than the 4-bit kernels take) run op by op; a bad operand
is refused by name. Greedy equality with HF through the engine is test_exactness.py's."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.kernels import fused_decode
from tandem.kernels.attention import AttentionBatch
from tandem.kernels.block_linear import BLOCK_MAX_ROWS
from tandem.kernels.kv_cache import PagedKVCache, flat_slots
from tandem.kernels.torch_attention import TorchAttention

PAGE = 16
PAGES = 256


@pytest.fixture
def calls(monkeypatch):
    """How many layer steps took the fused call."""
    taken = []
    original = fused_decode.FusedDecodeLayer.__call__

    def counting(self, *args):
        out = original(self, *args)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(fused_decode.FusedDecodeLayer, "__call__", counting)
    return taken


def cache_and_backend(c, seed: int) -> tuple[PagedKVCache, TorchAttention]:
    cache = PagedKVCache(c.num_layers, PAGES, PAGE, c.num_kv_heads, c.head_dim, torch.float32, torch.device("cpu"))
    cache.buffer.normal_(generator=torch.Generator().manual_seed(seed))
    return cache, TorchAttention(cache, c.num_heads, c.head_dim, c.head_dim**-0.5)


def step(model, cache, attn, batch: AttentionBatch, ids: list[int], positions: list[int], fused: bool):
    fused_decode.use_fused_decode(fused)
    try:
        attn.prepare(batch)
        return model(torch.tensor(ids), torch.tensor(positions), attn)
    finally:
        fused_decode.use_fused_decode(True)


def decode_batch(rows: int, rng: random.Random) -> tuple[AttentionBatch, list[int]]:
    cached = [rng.randrange(1, 200) for _ in range(rows)]
    pages = iter(rng.sample(range(PAGES), PAGES))
    tables = [[next(pages) for _ in range(-(-(k + 1) // PAGE))] for k in cached]
    slots = [flat_slots(t, k, k + 1, PAGE)[0] for t, k in zip(tables, cached)]
    return AttentionBatch([1] * rows, [k + 1 for k in cached], tables, 0, torch.tensor(slots)), cached


@pytest.mark.parametrize("rows", [1, 3, BLOCK_MAX_ROWS])
def test_a_fused_step_equals_the_op_by_op_step_bit_for_bit(smollm_fp32, calls, rows):
    model, c = smollm_fp32.module, smollm_fp32.config
    assert all(layer.fused is not None for layer in model.layers)
    rng = random.Random(rows)
    batch, positions = decode_batch(rows, rng)
    ids = [rng.randrange(c.vocab_size) for _ in range(rows)]
    fused_cache, fused_attn = cache_and_backend(c, seed=rows)
    plain_cache, plain_attn = cache_and_backend(c, seed=rows)
    fused = step(model, fused_cache, fused_attn, batch, ids, positions, fused=True)
    assert calls == [True] * c.num_layers
    plain = step(model, plain_cache, plain_attn, batch, ids, positions, fused=False)
    assert calls == [True] * c.num_layers + [False] * c.num_layers  # off: each layer ran op by op
    assert torch.equal(fused, plain)
    assert torch.equal(fused_cache.buffer, plain_cache.buffer)  # the same K and V in the same slots
    written = fused_cache.k[0].flatten(0, 1)[batch.out_slots]
    assert not torch.equal(written, cache_and_backend(c, seed=rows)[0].k[0].flatten(0, 1)[batch.out_slots])


def test_steps_the_call_does_not_take_run_op_by_op(smollm_fp32, calls):
    model, c = smollm_fp32.module, smollm_fp32.config
    rng = random.Random(9)
    cache, attn = cache_and_backend(c, seed=9)
    # A prompt piece of 5 tokens beside one decode: not decodes alone
    pages = rng.sample(range(PAGES), 4)
    prompt = AttentionBatch([5, 1], [5, 41], [pages[:1], pages[1:]], 1,
                            torch.tensor(flat_slots(pages[:1], 0, 5, PAGE) + flat_slots(pages[1:], 40, 41, PAGE)))
    step(model, cache, attn, prompt, list(range(6)), [0, 1, 2, 3, 4, 40], fused=True)
    # More decodes than the 4-bit kernels take
    many, positions = decode_batch(BLOCK_MAX_ROWS + 1, rng)
    step(model, cache, attn, many, [7] * (BLOCK_MAX_ROWS + 1), positions, fused=True)
    assert calls == [False] * (2 * c.num_layers)


def test_a_slot_outside_the_cache_is_refused_by_name(smollm_fp32):
    model, c = smollm_fp32.module, smollm_fp32.config
    cache, attn = cache_and_backend(c, seed=1)
    batch, positions = decode_batch(1, random.Random(1))
    batch.out_slots = torch.tensor([PAGES * PAGE])
    with pytest.raises(RuntimeError, match=r"slots\[0\] = 4096 is outside the cache's 4096"):
        step(model, cache, attn, batch, [3], positions, fused=True)
