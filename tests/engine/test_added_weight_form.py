"""A weight form added by one class and one registry line (`support.forms.Float16Copy`, registered
first) serves a whole model: every projection and the LM head held in it, half float32's bytes, named
in the startup log, and an engine over the model generating the float32 model's greedy tokens."""

from __future__ import annotations

import logging

from support.checks import assert_engine_clean
from support.forms import Float16Copy
from tandem.kernels import weight_forms
from tandem.server.config import EngineConfig
from tandem.server.loop.engine import Engine
from tandem.server.model.load import load_model
from tandem.server.scheduling.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)


def generate(model, prompts: list[str]) -> list[list[int]]:
    engine = Engine(EngineConfig(max_total_tokens=2048), model=model).start()
    try:
        outputs = [engine.submit(prompt, GREEDY).result() for prompt in prompts]
        assert_engine_clean(engine)
    finally:
        engine.shutdown()
    return [out.output_ids for out in outputs]


def test_a_model_loads_and_generates_in_a_form_added_by_the_test(monkeypatch, caplog, smollm_fp32):
    monkeypatch.setattr(weight_forms, "WEIGHT_FORMS", [Float16Copy, *weight_forms.WEIGHT_FORMS])
    with caplog.at_level(logging.INFO, logger="tandem"):
        model = load_model(EngineConfig(model="builtin:smollm2-135m", dtype="float32", device="cpu"))
    assert "layers' projections: float16 copy; LM head: float16 copy" in caplog.text
    module = model.module
    linears = [module.lm_head] + [getattr(layer, n) for layer in module.layers for n in ("qkv", "o", "gate_up", "down")]
    assert all(isinstance(p.small, Float16Copy) and p.large is p.small for p in linears)
    assert all(layer.fused is None for layer in module.layers)  # the fused call takes 4-bit blocks alone
    weights = sum(p.small.weight.numel() for p in linears)
    assert module.streamed_bytes(1) == module.streamed_bytes(64) == 2 * weights
    assert generate(model, PROMPTS) == generate(smollm_fp32, PROMPTS)
