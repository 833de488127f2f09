"""Mistral and Qwen2 from HF model directories: HF transformers' float32 logits, with the sliding
window each config turns on (every Mistral layer; Qwen2's layers from max_window_layers on), and
Qwen2's q/k/v biases. Switching the window off moves the logits: the comparison sees it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from support.tiny_models import assert_hf_logits, forward_logits, write_mistral, write_qwen2
from tandem.server.model.llama import LlamaForCausalLM
from tandem.server.model.loader import load_weights, resolve_model
from tandem.server.model.precision import Precision

FAMILIES = {"mistral": (write_mistral, (0, 1)), "qwen2": (write_qwen2, (1, 2))}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gives_hf_float32_logits_within_its_window(tmp_path, family):
    writer, sliding = FAMILIES[family]
    hf = writer(tmp_path)
    config, weights = load_weights(resolve_model(str(tmp_path)))
    assert (config.architecture, config.sliding_window, config.sliding_layers) == (family, 7, sliding)
    assert config.attention_bias == (family == "qwen2")
    ids = torch.randint(0, config.vocab_size, (30,), generator=torch.Generator().manual_seed(2))
    expected = assert_hf_logits(LlamaForCausalLM(config, weights, Precision.uniform(torch.float32), "cpu"), hf, ids)
    unwindowed = LlamaForCausalLM(dataclasses.replace(config, sliding_layers=()), weights, Precision.uniform(torch.float32), "cpu")
    assert not torch.allclose(forward_logits(unwindowed, ids), expected, atol=1e-2)


def test_a_mistral_without_a_window_attends_to_everything(tmp_path):
    """Mistral v0.2 and later write sliding_window null."""
    hf = write_mistral(tmp_path, sliding_window=None)
    config, weights = load_weights(resolve_model(str(tmp_path)))
    assert config.sliding_layers == () and config.layer_windows == (0, 0)
    ids = torch.randint(0, config.vocab_size, (30,), generator=torch.Generator().manual_seed(2))
    assert_hf_logits(LlamaForCausalLM(config, weights, Precision.uniform(torch.float32), "cpu"), hf, ids)
