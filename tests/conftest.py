"""Shared fixtures: the built-in model loaded once per session, engines that prove at teardown
that they leaked nothing, and the HF transformers reference running the same GGUF weights."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm_fp32():
    from tandem.server.model import load_model

    return load_model("builtin:smollm2-135m", "float32", "cpu")


def assert_engine_clean(engine) -> None:
    """Nothing running or waiting; every page free or held (unpinned) by the prefix cache."""

    def check():
        engine.scheduler.check_integrity()
        mem = engine.memory
        assert not engine.scheduler.has_work(), "requests still queued or running"
        assert mem.slots.num_free == mem.slots.num_slots, "a slot is still held"
        assert mem.allocator.num_free + mem.cache.num_pages == mem.num_pages, "pages held outside the cache"
        assert mem.cache.num_evictable == mem.cache.num_pages, "cached pages still pinned"

    engine.call(check)


@pytest.fixture
def make_engine(smollm_fp32):
    """Factory: make_engine(**EngineConfig overrides) -> a running Engine on the shared fp32 model."""
    from tandem.server.config import EngineConfig
    from tandem.server.engine import Engine

    engines = []

    def make(**overrides):
        overrides.setdefault("max_total_tokens", 16384)
        engine = Engine(EngineConfig(**overrides), model=smollm_fp32)
        engines.append(engine)
        return engine

    yield make
    try:
        for engine in engines:
            assert_engine_clean(engine)
    finally:
        for engine in engines:
            engine.shutdown()


class HFReference:
    """Greedy decoding with HF transformers on the same GGUF weights (float32, CPU), recording the
    top-2 logit gap at every generated position. Results are memoized per (prompt, length)."""

    def __init__(self):
        import torch
        from transformers import AutoModelForCausalLM

        from tandem.server.model.loader import resolve_model

        source = resolve_model("builtin:smollm2-135m")
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(
            str(source.path.parent), gguf_file=source.path.name, dtype=torch.float32
        ).eval()
        self._memo: dict = {}

    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in self._memo:
            torch = self.torch
            tokens, gaps = [], []
            with torch.inference_mode():
                out = self.model(torch.tensor([prompt_ids]), use_cache=True)
                for _ in range(max_new_tokens):
                    logits = out.logits[0, -1].float()
                    top2 = logits.topk(2).values
                    gaps.append(float(top2[0] - top2[1]))
                    nxt = int(logits.argmax())
                    tokens.append(nxt)
                    out = self.model(torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True)
            self._memo[key] = (tokens, gaps)
        return self._memo[key]


@pytest.fixture(scope="session")
def hf_reference():
    return HFReference()


def assert_matches_reference(got: list[int], want: list[int], gaps: list[float], label: str = "") -> None:
    """Token-identical, except that a divergence is tolerated where the reference's top-2 logit
    gap is below 1e-3 (a near tie that float rounding may flip); comparison stops there."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            assert gaps[i] < 1e-3, (
                f"{label}: token {i} differs ({a} != {b}) where the reference's top-2 gap is {gaps[i]:.3g}"
            )
            return
    assert len(got) == len(want), f"{label}: {len(got)} tokens, reference has {len(want)}"


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` are skipped, and only skipped, where CUDA is absent."""
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (marked gpu)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)
