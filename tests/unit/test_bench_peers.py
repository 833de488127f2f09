"""`tandem bench peers`' report: ratios against the best peer's figure (vLLM's or llama.cpp's), PD
against colocated, medians and spread over repeats."""

from __future__ import annotations

import os
import subprocess
import sys
from argparse import Namespace

import pytest
import torch

from tandem.common.cpu import LIBRARY_CAPS, cap_flags, isa_cap
from tandem.tools.bench_peers import (VLLM_ABOVE_AVX2, cpu_flags, decode_weight_bytes, run, table, turns, vllm_isa_env,
                                      vllm_kernels, workloads)
from tandem.tools.bench_serve import Sample, drive

ARGS = Namespace(num_requests=32, concurrency=8, c1_requests=8, prompt_len=(64, 512), output_len=(64, 128),
                 workload_seed=1, rounds=1, repeats=1)
MACHINE = {"cpu_flags": ["avx2"], "cores": 2, "read_gb_s": 25.0, "weights": "float32", "decode_weight_mb": 500.0,
           "tpot_floor_ms": 20.0}


def figures(tok_s, ttft, tpot, tpot_c1, gflops=20.0):
    return {"tokens_per_s": tok_s, "ttft_p50_s": ttft, "ttft_mean_s": 1.5 * ttft, "ttft_p99_s": 2 * ttft, "tpot_p50_ms": tpot,
            "tpot_c1_ms": tpot_c1, "ttft_c1_s": ttft, "core_gflops": gflops, "loaded_s": round(3000 / tok_s, 2)}


def test_ratios_are_against_the_best_peer_figure_of_each_column():
    results = {
        "vLLM bfloat16": [figures(20.0, 4.0, 300.0, 40.0)],
        "vLLM float32": [figures(60.0, 0.8, 100.0, 45.0)],  # best throughput, TTFT, TPOT
        "llama.cpp": [figures(30.0, 2.0, 200.0, 35.0)],  # best single stream
        "tandem": [figures(90.0, 0.4, 80.0, 30.0)],
        "tandem 1P+1D": [figures(72.0, 0.5, 90.0, 33.0)],
    }
    text = table(results, MACHINE, ARGS)
    row = next(line for line in text.splitlines() if line.startswith("| tandem |"))
    assert "90.0 (1.50x)" in row and "0.400 s (0.50x)" in row and "80.0 ms (0.80x)" in row
    assert "| 0.600 s (0.50x) |" in row  # TTFT mean against vLLM float32's 1.2 s
    assert "30.0 ms (0.86x)" in row and "| 1.50x |" in row  # c1 TPOT against llama.cpp's; over the 20 ms floor
    for peer in ("vLLM float32", "llama.cpp"):
        peer_row = next(line for line in text.splitlines() if line.startswith(f"| {peer} |"))
        assert "(" not in peer_row.split("|")[2]  # the peers' own figures carry no ratio
    assert "1P+1D / colocated: TTFT p50 1.25x, tok/s 0.80x, TPOT (c1) 1.10x" in text
    assert "single-stream floor 20.0 ms" in text and "Spread" not in text


def test_repeats_give_medians_and_their_spread():
    runs = {"tandem": [figures(100.0, 0.4, 80.0, 30.0, 25.0), figures(80.0, 0.5, 90.0, 36.0, 20.0),
                       figures(90.0, 0.6, 85.0, 33.0, 20.0)]}
    text = table(runs, MACHINE, Namespace(**{**vars(ARGS), "repeats": 3}))
    row = next(line for line in text.splitlines() if line.startswith("| tandem |"))
    assert row.startswith("| tandem | 90.0 | 0.500 s |") and "| 33.0 ms |" in row
    assert "medians of 3 back-to-back repeats" in text
    spread = [line for line in text.splitlines() if line.startswith("| tandem |")][1]
    assert spread == "| tandem | 80-100 (22%) | 30-37.5 (7.50 s) | 0.4-0.6 (40%) | 30-36 (18%) | 20-25 (25%) |"


