"""tools/moe_checkpoint.py, the benchmark's Qwen3-MoE: a directory tandem loads, in the shape asked
for, with the tokenizer beside it."""

from __future__ import annotations

from tandem.server.model.loader import load_weights, resolve_model
from tandem.server.model.tokenizer import load_tokenizer
from tandem.tools.moe_checkpoint import main


def test_writes_a_qwen3_moe_that_tandem_loads(tmp_path, capsys):
    assert main([str(tmp_path / "moe"), "--layers", "1", "--hidden", "128", "--experts", "4", "--top-k", "2"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "moe")
    source = resolve_model(str(tmp_path / "moe"))
    config, weights = load_weights(source)
    assert (config.architecture, config.num_layers, config.hidden_size) == ("qwen3_moe", 1, 128)
    assert (config.num_experts, config.experts_per_token, config.expert_intermediate_size) == (4, 2, 48)
    assert weights["model.layers.0.mlp.experts.3.down_proj.weight"].shape == (128, 48)
    assert load_tokenizer(source).vocab_size == config.vocab_size == 49152
