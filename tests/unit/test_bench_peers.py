"""`tandem bench peers`' report: ratios against vLLM's best figure, PD against colocated."""

from __future__ import annotations

from argparse import Namespace

import pytest

from tandem.tools.bench_peers import cpu_flags, run, table
from tandem.tools.bench_serve import Sample, drive

ARGS = Namespace(num_requests=32, concurrency=8, c1_requests=8, prompt_len=(64, 512), output_len=(64, 128),
                 workload_seed=1, rounds=1)
MACHINE = {"cpu_flags": ["avx2"], "cores": 2, "read_gb_s": 25.0, "weights": "float32", "decode_weight_mb": 500.0,
           "tpot_floor_ms": 20.0}


def figures(tok_s, ttft, tpot, tpot_c1):
    return {"tokens_per_s": tok_s, "ttft_p50_s": ttft, "ttft_mean_s": 1.5 * ttft, "ttft_p99_s": 2 * ttft, "tpot_p50_ms": tpot,
            "tpot_c1_ms": tpot_c1, "ttft_c1_s": ttft}


def test_ratios_are_against_the_best_vllm_figure_of_each_column():
    results = {
        "vLLM bfloat16": figures(20.0, 4.0, 300.0, 40.0),  # best single stream
        "vLLM float32": figures(60.0, 0.8, 100.0, 45.0),  # best throughput, TTFT, TPOT
        "tandem": figures(90.0, 0.4, 80.0, 30.0),
        "tandem 1P+1D": figures(72.0, 0.5, 90.0, 33.0),
    }
    text = table(results, MACHINE, ARGS)
    row = next(line for line in text.splitlines() if line.startswith("| tandem |"))
    assert "90.0 (1.50x)" in row and "0.400 s (0.50x)" in row and "80.0 ms (0.80x)" in row
    assert "| 0.600 s (0.50x) |" in row  # TTFT mean against vLLM float32's 1.2 s
    assert "30.0 ms (0.75x)" in row and "| 1.50x |" in row  # c1 TPOT over the 20 ms floor
    vllm_row = next(line for line in text.splitlines() if line.startswith("| vLLM float32 |"))
    assert "(" not in vllm_row.split("|")[2]  # vLLM's own figures carry no ratio
    assert "1P+1D / colocated: TTFT p50 1.25x, tok/s 0.80x, TPOT (c1) 1.10x" in text
    assert "single-stream floor 20.0 ms" in text


def test_without_vllm_there_are_no_ratios():
    text = table({"tandem": figures(90.0, 0.4, 80.0, 30.0)}, MACHINE, ARGS)
    row = next(line for line in text.splitlines() if line.startswith("| tandem |"))
    assert "x)" not in row and "1P+1D" not in text


def test_rounds_are_pooled_and_named():
    """Every round runs, each request counts once in the figures, and the table says how many
    rounds they cover."""
    seen = []

    def run_one(prompt, n):
        seen.append(prompt[0])
        return Sample(n, 0.1 * prompt[0], 0.1 * prompt[0] + 0.01 * (n - 1))

    result = drive(run_one, [([1], 5), ([2], 5)], 2, [([3], 5)], [([4], 5)])
    assert sorted(seen) == [1, 2, 3, 4] and result["num_requests"] == 4 and result["output_tokens"] == 20
    assert result["ttft_p50_s"] == 0.2 and result["ttft_mean_s"] == 0.25 and result["tpot_p50_ms"] == 10.0
    text = table({"tandem": figures(90.0, 0.4, 80.0, 30.0)}, MACHINE, Namespace(**{**vars(ARGS), "rounds": 3}))
    assert "32 requests at concurrency 8 (3 rounds of new prompts)" in text


def test_rounds_below_one_are_refused_by_name():
    with pytest.raises(SystemExit, match=r"--rounds=0 is invalid: must be >= 1"):
        run(Namespace(**{**vars(ARGS), "rounds": 0}), [])


def test_cpu_flags_name_what_this_cpu_has():
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split()
    got = cpu_flags()
    assert all(flag in flags for flag in got)
    assert ("avx512_bf16" in got) == ("avx512_bf16" in flags)
