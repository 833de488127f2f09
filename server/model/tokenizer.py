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
    """A directory AutoTokenizer can load for `source` (created on first use for GGUF files). For a
    GGUF file it also holds the model's config.json, as a HF model directory does: a router takes it
    with the tokenizer (GetTokenizer), and smg, given none, looks the model's config up on the
    Hugging Face Hub under the tokenizer's path for every chat request (10 s each where the Hub's name
    does not resolve, as in a cluster without egress)."""
    if source.kind == "hf" or (source.kind == "random" and source.path.is_dir()):
        return source.path
    stat = source.path.stat()
    target = env.cache_dir() / "tokenizers" / f"{source.path.stem}-{stat.st_size}-{int(stat.st_mtime)}"
    if not (target / "tokenizer.json").is_file():
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
    if not (target / "config.json").is_file():  # also for a directory cached before it had one
        _offline()
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
        fd, tmp_name = tempfile.mkstemp(dir=target, prefix=".tmp-", suffix=".json")
        os.close(fd)
        config.to_json_file(tmp_name)
        os.replace(tmp_name, target / "config.json")
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
    """Turns a growing list of token ids into text deltas in constant work per token.

    Decodes only a short window: ids[prefix:] against ids[prefix:read] (`read` is where the text
    released so far ends, `prefix` one release earlier, so that the window starts on a token whose
    decoding is settled). A delta is released only once it decodes cleanly: no trailing replacement
    character from a UTF-8 sequence split across tokens."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.text = ""  # everything released so far
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        decode = self.tokenizer.decode
        before = decode(self._ids[self._prefix : self._read], skip_special_tokens=True)
        window = decode(self._ids[self._prefix :], skip_special_tokens=True)
        if len(window) <= len(before) or window.endswith("\ufffd"):
            return ""
        delta = window[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of the output: release whatever is still held back (a broken UTF-8 tail
        becomes a replacement character, as a full decode would show it)."""
        decode = self.tokenizer.decode
        before = decode(self._ids[self._prefix : self._read], skip_special_tokens=True)
        window = decode(self._ids[self._prefix :], skip_special_tokens=True)
        delta = window[len(before) :]
        self._prefix = self._read = len(self._ids)
        self.text += delta
        return delta
