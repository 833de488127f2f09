"""Greedy float32 outputs are token-identical to HF transformers on the same GGUF weights, under
every batching shape the engine produces: chunked prefill, prefix-cache hits, page sizes 1 and 16,
mixed batches (a CPU's default) and prefills apart from decodes, the chunk cache, and a pool small
enough to force retraction; with the plain loop (a CPU's default) and the overlapped one."""

from __future__ import annotations

import pytest

from support.checks import run_and_compare

CONFIGS = {
    "page16-chunk256": dict(page_size=16, chunked_prefill_size=256),
    "page1-chunk256": dict(page_size=1, chunked_prefill_size=256),
    "prefills-apart": dict(page_size=16, chunked_prefill_size=256, enable_mixed_chunk=False),
    "mixed-chunk": dict(page_size=16, chunked_prefill_size=256, enable_mixed_chunk=True),
    "no-radix-cache": dict(page_size=16, chunked_prefill_size=256, disable_radix_cache=True),
    "lpm-no-chunking": dict(page_size=4, chunked_prefill_size=0, schedule_policy="lpm"),
    "overlap": dict(page_size=16, chunked_prefill_size=256, disable_overlap_schedule=False),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_matches_reference(make_engine, greedy_workload, name):
    engine = make_engine(**CONFIGS[name])
    run_and_compare(engine, greedy_workload, name)
    # The same prompts again: now served largely from the prefix cache, and still exact.
    again = run_and_compare(engine, greedy_workload, name + " (second pass)")
    if not CONFIGS[name].get("disable_radix_cache"):
        assert all(r.cached_tokens > 0 for r, (p, _, _) in zip(again, greedy_workload) if len(p) > 2 * 16)
    else:
        assert all(r.cached_tokens == 0 for r in again)


def test_retraction_keeps_outputs_exact(make_engine, greedy_workload):
    # Room for the longest prompt plus its output, far from room for all of them at once; with no
    # output reserve, admission packs the pool and the decodes' growth must retract.
    # Prefills apart from decodes: the schedule this pool was sized for (with mixed passes, a
    # CPU's default, whether it retracts depends on when the requests arrive).
    engine = make_engine(
        page_size=1, chunked_prefill_size=256, max_total_tokens=1800, init_new_token_ratio=0.0, min_new_token_ratio=0.0,
        enable_mixed_chunk=False,
    )
    run_and_compare(engine, greedy_workload, "small pool")
    assert engine.call(lambda: engine.scheduler.stats.retractions) > 0, "the pool was not small enough to retract"


def test_batch_of_one_matches_batched(make_engine, greedy_workload):
    """Each prompt alone gives what it gave inside the batch (and what the reference gives)."""
    engine = make_engine(page_size=16, chunked_prefill_size=256, disable_radix_cache=True)
    for i, case in enumerate(greedy_workload[:4]):
        run_and_compare(engine, [case], f"alone (prompt {i})")


def test_decode_projections_read_the_gguf_blocks(smollm_fp32):
    """The tests above run the block-quantized path (steps of up to 8 rows) wherever it can run:
    every layer projection of the built-in Q4_1/Q8_0 file holds its 4-bit blocks (in stripes), the lm_head its
    Q8_0 blocks as the file keeps them (int8 values, float16 scales), and each dequantizes, bit for bit, to the float32 weights HF transformers
    is given (fused projections: to their weights side by side)."""
    import torch

    from tandem.common.cpu import cpu_flags
    from tandem.kernels.block_linear import Bytes, NibbleStripes
    from tandem.server.model.loader import load_block_weights, load_weights

    module = smollm_fp32.module
    config, weights = load_weights(smollm_fp32.source)
    blocks = load_block_weights(smollm_fp32.source, config)
    assert len(blocks) == 1 + 7 * config.num_layers  # the tied embedding and every layer matrix
    for key, block in blocks.items():
        assert torch.equal(block.dequantize(), weights[key]), key
    if not all(flag in cpu_flags() for flag in ("avx2", "fma", "f16c")):
        assert all(layer.qkv.blocks is None for layer in module.layers)
        return
    assert isinstance(module.lm_head.blocks, Bytes)
    assert torch.equal(module.lm_head.blocks.dequantize(), weights["model.embed_tokens.weight"])
    fused = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
             "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}
    for i, layer in enumerate(module.layers):
        for name, parts in fused.items():
            linear = getattr(layer, name)
            assert isinstance(linear.blocks, NibbleStripes), (i, name)  # SmolLM2's rows make whole stripes
            want = torch.cat([weights[f"model.layers.{i}.{part}.weight"] for part in parts])
            assert torch.equal(linear.blocks.dequantize(), want), (i, name)


def test_greedy_matches_reference_with_int8_blocks(greedy_workload):
    """`--gguf-blocks int8`: the same Q4_1 blocks widened to int8 (`block_gemm`), exact too."""
    from support.checks import assert_engine_clean
    from tandem.kernels.block_linear import BlockWeights
    from tandem.server.config import EngineConfig
    from tandem.server.loop.engine import Engine
    from tandem.server.model.load import load_model

    model = load_model(EngineConfig(model="builtin:smollm2-135m", dtype="float32", device="cpu", gguf_blocks="int8"))
    assert all(isinstance(layer.gate_up.blocks, BlockWeights) for layer in model.module.layers)
    engine = Engine(EngineConfig(page_size=16, chunked_prefill_size=256, max_total_tokens=16384), model=model).start()
    try:
        run_and_compare(engine, greedy_workload, "int8 blocks")
        assert_engine_clean(engine)
    finally:
        engine.shutdown()
