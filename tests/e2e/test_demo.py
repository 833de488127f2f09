"""The README's main job runs: `tandem demo` brings up prefill, decode and the router, streams
answers through it and shuts everything down (also on Ctrl-C); the offline demo; bf16 serves."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import torch

from tandem.server.config import EngineConfig
from tandem.server.scheduling.sampling_params import SamplingParams
from tandem.tools.demo import QUESTIONS
from tandem.tools.stack import http_post


def test_pd_demo_keeps_running_until_ctrl_c(tmp_path):
    # Started with SIGINT ignored, as a non-interactive shell starts a background job (`demo &`):
    # SIGINT must still stop it.
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli.main", "demo", "--max-new-tokens", "12", "--max-total-tokens", "8192",
         "--keep-running", "--log-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        lines = []
        deadline = time.monotonic() + 300
        while not any(line.startswith("Metrics:") for line in lines):  # the last line of the how-to
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, "".join(lines)
            lines.append(line)
        out = "".join(lines)
        for question in QUESTIONS:
            assert f">>> {question}" in out
        assert "Paris" in out.split(QUESTIONS[1])[0]
        assert len(re.findall(r"\[TTFT \d+ ms, \d+ tokens, [\d.]+ tokens/s\]", out)) == len(QUESTIONS)
        moved = re.search(r"([\d.]+) MB of KV moved prefill -> decode", out)
        assert moved and float(moved.group(1)) > 0
        # The printed curl command works against the stack that is still up.
        url = re.search(r"curl (http://127\.0\.0\.1:\d+)/v1/chat/completions", out).group(1)
        body = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 4}
        status, reply = http_post(url, "/v1/chat/completions", body)
        assert status == 200 and json.loads(reply)["choices"][0]["message"]["content"]
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0 and "shutting down" in rest
        assert http_post(url, "/v1/chat/completions", body, timeout=5)[0] == 0  # the router is gone
        for log in ("prefill-0.log", "decode-1.log"):
            assert "stopped" in (tmp_path / log).read_text()  # the servers drained and exited
        # Both servers on all the cores; the decode's forward passes yield them to the prefill's.
        assert "compute priority idle" in (tmp_path / "decode-1.log").read_text()
        assert "compute priority idle" not in (tmp_path / "prefill-0.log").read_text()
    finally:
        if proc.poll() is None:  # a failed assertion above must not leave the stack running
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_offline_demo_streams_answers():
    proc = subprocess.run(
        [sys.executable, "-m", "tandem.cli.main", "demo", "--offline", "--max-new-tokens", "12", "--max-total-tokens", "4096"],
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
    from tandem.server.loop.engine import Engine

    with Engine(EngineConfig(dtype="bfloat16", max_total_tokens=2048, page_size=16)) as engine:
        # bf16-rounded weights; math and KV cache in float32 unless the CPU does bf16 natively.
        assert engine.kv_cache.k[0].dtype == engine.model.precision.compute
        assert engine.model.module.embed.dtype == engine.model.precision.compute
        assert torch.equal(engine.model.module.embed, engine.model.module.embed.bfloat16().to(engine.model.precision.compute))
        outs = engine.generate(["The capital of France is", "1, 2, 3, 4,"], SamplingParams(max_new_tokens=6, temperature=0))
        assert "Paris" in outs[0].text
        assert outs[1].text.strip().startswith("5")
        engine.check_integrity()