def test_interleaved_repeats_take_turns_and_are_paired_with_the_peers():
    """`--interleave`: repeat by repeat, every system in turn (back to back otherwise), and each
    repeat's tok/s over the best peer's in that same repeat."""
    assert turns(["vLLM", "tandem"], 2, interleave=True) == [("vLLM", 0), ("tandem", 0), ("vLLM", 1), ("tandem", 1)]
    assert turns(["vLLM", "tandem"], 2, interleave=False) == [("vLLM", 0), ("vLLM", 1), ("tandem", 0), ("tandem", 1)]
    runs = {"vLLM bfloat16": [figures(200.0, 0.4, 80.0, 30.0), figures(250.0, 0.4, 80.0, 30.0),
                              figures(100.0, 0.4, 80.0, 30.0)],
            "llama.cpp": [figures(50.0, 0.4, 80.0, 30.0), figures(300.0, 0.4, 80.0, 30.0),
                          figures(50.0, 0.4, 80.0, 30.0)],
            "tandem": [figures(300.0, 0.4, 80.0, 30.0), figures(450.0, 0.4, 80.0, 30.0),
                       figures(160.0, 0.4, 80.0, 30.0)]}
    text = table(runs, MACHINE, Namespace(**{**vars(ARGS), "repeats": 3, "interleave": True}))
    assert "medians of 3 interleaved repeats" in text
    assert "- tandem: 1.50 / 1.50 / 1.60 (median 1.50x)" in text  # against llama.cpp's 300 in repeat 1
    assert "- vLLM" not in text and "- llama.cpp" not in text
    back_to_back = table(runs, MACHINE, Namespace(**{**vars(ARGS), "repeats": 3}))
    assert "medians of 3 back-to-back repeats" in back_to_back and "same repeat" not in back_to_back


def test_without_vllm_there_are_no_ratios():
    text = table({"tandem": [figures(90.0, 0.4, 80.0, 30.0)]}, MACHINE, ARGS)
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
    text = table({"tandem": [figures(90.0, 0.4, 80.0, 30.0)]}, MACHINE, Namespace(**{**vars(ARGS), "rounds": 3}))
    assert "32 requests at concurrency 8 (3 rounds of new prompts)" in text


def test_repeats_are_the_same_work_with_new_prompts():
    """Every repeat gives each request repeat 0's prompt and output lengths (the same work, so the
    spread over repeats is the run's), with prompt tokens no earlier repeat sent (no prefix-cache
    hits); each round has its own lengths."""
    args = Namespace(**{**vars(ARGS), "rounds": 2})
    repeats = [workloads(args, repeat) for repeat in range(3)]

    def shape(work):
        return [(len(prompt), n) for prompt, n in work]

    def firsts(work):
        return {tuple(prompt[:8]) for prompt, _ in work}

    (rounds0, c1_0), *later = repeats
    assert len(rounds0) == 2 and len(rounds0[0]) == 32 and len(c1_0) == 8
    assert shape(rounds0[0]) != shape(rounds0[1])
    for rounds, c1 in later:
        assert [shape(w) for w in rounds] == [shape(w) for w in rounds0] and shape(c1) == shape(c1_0)
    for kind in range(2):
        for i, a in enumerate(repeats):
            for b in repeats[i + 1:]:
                pairs = zip(a[0], b[0]) if kind == 0 else [(a[1], b[1])]
                assert all(not firsts(x) & firsts(y) for x, y in pairs)


@pytest.mark.parametrize("name", ["rounds", "repeats"])
def test_counts_below_one_are_refused_by_name(name):
    with pytest.raises(SystemExit, match=rf"--{name}=0 is invalid: must be >= 1"):
        run(Namespace(**{**vars(ARGS), name: 0}), [])


def test_cpu_flags_name_what_this_cpu_has():
    with open("/proc/cpuinfo") as f:
        flags = cap_flags(next(line for line in f if line.startswith("flags")).split(), isa_cap())
    got = cpu_flags()
    assert all(flag in flags for flag in got)
    assert ("avx512_bf16" in got) == ("avx512_bf16" in flags)


