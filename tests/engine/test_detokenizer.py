"""Incremental detokenization equals decoding the whole output, one token at a time."""

from __future__ import annotations

import random

from tandem.server.model.tokenizer import IncrementalDetokenizer


def test_incremental_text_equals_full_decode(smollm_fp32):
    tok = smollm_fp32.tokenizer
    texts = [
        "Plain English text, with punctuation; and numbers 12345.",
        "Unicode: café, naïve, 東京タワー, emoji 🚀🔥 and math ∑∫√.",
        "def f(x):\n    return {'a': [1, 2, 3]}  # code\n\n\ttabs",
    ]
    rng = random.Random(0)
    sequences = [tok.encode(t) for t in texts] + [[rng.randrange(49152) for _ in range(200)] for _ in range(3)]
    for ids in sequences:
        detok = IncrementalDetokenizer(tok)
        pieces = [detok.push(t) for t in ids]
        full = tok.decode(ids, skip_special_tokens=True)
        assert "".join(pieces) == detok.text
        # Everything is released except, at most, an unfinished UTF-8 sequence at the very end.
        assert full.startswith(detok.text) and len(full) - len(detok.text) <= 1
    assert IncrementalDetokenizer(tok).push(2) == ""  # a special token decodes to nothing
