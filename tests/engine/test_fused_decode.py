"""A decode step's layers as native calls (`tandem.kernels.fused_decode`): all of them in one call
(`FusedDecodeStack`, what a step takes), each layer as one call (`FusedDecodeLayer`), against the same
layers run op by op, on the built-in model (float32, its projections in 4-bit blocks): the hidden
states and the KV written equal bit for bit, for every batch size the calls take; steps they do not
take (prompt pieces, more rows than the 4-bit kernels take) run op by op; a bad operand is refused
by name. Greedy equality with HF through the engine is test_exactness.py's."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.kernels import fused_decode
from tandem.kernels.attention import AttentionBatch
from tandem.kernels.block_linear import BLOCK_MAX_ROWS, bfloat16_blocks_unavailable
from tandem.kernels.kv_cache import PagedKVCache, flat_slots
from tandem.kernels.torch_attention import TorchAttention
from tandem.kernels.weight_forms import STRIPES_BFLOAT16_MIN_ROWS

PAGE = 16
PAGES = 256


@pytest.fixture
def calls(monkeypatch):
    """Which fused calls were asked for, and whether each took the step: ("stack", taken) per step,
    ("layer", taken) per layer step."""
    taken = []
    for kind, cls in (("stack", fused_decode.FusedDecodeStack), ("layer", fused_decode.FusedDecodeLayer)):
        def counting(self, *args, _original=cls.__call__, _kind=kind):
            out = _original(self, *args)
            taken.append((_kind, out is not None))
            return out

        monkeypatch.setattr(cls, "__call__", counting)
    return taken


def cache_and_backend(c, seed: int, dtype: torch.dtype = torch.float32) -> tuple[PagedKVCache, TorchAttention]:
    cache = PagedKVCache(c.num_layers, PAGES, PAGE, c.num_kv_heads, c.head_dim, dtype, torch.device("cpu"))
    cache.buffer.normal_(generator=torch.Generator().manual_seed(seed))
    return cache, TorchAttention(cache, c.num_heads, c.head_dim, c.head_dim**-0.5)


def step(model, cache, attn, batch: AttentionBatch, ids: list[int], positions: list[int], form: str = "stack"):
    """One forward pass with the layers as `form` runs them: stack, layer (each layer fused) or op_by_op."""
    stack = model.fused_stack
    fused_decode.use_fused_decode(form != "op_by_op")
    model.fused_stack = stack if form == "stack" else None
    try:
        attn.prepare(batch)
        return model(torch.tensor(ids), torch.tensor(positions), attn)
    finally:
        fused_decode.use_fused_decode(True)
        model.fused_stack = stack


def decode_batch(rows: int, rng: random.Random) -> tuple[AttentionBatch, list[int]]:
    cached = [rng.randrange(1, 200) for _ in range(rows)]
    pages = iter(rng.sample(range(PAGES), PAGES))
    tables = [[next(pages) for _ in range(-(-(k + 1) // PAGE))] for k in cached]
    slots = [flat_slots(t, k, k + 1, PAGE)[0] for t, k in zip(tables, cached)]
    return AttentionBatch([1] * rows, [k + 1 for k in cached], tables, 0, torch.tensor(slots)), cached


@pytest.mark.parametrize("rows", [1, 3, BLOCK_MAX_ROWS])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_a_fused_step_equals_the_op_by_op_step_bit_for_bit(smollm_fp32, calls, rows, kv_dtype):
    """Over a float32 cache, and over a bfloat16 one (the new K and V rounded as the cache's write
    rounds them, read widened)."""
    model, c = smollm_fp32.module, smollm_fp32.config
    assert all(layer.fused is not None for layer in model.layers) and model.fused_stack is not None
    rng = random.Random(rows)
    batch, positions = decode_batch(rows, rng)
    ids = [rng.randrange(c.vocab_size) for _ in range(rows)]
    out, buffers = {}, {}
    for form in ("stack", "layer", "op_by_op"):
        cache, attn = cache_and_backend(c, seed=rows, dtype=kv_dtype)
        out[form], buffers[form] = step(model, cache, attn, batch, ids, positions, form), cache.buffer
    layer_steps = [("layer", True)] * c.num_layers
    assert calls == [("stack", True)] + layer_steps + [("layer", False)] * c.num_layers  # off: op by op
    for form in ("layer", "op_by_op"):
        assert torch.equal(out["stack"], out[form]), form
        assert torch.equal(buffers["stack"], buffers[form]), form  # the same K and V in the same slots
    written = cache.k[0].flatten(0, 1)[batch.out_slots]
    fresh = cache_and_backend(c, seed=rows, dtype=kv_dtype)[0]
    assert not torch.equal(written, fresh.k[0].flatten(0, 1)[batch.out_slots])


@pytest.mark.parametrize("rows", [1, STRIPES_BFLOAT16_MIN_ROWS, BLOCK_MAX_ROWS])
def test_with_bfloat16_products_the_fused_step_still_equals_the_op_by_op_step(smollm_fp32, smollm_bf16_prefill, rows):
    """Where the projections multiply steps of STRIPES_BFLOAT16_MIN_ROWS rows or more in bfloat16 (the
    4-bit blocks in stripes, on a CPU with AVX512-BF16), the fused calls do too: still bit for bit the
    op-by-op step; below that row count, the float32 model's step within float32's rounding (both
    multiply the stripes in float32); from it, not (the rounding happened)."""
    model, c = smollm_bf16_prefill.module, smollm_bf16_prefill.config
    native = bfloat16_blocks_unavailable() is None
    assert model.fused_stack is not None and all(layer.fused.bfloat16_rows == (STRIPES_BFLOAT16_MIN_ROWS if native else 0)
                                                 for layer in model.layers)
    rng = random.Random(rows)
    batch, positions = decode_batch(rows, rng)
    ids = [rng.randrange(c.vocab_size) for _ in range(rows)]
    out = {}
    for name, loaded, form in (("stack", smollm_bf16_prefill, "stack"), ("op_by_op", smollm_bf16_prefill, "op_by_op"),
                               ("float32", smollm_fp32, "stack")):
        cache, attn = cache_and_backend(c, seed=rows)
        out[name] = step(loaded.module, cache, attn, batch, ids, positions, form)
    assert torch.equal(out["stack"], out["op_by_op"])
    if not native:
        assert torch.equal(out["stack"], out["float32"])
    else:
        close = torch.allclose(out["stack"], out["float32"], rtol=1e-4, atol=1e-4)
        assert close == (rows < STRIPES_BFLOAT16_MIN_ROWS), float((out["stack"] - out["float32"]).abs().max())


def test_steps_the_call_does_not_take_run_op_by_op(smollm_fp32, calls):
    model, c = smollm_fp32.module, smollm_fp32.config
    rng = random.Random(9)
    cache, attn = cache_and_backend(c, seed=9)
    # A prompt piece of 5 tokens beside one decode: not decodes alone
    pages = rng.sample(range(PAGES), 4)
    prompt = AttentionBatch([5, 1], [5, 41], [pages[:1], pages[1:]], 1,
                            torch.tensor(flat_slots(pages[:1], 0, 5, PAGE) + flat_slots(pages[1:], 40, 41, PAGE)))
    step(model, cache, attn, prompt, list(range(6)), [0, 1, 2, 3, 4, 40])
    # More decodes than the 4-bit kernels take
    many, positions = decode_batch(BLOCK_MAX_ROWS + 1, rng)
    step(model, cache, attn, many, [7] * (BLOCK_MAX_ROWS + 1), positions)
    assert calls == 2 * ([("stack", False)] + [("layer", False)] * c.num_layers)


def test_a_slot_outside_the_cache_is_refused_by_name(smollm_fp32):
    model, c = smollm_fp32.module, smollm_fp32.config
    cache, attn = cache_and_backend(c, seed=1)
    batch, positions = decode_batch(1, random.Random(1))
    batch.out_slots = torch.tensor([PAGES * PAGE])
    with pytest.raises(RuntimeError, match=r"slots\[0\] = 4096 is outside the cache's 4096"):
        step(model, cache, attn, batch, [3], positions)


def test_the_stack_refuses_caches_that_do_not_match_its_layers_by_name(smollm_fp32):
    model, c = smollm_fp32.module, smollm_fp32.config
    cache, attn = cache_and_backend(c, seed=2)
    batch, positions = decode_batch(1, random.Random(2))
    attn.prepare(batch)
    paged = attn.decode_in_place(0)
    h = torch.randn(1, c.hidden_size)
    cos, sin = torch.ones(1, 1, c.head_dim), torch.zeros(1, 1, c.head_dim)
    with pytest.raises(RuntimeError, match=rf"k_caches, v_caches and windows: one a layer \({c.num_layers}\), got 1, 1 and 1"):
        model.fused_stack.stack.forward(h, cos, sin, [paged.k_cache], [paged.v_cache], paged.slots, paged.page_table,
                                        paged.kv_lens, paged.scale, [0])
    with pytest.raises(RuntimeError, match="weights must be 14 tensors a layer, got 3"):
        torch.classes.tandem.DecodeStackQ4([h, h, h], 1e-5, c.num_heads, c.num_kv_heads, 0)
