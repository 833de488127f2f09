"""Qwen3, Qwen3-MoE, Mixtral, Gemma 3, Mistral and Qwen2 with their sliding windows, and DeepSeek-V3
with its latent KV cache, through the engine (paged KV, chunked prefill in mixed batches, the prefix
cache, retraction, overlap and plain loops, --tp-size 2): greedy output token-identical to HF
transformers' float32 model on the same weights. The sliding windows (7 positions) are far shorter
than the prompts, so they cross prefill chunks, reach into cached prefixes and slide along the
decode."""

from __future__ import annotations

import random

import pytest

from support.checks import HFReference, assert_engine_clean, reference_workload, run_and_compare
from support.tiny_models import (write_deepseek_v3, write_gemma3, write_mistral, write_mixtral, write_qwen2, write_qwen3,
                                 write_qwen3_moe)
from tandem.server.config import EngineConfig
from tandem.server.loop.engine import Engine
from tandem.server.model.loader import resolve_model
from tandem.server.model.tokenizer import export_tokenizer
from tandem.server.scheduling.plan import Phase


WRITERS = {"qwen3": write_qwen3, "qwen3_moe": write_qwen3_moe, "mixtral": write_mixtral, "gemma3_text": write_gemma3,
           "mistral": write_mistral, "qwen2": write_qwen2, "deepseek_v3": write_deepseek_v3}


@pytest.fixture(scope="module", params=list(WRITERS))
def family(request, tmp_path_factory):
    """The model directory (with the built-in model's tokenizer beside it: the prompts are token
    ids below the model's vocabulary) and HF's greedy outputs for a few prompts, 4 to 300 tokens."""
    path = tmp_path_factory.mktemp(request.param)
    hf = WRITERS[request.param](path)
    export_tokenizer(resolve_model(EngineConfig.model), path)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (4, 17, 64, 150, 300)]
    prompts.append(prompts[4][:200] + prompts[1])  # shares a long prefix with the last one
    return request.param, path, reference_workload(HFReference(hf), prompts, 16)


def record_phases(engine) -> list:
    """The phase of every step the engine's scheduler plans from now on."""
    phases, schedule = [], engine.scheduler.schedule

    def recorded():
        plan = schedule()
        if plan is not None:
            phases.append(plan.phase)
        return plan

    engine.call(lambda: setattr(engine.scheduler, "schedule", recorded))
    return phases


# A pool of 400 tokens under the workload's 850 retracts requests (chunks of 64, no reserve for
# their growth, prefills apart from decodes: with mixed passes, a CPU's default, whether it retracts
# depends on when the requests arrive); the second pass of the others runs from the prefix cache.
SMALL_POOL = dict(max_total_tokens=400, init_new_token_ratio=0.0, min_new_token_ratio=0.0, enable_mixed_chunk=False)


@pytest.mark.parametrize("overrides", [
    dict(page_size=16, chunked_prefill_size=64, enable_mixed_chunk=True, disable_overlap_schedule=False),
    dict(page_size=1, disable_radix_cache=True, disable_overlap_schedule=True),
    dict(page_size=1, disable_radix_cache=True, chunked_prefill_size=64, **SMALL_POOL),
    dict(tp_size=2, page_size=16, chunked_prefill_size=64),
], ids=["page16-chunk64-mixed-overlap", "page1-no-cache-plain", "page1-retract", "tp2"])
def test_greedy_matches_hf(family, overrides):
    architecture, path, workload = family
    config = EngineConfig(model=str(path), dtype="float32", **{"max_total_tokens": 4096, **overrides})
    with Engine(config) as engine:
        assert engine.model.config.architecture == architecture
        assert engine.overlap == (overrides.get("disable_overlap_schedule") is False)
        phases = record_phases(engine)
        run_and_compare(engine, workload, architecture)
        if overrides.get("enable_mixed_chunk"):
            assert Phase.MIXED in phases, "no prefill chunk ran beside decodes"
        if "init_new_token_ratio" in overrides:
            assert engine.call(lambda: engine.scheduler.stats.retractions) > 0, "the pool was too large to retract"
        again = run_and_compare(engine, workload, f"{architecture} (second pass)")
        if not overrides.get("disable_radix_cache"):
            assert sum(r.cached_tokens for r in again) > 0
        assert_engine_clean(engine)
