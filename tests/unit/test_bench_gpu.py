"""`tandem bench gpu`'s own code, on a CPU (eager, torch attention, one layer): it measures every
batch size and the prefill pass, and reports them. On a GPU (scripts/gpu-check.sh) it adds CUDA
graphs, the memory floor and the matmul peak."""

from __future__ import annotations

import json
import subprocess
import sys

from tandem.server.model.random_weights import SHAPES
from tandem.tools.bench_gpu import PAGE_SIZE, decode_inputs, prefill_flops, prefill_inputs, report


def test_inputs_put_each_sequence_on_its_own_pages():
    inputs = decode_inputs(rows=3, context=40, pages=list(range(100, 0, -1)))
    assert inputs.page_tables == [[100, 99, 98], [97, 96, 95], [94, 93, 92]]
    assert inputs.slots == [98 * PAGE_SIZE + 8, 95 * PAGE_SIZE + 8, 92 * PAGE_SIZE + 8]  # position 40
    assert inputs.kv_lens == [41] * 3 and inputs.positions == [40] * 3 and inputs.num_extends == 0
    prefill = prefill_inputs(2, 20, pages=list(range(10)))
    assert prefill.q_lens == [20, 20] and prefill.page_tables == [[0, 1], [2, 3]] and len(prefill.input_ids) == 40


def test_prefill_flops_are_two_per_weight_per_token_and_attention():
    c = SHAPES["llama3-8b"]
    projections = 2 * (6.98e9 - 0) * 2048  # the 8B's layers hold 6.98B weights
    assert abs(prefill_flops(c, 1, 2048) - projections) / projections < 0.05


def test_bench_gpu_runs_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "tandem.cli.main", "bench", "gpu", "--device", "cpu", "--shapes",
                           "llama3.2-1b", "--layers", "1", "--rows", "1", "3", "--context", "20", "--steps", "1",
                           "--prefill-len", "32", "--prefill-tokens", "64", "--json-out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "| llama3.2-1b | 3 | 20 |" in proc.stdout and "| llama3.2-1b | 64 | 32 |" in proc.stdout
    report = json.loads(out.read_text())
    decode = [r for r in report["results"] if r["kind"] == "decode"]
    assert [r["rows"] for r in decode] == [1, 3] and all(r["eager_ms"] > 0 and r["graph_ms"] is None for r in decode)
    prefill = [r for r in report["results"] if r["kind"] == "prefill"]
    assert prefill[0]["tokens"] == 64 and prefill[0]["tokens_per_s"] > 0


def test_report_shows_each_projection_against_the_copy_bandwidth():
    header = dict(device="NVIDIA H200", torch="2.11", copy_tb_s=4.2, matmul_tflops=767.0)
    rows = [dict(shape="llama3-8b", kind="projection", name="o", weight=[4096, 4096], rows=1, us=22.7,
                 tb_s=1.48, of_copy=1.48 / 4.2)]
    text = report(header, rows)
    assert "| llama3-8b | o | 4096x4096 | 1 | 22.7 | 1.48 | 35% |" in text
    assert "projection" not in report(header, [])  # no table without projections
