"""`tandem bench peers`' report: ratios against vLLM's best figure, PD against colocated."""

from __future__ import annotations

from argparse import Namespace

from tandem.tools.bench_peers import cpu_flags, table

ARGS = Namespace(num_requests=32, concurrency=8, c1_requests=8, prompt_len=(64, 512), output_len=(64, 128),
                 workload_seed=1)
MACHINE = {"cpu_flags": ["avx2"], "cores": 2, "read_gb_s": 25.0, "weights": "float32", "decode_weight_mb": 500.0,
           "tpot_floor_ms": 20.0}


def figures(tok_s, ttft, tpot, tpot_c1):
    return {"tokens_per_s": tok_s, "ttft_p50_s": ttft, "ttft_p99_s": 2 * ttft, "tpot_p50_ms": tpot,
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
    assert "30.0 ms (0.75x)" in row and "| 1.50x |" in row  # c1 TPOT over the 20 ms floor
    vllm_row = next(line for line in text.splitlines() if line.startswith("| vLLM float32 |"))
    assert "(" not in vllm_row.split("|")[2]  # vLLM's own figures carry no ratio
    assert "1P+1D / colocated: TTFT p50 1.25x, tok/s 0.80x, TPOT (c1) 1.10x" in text
    assert "single-stream floor 20.0 ms" in text


def test_without_vllm_there_are_no_ratios():
    text = table({"tandem": figures(90.0, 0.4, 80.0, 30.0)}, MACHINE, ARGS)
    row = next(line for line in text.splitlines() if line.startswith("| tandem |"))
    assert "x)" not in row and "1P+1D" not in text


def test_cpu_flags_name_what_this_cpu_has():
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split()
    got = cpu_flags()
    assert all(flag in flags for flag in got)
    assert ("avx512_bf16" in got) == ("avx512_bf16" in flags)
