"""What the `gpu` tests share: models of real shapes with random weights, and their tokenizer."""

from __future__ import annotations

import os


def random_model(shape: str) -> str:
    """`--model random:<shape>`, with the tokenizer in $TANDEM_TOKENIZER_DIR where that is set
    (scripts/gpu-check.sh brings one to a GPU machine that has no built-in model), else the
    built-in model's."""
    tokenizer = os.environ.get("TANDEM_TOKENIZER_DIR")
    return f"random:{shape}:{tokenizer}" if tokenizer else f"random:{shape}"
