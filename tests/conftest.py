"""Shared fixtures: the built-in model loaded once per session, engines that prove at teardown
that they leaked nothing, the HF transformers reference running the same GGUF weights
(support/checks.py) and the exactness prompts with its outputs. Each test is marked with its tier,
the folder it lives in."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from support.checks import HFReference, assert_engine_clean, reference_workload
from support.prompts import prompts

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm_fp32():
    from tandem.server.config import EngineConfig
    from tandem.server.model.load import load_model

    return load_model(EngineConfig(model="builtin:smollm2-135m", dtype="float32", device="cpu"))


@pytest.fixture(scope="session")
def smollm_bf16_prefill():
    """The built-in model in float32 with its products over many rows in bfloat16 (what `auto` picks
    on a CPU with AVX512-BF16): prompt pieces, and decode steps from BFLOAT16_MIN_ROWS rows."""
    from tandem.server.config import EngineConfig
    from tandem.server.model.load import load_model

    return load_model(EngineConfig(model="builtin:smollm2-135m", dtype="float32", device="cpu", prefill_dtype="bfloat16"))


@pytest.fixture
def make_engine(smollm_fp32):
    """Factory: make_engine(**EngineConfig overrides) -> a running Engine on the shared fp32 model."""
    from tandem.server.config import EngineConfig
    from tandem.server.loop.engine import Engine

    engines = []

    def make(**overrides):
        overrides.setdefault("max_total_tokens", 16384)
        engine = Engine(EngineConfig(**overrides), model=smollm_fp32).start()
        engines.append(engine)
        return engine

    yield make
    try:
        for engine in engines:
            assert_engine_clean(engine)
    finally:
        for engine in engines:
            engine.shutdown()


@pytest.fixture(scope="session")
def hf_reference():
    return HFReference()


@pytest.fixture(scope="session")
def greedy_workload(smollm_fp32, hf_reference):
    """support/prompts.py's prompts (4 to 1,200+ tokens) with HF's greedy 24 tokens each: the
    exactness tests' reference_workload() for run_and_compare()."""
    ids = prompts(smollm_fp32.tokenizer)
    lengths = sorted(map(len, ids))
    assert len(ids) >= 10 and lengths[0] == 4 and lengths[-1] >= 1200, lengths
    return reference_workload(hf_reference, ids, 24)


TIERS = ("unit", "engine", "e2e", "packaging", "images")  # tests/<tier>/: each is also a marker (`pytest -m unit`)


def pytest_collection_modifyitems(config, items):
    """Every test is marked with its tier (its folder). Tests marked `gpu` are skipped, and only
    skipped, where CUDA is absent."""
    import torch

    tests = Path(__file__).resolve().parent
    skip_gpu = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU (marked gpu)")
    for item in items:
        tier = Path(item.fspath).resolve().relative_to(tests).parts[0]
        assert tier in TIERS, f"{item.nodeid}: tests live in tests/<tier>/, one of {TIERS}"
        item.add_marker(tier)
        if skip_gpu is not None and item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)
