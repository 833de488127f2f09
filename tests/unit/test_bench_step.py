"""`tandem bench step` runs end to end on the built-in model (tiny sizes) and reports both forms."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from tandem.kernels.cpu_ops import cpu_ops_unavailable
from tandem.tools.bench_step import PAGE_SIZE, decode_batch


def bench_step(*flags: str) -> subprocess.CompletedProcess:
    """`tandem bench step` with these flags (one timed step of tiny sizes)."""
    return subprocess.run([sys.executable, "-m", "tandem.cli.main", "bench", "step", "--steps", "1", *flags],
                          capture_output=True, text=True, timeout=300)


def last_line(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_decode_batch_puts_each_sequence_on_its_own_pages():
    batch = decode_batch(rows=3, context=40, num_pages=64, rng=random.Random(1))
    pages = [p for table in batch.page_tables for p in table]
    assert len(pages) == len(set(pages)) == 3 * 3  # 41 tokens on pages of 16
    assert batch.kv_lens == [41] * 3 and batch.q_lens == [1] * 3
    assert batch.out_slots.tolist() == [t[2] * PAGE_SIZE + 8 for t in batch.page_tables]  # position 40


def test_bench_step_reports_native_and_torch_steps():
    proc = bench_step("--rows", "2", "--context", "20", "--kv-tokens", "1024")
    if (why := cpu_ops_unavailable()) is not None:
        assert proc.returncode != 0 and why in proc.stderr, proc.stderr
        return
    line = last_line(proc)
    assert line["rows"] == 2 and line["native_ms"] > 0 and line["torch_ms"] > 0
    assert line["native_vs_torch"] == pytest.approx(line["native_ms"] / line["torch_ms"], rel=0.02)


def test_bench_step_compares_kv_pages():
    line = last_line(bench_step("--compare", "kv-pages", "--rows", "1", "--context", "20", "--kv-tokens", "8192"))
    assert line["compare"] == "kv-pages" and line["huge_pages_ms"] > 0 and line["4k_pages_ms"] > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bench_step_compares_decode_attention(dtype):
    proc = bench_step("--compare", "decode-attention", "--dtype", dtype, "--rows", "2", "--context", "20",
                      "--kv-tokens", "1024")
    if (why := cpu_ops_unavailable()) is not None:
        assert proc.returncode != 0 and why in proc.stderr, proc.stderr
        return
    line = last_line(proc)
    assert line["compare"] == "decode-attention" and line["in_place_ms"] > 0 and line["gathered_ms"] > 0
    # bfloat16 stays bfloat16 where the CPU multiplies it natively, else it computes in float32
    assert line["dtype"] in ({dtype, "float32"} if dtype == "bfloat16" else {"float32"})


def test_bench_step_compares_fused_layers_with_op_by_op():
    line = last_line(bench_step("--compare", "fused-layer", "--rows", "1", "--context", "20", "--kv-tokens", "1024"))
    assert line["compare"] == "fused-layer" and line["fused_ms"] > 0 and line["op_by_op_ms"] > 0


def test_bench_step_compares_the_fused_stack_with_a_call_per_layer():
    line = last_line(bench_step("--compare", "fused-stack", "--dtype", "float32", "--rows", "1", "--context", "20",
                                "--kv-tokens", "1024"))
    assert line["compare"] == "fused-stack" and line["stack_ms"] > 0 and line["layers_ms"] > 0
    assert line["stack_vs_layers"] > 0


def test_bench_step_compares_stripes_with_nibbles():
    line = last_line(bench_step("--compare", "stripes", "--dtype", "auto", "--rows", "2", "--context", "20",
                                "--kv-tokens", "1024"))
    assert line["compare"] == "stripes" and line["stripes_ms"] > 0 and line["nibbles_ms"] > 0


def test_bench_step_compares_weight_prefetch_with_none():
    line = last_line(bench_step("--compare", "weight-prefetch", "--rows", "1", "--context", "20", "--kv-tokens", "1024"))
    assert line["compare"] == "weight-prefetch" and line["prefetch_ms"] > 0 and line["none_ms"] > 0


def test_bench_step_compares_prompt_attention_where_prompts_run_in_bfloat16():
    from tandem.kernels.isa import runnable_flags
    from tandem.server.model.precision import _native_bf16_flags

    proc = bench_step("--compare", "prompt-attention", "--rows", "2", "--context", "40", "--kv-tokens", "1024")
    if not _native_bf16_flags(runnable_flags()):  # auto keeps float32 prompts there: nothing to compare
        assert proc.returncode != 0 and "needs a float32 model with bfloat16 prompt products" in proc.stderr
        return
    line = last_line(proc)
    assert line["compare"] == "prompt-attention" and line["rows"] == 2 and line["context"] == 40
    assert line["bfloat16_ms"] > 0 and line["float32_ms"] > 0