def test_under_an_isa_cap_vllm_sees_an_avx2_only_cpu_and_the_table_says_so(tmp_path, monkeypatch):
    """TANDEM_CPU_ISA=avx2: vLLM's processes get torch's, oneDNN's and MKL's caps and a sitecustomize
    under which each of torch's "does this CPU have X above AVX2" answers False (in a child Python,
    as in vLLM's own); without the cap nothing changes. The table's first line names the cap."""
    probe = ("import sys, torch.cpu as c; print(sys.modules['sitecustomize'].__file__); print("
             + " + ".join(f"str(c.{name}())[0]" for name in VLLM_ABOVE_AVX2) + ")")
    assert vllm_isa_env(tmp_path, None) == {}
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = vllm_isa_env(tmp_path, "avx2")
    assert {k: env[k] for k in LIBRARY_CAPS["avx2"]} == LIBRARY_CAPS["avx2"]
    assert env["PYTHONPATH"] == f"{tmp_path / 'vllm-avx2'}{os.pathsep}/elsewhere"
    capped = subprocess.run([sys.executable, "-c", probe], env={**os.environ, **env}, capture_output=True, text=True)
    assert capped.returncode == 0, capped.stderr
    assert capped.stdout.split() == [str(tmp_path / "vllm-avx2" / "sitecustomize.py"), "F" * len(VLLM_ABOVE_AVX2)]
    plain = subprocess.run([sys.executable, "-c", "import torch.cpu as c; print(c._is_avx2_supported())"],
                           env={**os.environ, **env}, capture_output=True, text=True)
    assert plain.stdout.strip() == str(torch.cpu._is_avx2_supported())  # what an AVX2 CPU has stays
    text = table({"tandem": [figures(90.0, 0.4, 80.0, 30.0)]}, {**MACHINE, "isa_cap": "avx2"}, ARGS)
    assert "; capped at avx2 by TANDEM_CPU_ISA: every system as on an AVX2-only CPU;" in text.splitlines()[0]
    assert "capped" not in table({"tandem": [figures(90.0, 0.4, 80.0, 30.0)]}, MACHINE, ARGS)


def test_vllm_kernels_are_read_from_its_sessions_processes(tmp_path):
    """The kernel libraries vLLM's processes (those of its session) mapped, by instruction set;
    another session's, and other libraries, do not count."""
    def process(pid: int, session: int, maps: str) -> None:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (python3 x) S 1 {session} {session} 0 -1")
        (tmp_path / str(pid) / "maps").write_text(maps)

    lib = "7f00-7f10 r-xp 0 08:01 1 /venv/lib/python3.11/site-packages/vllm/{}\n"
    process(100, 100, lib.format("_C_AVX2.abi3.so") + lib.format("../torch/lib/libtorch_cpu.so"))
    process(101, 100, lib.format("_moe_C.abi3.so"))
    process(200, 200, lib.format("_C.abi3.so"))
    (tmp_path / "self").mkdir()
    assert vllm_kernels(100, tmp_path) == {"avx2"}
    assert vllm_kernels(200, tmp_path) == {"avx512_bf16"}
    process(102, 100, lib.format("_C_AVX512.abi3.so"))
    assert vllm_kernels(100, tmp_path) == {"avx2", "avx512"}
    assert vllm_kernels(300, tmp_path) == set()


@pytest.mark.parametrize("gguf_blocks", ["4bit", "int8"])
def test_the_floor_counts_the_weights_in_the_form_tandem_holds(gguf_blocks):
    """The built-in file's layers in 4 bits (held in stripes, the Nibbles' bytes) or widened to int8,
    its LM head as Q8_0: what a one-row step streams, named by its form."""
    from tandem.kernels.cpu_ops import cpu_ops_unavailable
    from tandem.server.config import EngineConfig
    from tandem.server.model.load import load_model

    assert cpu_ops_unavailable() is None, cpu_ops_unavailable()
    nbytes, form = decode_weight_bytes("builtin:smollm2-135m", "float32", gguf_blocks)
    assert form == {"4bit": "4-bit-block", "int8": "int8-block"}[gguf_blocks]
    module = load_model(EngineConfig(model="builtin:smollm2-135m", dtype="float32", device="cpu",
                                     gguf_blocks=gguf_blocks)).module
    projections = [getattr(layer, name) for layer in module.layers for name in ("qkv", "o", "gate_up", "down")]
    assert nbytes == sum(p.blocks.nbytes() for p in projections) + module.lm_head.blocks.nbytes()
    per_weight = sum(p.blocks.nbytes() for p in projections) / sum(p.blocks.dequantize().numel() for p in projections)
    assert per_weight == (0.625 if gguf_blocks == "4bit" else 1.25)  # with a 16- or 32-bit scale and offset a block
