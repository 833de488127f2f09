"""The README's main job runs: `tandem demo` streams answers and reports throughput; bf16 serves."""

from __future__ import annotations

import re
import subprocess
import sys

import torch

from tandem.server.config import EngineConfig
from tandem.server.demo import QUESTIONS
from tandem.server.sampling_params import SamplingParams


def test_demo_streams_answers():
    proc = subprocess.run(
        [sys.executable, "-m", "tandem.server.cli", "demo", "--max-new-tokens", "12", "--max-total-tokens", "4096"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    for question in QUESTIONS:
        assert f">>> {question}" in proc.stdout
    assert "Paris" in proc.stdout.split(QUESTIONS[1])[0]  # the first answer
    done = re.findall(r"\[(\d)/4 answers done, (\d+) tokens", proc.stdout)
    assert done and done[-1][0] == "4"
    summary = re.search(r"\[4 requests, (\d+) tokens in [\d.]+s: ([\d.]+) tokens/s\]", proc.stdout)
    assert summary and 4 <= int(summary.group(1)) <= 48 and float(summary.group(2)) > 0


def test_bfloat16_engine_serves():
    from tandem.server.engine import Engine

    with Engine(EngineConfig(dtype="bfloat16", max_total_tokens=2048, page_size=16)) as engine:
        # bf16-rounded weights; math and KV cache in float32 unless the CPU does bf16 natively.
        assert engine.kv_cache.k[0].dtype == engine.model.compute_dtype
        assert engine.model.module.embed.dtype == engine.model.compute_dtype
        assert torch.equal(engine.model.module.embed, engine.model.module.embed.bfloat16().to(engine.model.compute_dtype))
        outs = engine.generate(["The capital of France is", "1, 2, 3, 4,"], SamplingParams(max_new_tokens=6, temperature=0))
        assert "Paris" in outs[0].text
        assert outs[1].text.strip().startswith("5")
        engine.check_integrity()
