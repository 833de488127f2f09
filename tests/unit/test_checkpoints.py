"""tools/checkpoints.py, the benchmarks' random checkpoints: directories tandem loads, in the
architecture and shape asked for, with the tokenizer beside them."""

from __future__ import annotations

import pytest

from tandem.server.model.loader import load_weights, resolve_model
from tandem.server.model.tokenizer import load_tokenizer
from tandem.tools.checkpoints import main


@pytest.mark.parametrize("kind, architecture", [("qwen3-moe", "qwen3_moe"), ("deepseek-v3", "deepseek_v3"),
                                                ("llama", "llama")])
def test_writes_a_checkpoint_that_tandem_loads(tmp_path, capsys, kind, architecture):
    assert main([kind, str(tmp_path / kind), "--layers", "2", "--hidden", "128"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / kind)
    source = resolve_model(str(tmp_path / kind))
    config, weights = load_weights(source)
    assert (config.architecture, config.num_layers, config.hidden_size, config.num_heads) == (architecture, 2, 128, 2)
    assert load_tokenizer(source).vocab_size == config.vocab_size == 49152
    if kind == "qwen3-moe":
        assert (config.num_experts, config.experts_per_token, config.expert_intermediate_size) == (64, 8, 48)
    if kind == "deepseek-v3":
        assert (config.kv_lora_rank, config.qk_rope_head_dim, config.sparse_layers) == (32, 8, (1,))
