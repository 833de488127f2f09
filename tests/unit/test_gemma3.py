"""Gemma 3: model directories written by HF transformers (Gemma3ForCausalLM, and the multimodal
Gemma3ForConditionalGeneration whose language model tandem serves) load through tandem's loader and
give HF's float32 logits. What Gemma 3 adds to the Llama family, each switched off in turn to show
that the comparison sees it: sliding-window layers with their own RoPE base, the attention scale
of query_pre_attn_scalar, GeLU, (1 + w) norms, norms around attention and MLP, scaled embeddings."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from support.tiny_models import (assert_hf_logits, forward_logits, gemma3_text_config, perturb_gemma3_norms,
                                 write_gemma3)
from tandem.server.model.llama import LlamaForCausalLM
from tandem.server.model.loader import ModelLoadError, load_weights, resolve_model
from tandem.server.model.precision import Precision
from tandem.server.model.shard import Shard, shard_model


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    return path, write_gemma3(path)


def prompt(n: int = 30, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed))


def test_the_loader_reads_gemma3s_config(gemma3_dir):
    path, _ = gemma3_dir
    config, _ = load_weights(resolve_model(str(path)))
    assert config.architecture == "gemma3_text" and config.qk_norm and config.tie_word_embeddings
    assert (config.sliding_window, config.sliding_layers, config.layer_windows) == (7, (0, 1, 3), (7, 7, 0, 7, 0))
    assert (config.rope_theta, config.local_rope_theta) == (1e6, 1e4)
    assert config.rope_scaling["rope_type"] == "linear" and config.rope_scaling["factor"] == 4.0
    assert config.softmax_scale == pytest.approx(24**-0.5)
    assert (config.hidden_act, config.norm_offset, config.sandwich_norms, config.embed_scale) == (
        "gelu_tanh", True, True, True)


def test_gemma3_gives_hf_float32_logits(gemma3_dir):
    path, hf = gemma3_dir
    config, weights = load_weights(resolve_model(str(path)))
    assert_hf_logits(LlamaForCausalLM(config, weights, Precision.uniform(torch.float32), "cpu"), hf, prompt())


@pytest.mark.parametrize("change", [
    dict(sliding_layers=()),
    dict(local_rope_theta=1e6),
    dict(attention_scale=0.0),
    dict(hidden_act="silu"),
    dict(norm_offset=False),
    dict(embed_scale=False),
    dict(rope_scaling=None),
], ids=lambda change: next(iter(change)))
def test_each_part_of_gemma3_shows_in_the_logits(gemma3_dir, change):
    """A 30-token prompt over windows of 7: every change to the architecture moves the logits."""
    path, hf = gemma3_dir
    config, weights = load_weights(resolve_model(str(path)))
    ids = prompt()
    with torch.inference_mode():
        expected = hf(ids[None]).logits[0]
    other = LlamaForCausalLM(dataclasses.replace(config, **change), weights, Precision.uniform(torch.float32), "cpu")
    assert not torch.allclose(forward_logits(other, ids), expected, atol=1e-2)


def test_a_multimodal_gemma3s_language_model_gives_hf_float32_logits(tmp_path):
    """The 4B-27B checkpoints: a gemma3 config with a text_config, the text model's weights under
    language_model., a vision tower that tandem leaves out (it serves text)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    torch.manual_seed(0)
    hf = Gemma3ForConditionalGeneration(Gemma3Config(text_config=gemma3_text_config().to_dict(),
                                                     vision_config=vision.to_dict(), mm_tokens_per_image=4)).eval()
    perturb_gemma3_norms(hf)
    hf.save_pretrained(tmp_path)
    config, weights = load_weights(resolve_model(str(tmp_path)))
    assert config.architecture == "gemma3" and config.sliding_layers == (0, 1, 3)
    assert not any("vision" in name or "projector" in name for name in weights)
    assert_hf_logits(LlamaForCausalLM(config, weights, Precision.uniform(torch.float32), "cpu"), hf, prompt())


def test_tensor_parallel_ranks_split_gemma3s_heads_and_keep_its_norms(gemma3_dir):
    path, _ = gemma3_dir
    config, weights = load_weights(resolve_model(str(path)))
    local, w, _ = shard_model(config, weights, {}, Shard(1, 2))
    assert (local.num_heads, local.num_kv_heads, local.layer_windows) == (2, 1, config.layer_windows)
    for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm", "self_attn.q_norm"):
        key = f"model.layers.3.{name}.weight"
        assert torch.equal(w[key], weights[key])


@pytest.mark.parametrize("field, value, message", [
    ("final_logit_softcapping", 30.0, "final_logit_softcapping=30.0: tandem runs Gemma 3 without softcapping"),
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping=50.0: tandem runs Gemma 3 without softcapping"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention=true"),
    ("hidden_activation", "relu", "hidden_activation='relu'"),
])
def test_gemma3_variants_tandem_does_not_run_are_refused_by_field(gemma3_dir, tmp_path, field, value, message):
    path, _ = gemma3_dir
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_weights(resolve_model(str(tmp_path)))
