"""GetTokenizer's archive of a model directory: the tokenizer's files and the model's config, never
its weights (a HF model directory is its tokenizer's directory: zipping it whole would stream every
weight to each router)."""

from __future__ import annotations

import io
import zipfile

from tandem.server.edge.grpc_status import tokenizer_archive


def test_the_archive_holds_the_tokenizer_and_config_but_no_weights(tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json",
                 "chat_template.jinja", "model.safetensors.index.json", "tokenizer.model"):
        (tmp_path / name).write_text("{}")
    for name in ("model-00001-of-00002.safetensors", "pytorch_model.bin", "model.gguf", ".tmp-1234.json"):
        (tmp_path / name).write_bytes(b"\0" * 64)
    (tmp_path / "subfolder").mkdir()
    names = zipfile.ZipFile(io.BytesIO(tokenizer_archive(tmp_path))).namelist()
    assert sorted(names) == ["chat_template.jinja", "config.json", "generation_config.json",
                             "model.safetensors.index.json", "tokenizer.json", "tokenizer.model", "tokenizer_config.json"]
