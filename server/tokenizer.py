"""Tokenizers: from a HF directory, or built from a GGUF file's own vocabulary and chat template.

Converting a GGUF vocabulary takes transformers ~15 s, so the result is saved once under the cache
directory (keyed by the file's name, size and mtime) and reloaded from there in well under a second.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from tandem.server import env
from tandem.server.model.loader import ModelSource


def _offline() -> None:
    # Nothing is ever fetched: tokenizers come from local files only.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def tokenizer_dir(source: ModelSource) -> Path:
    """A directory AutoTokenizer can load for `source` (created on first use for GGUF files)."""
    if source.kind == "hf":
        return source.path
    stat = source.path.stat()
    target = env.cache_dir() / "tokenizers" / f"{source.path.stem}-{stat.st_size}-{int(stat.st_mtime)}"
    if (target / "tokenizer.json").is_file():
        return target
    _offline()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    tok.save_pretrained(str(tmp))
    try:
        tmp.rename(target)
    except OSError:  # another process won the race; its copy is as good as ours
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_tokenizer(source: ModelSource):
    _offline()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir(source)))


def export_tokenizer(source: ModelSource, dest: Path) -> Path:
    """Write the tokenizer files (tokenizer.json, its config, the chat template) into `dest`."""
    tok = load_tokenizer(source)
    dest.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(dest))
    return dest


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without emitting broken UTF-8: a delta is
    released only once the bytes decode cleanly (no trailing replacement character)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.text = ""  # everything released so far
        self._ids: list[int] = []

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        full = self.tokenizer.decode(self._ids, skip_special_tokens=True)
        if full.endswith("\ufffd"):
            return ""
        delta = full[len(self.text) :]
        self.text = full
        return delta
