"""A HF model directory's config.json as tandem's loader reads it: rotary settings written by
transformers before 5 (rope_theta, rope_scaling) and from 5 on (one rope_parameters); what it
refuses, by name: an architecture it does not run, a missing field, a RoPE scaling it does not
compute."""

from __future__ import annotations

import json

import pytest
import torch

from tandem.server.model.loader import ModelLoadError, load_weights, resolve_model

BASE = dict(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("rope, theta, scaling", [
    ({}, 10000.0, None),
    ({"rope_theta": 500000.0, "rope_scaling": LLAMA3}, 500000.0, LLAMA3),
    ({"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}, 1e6, None),
    ({"rope_parameters": {"rope_theta": 500000.0, **LLAMA3}}, 500000.0, {"rope_theta": 500000.0, **LLAMA3}),
], ids=["defaults", "before-5", "5-default", "5-llama3"])
def test_rotary_settings_in_either_format(tmp_path, rope, theta, scaling):
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps({**BASE, **rope}))
    save_file({"model.embed_tokens.weight": torch.zeros(8, 8)}, str(tmp_path / "model.safetensors"))
    config, _ = load_weights(resolve_model(str(tmp_path)))
    assert config.rope_theta == theta and config.rope_scaling == scaling


def write_config(path, cfg: dict) -> str:
    from safetensors.torch import save_file

    (path / "config.json").write_text(json.dumps(cfg))
    save_file({"model.embed_tokens.weight": torch.zeros(8, 8)}, str(path / "model.safetensors"))
    return str(path)


def test_an_architecture_tandem_does_not_run_is_named_with_the_list(tmp_path):
    with pytest.raises(ModelLoadError, match=r"model_type 'phi3' is not one of \('llama', .*'deepseek_v3'\)"):
        load_weights(resolve_model(write_config(tmp_path, {**BASE, "model_type": "phi3"})))


@pytest.mark.parametrize("model_type, drop, field", [
    ("qwen3", "hidden_size", "hidden_size"),
    ("llama", "num_attention_heads", "num_attention_heads"),
    ("qwen3_moe", "num_experts_per_tok", "num_experts_per_tok"),
])
def test_a_field_the_family_needs_is_named_when_missing(tmp_path, model_type, drop, field):
    cfg = {**BASE, "model_type": model_type, "num_experts": 4, "num_experts_per_tok": 2}
    del cfg[drop]
    with pytest.raises(ModelLoadError, match=f"config.json has no '{field}', which a {model_type} model needs"):
        load_weights(resolve_model(write_config(tmp_path, cfg)))


@pytest.mark.parametrize("scaling", [{"rope_type": "longrope", "factor": 4.0}, {"type": "dynamic", "factor": 2.0}])
def test_a_rope_scaling_tandem_does_not_compute_is_refused(tmp_path, scaling):
    """Served at plain RoPE, such a model would answer, wrongly; it is refused at start-up instead."""
    with pytest.raises(ModelLoadError, match=r"rope_scaling type .(longrope|dynamic). is not supported"):
        load_weights(resolve_model(write_config(tmp_path, {**BASE, "rope_scaling": scaling})))
