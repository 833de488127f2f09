"""`tandem bench offline`'s breakdown of the forward passes' time (tools/bench_offline.py)."""

from __future__ import annotations

from tandem.tools.bench_offline import pass_breakdown


def test_pass_breakdown_splits_prompt_passes_from_decodes_by_batch_size():
    # (sequences, prompt pieces, tokens, seconds) per pass
    passes = [(1, 1, 300, 0.10), (3, 1, 258, 0.09), (2, 0, 2, 0.004), (8, 0, 8, 0.011), (8, 0, 8, 0.013),
              (2, 0, 2, 0.006)]
    assert pass_breakdown(passes) == {
        "prompt_passes": {"count": 2, "seconds": 0.19, "tokens": 558},
        "decode_passes": {2: {"count": 2, "ms": 5.0}, 8: {"count": 2, "ms": 12.0}},
    }
    assert pass_breakdown([]) == {"prompt_passes": {"count": 0, "seconds": 0, "tokens": 0}, "decode_passes": {}}
