"""DeepSeek-V3's latent KV cache between a prefill and a decode engine in one process (Mooncake over
TCP on 127.0.0.1), at tensor-parallel sizes 1 -> 1, 2 -> 1 and 1 -> 2: the decode's greedy tokens
equal HF transformers' float32 ones, the pages move as one latent row per token and layer (every
rank holds the latent whole, so one prefill rank sends, one copy per decode rank), decode-side
prefix reuse skips the latent pages the decode caches, and both sides end clean."""

from __future__ import annotations

import gc
import random

import pytest

from support.checks import HFReference, assert_matches_reference
from support.pd import assert_clean, run_pair, run_pairs, wait_idle
from support.serving import free_port
from support.tiny_models import write_deepseek_v3
from tandem.server.config import DisaggConfig, EngineConfig
from tandem.server.scheduling.sampling_params import SamplingParams

PARAMS = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    from tandem.server.model.loader import resolve_model
    from tandem.server.model.tokenizer import export_tokenizer

    path = tmp_path_factory.mktemp("deepseek")
    hf = write_deepseek_v3(path)
    export_tokenizer(resolve_model(EngineConfig.model), path)
    return path, HFReference(hf)


@pytest.fixture(autouse=True)
def collect_engines_now():
    yield
    gc.collect()  # a Mooncake engine's destructor stalls whichever later test collects it


@pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 1), (2, 1), (1, 2)], ids=["tp1-tp1", "tp2-tp1", "tp1-tp2"])
def test_latent_pages_move_between_tp_sizes_and_decode_exactly(deepseek, prefill_tp, decode_tp):
    from tandem.server.loop.engine import Engine

    path, hf = deepseek
    port = free_port()
    engine = dict(model=str(path), dtype="float32", max_total_tokens=4096, page_size=16)
    p = Engine(EngineConfig(**engine, tp_size=prefill_tp),
               disagg=DisaggConfig(role="prefill", bootstrap_port=port, bootstrap_timeout=10.0)).start()
    d = Engine(EngineConfig(**engine, tp_size=decode_tp), disagg=DisaggConfig(role="decode", bootstrap_timeout=10.0)).start()
    try:
        layout = d.kv_layout()
        assert (layout.kv_parts, layout.replicated, layout.num_kv_heads, layout.head_dim) == (1, True, 1, 48)
        assert layout.page_bytes_all_parts == 3 * 16 * 48 * 4  # layers x tokens x (latent + rotated key) x float32
        rng = random.Random(prefill_tp * 10 + decode_tp)
        system = [rng.randrange(3, 300) for _ in range(70)]  # 4 whole pages and 6 tokens
        prompts = [system + [rng.randrange(3, 300) for _ in range(9 + 5 * i)] for i in range(4)]
        first = run_pair(p, d, port, prompts[0], PARAMS)["decode"]
        wait_idle(p, d)  # its pages are in the decode's cache now: the others' first 4 need not move
        results = [first] + [legs["decode"] for legs in run_pairs(p, d, port, prompts[1:], PARAMS)]
        for prompt, out in zip(prompts, results):
            want, gaps = hf.greedy(prompt, PARAMS.max_new_tokens)
            assert_matches_reference(out.output_ids, want, gaps, f"{len(prompt)}-token prompt, tp {prefill_tp} -> {decode_tp}")
        pages = sum(-(-len(prompt) // 16) for prompt in prompts)
        skipped = d.snapshot.kv_transfer_skipped_bytes // (layout.page_bytes_all_parts * decode_tp)
        assert skipped == 3 * 4, "decode-side prefix reuse did not skip the cached latent pages"
        moved = (pages - skipped) * layout.page_bytes_all_parts * decode_tp  # one copy per decode rank
        assert p.snapshot.kv_transfer_bytes == d.snapshot.kv_transfer_bytes == moved
        assert_clean(p, d)
    finally:
        for e in (p, d):
            e.shutdown()
