"""A HF model directory's config.json as tandem's loader reads it: rotary settings written by
transformers before 5 (rope_theta, rope_scaling) and from 5 on (one rope_parameters)."""

from __future__ import annotations

import json

import pytest
import torch

from tandem.server.model.loader import load_weights, resolve_model

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
