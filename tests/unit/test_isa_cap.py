"""`TANDEM_CPU_ISA=avx2`: tandem as on an AVX2-only CPU, in its own choices (`cpu_flags`), in
torch's and oneDNN's (`apply_isa_cap`) and in its kernels (csrc/isa_cap.h, read once a process,
so checked in child processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tandem.cli.main import main
from tandem.common import cpu
from tandem.common.cpu import ISA_CAP_VARIABLE, apply_isa_cap, cap_flags, isa_cap
from tandem.kernels.cpu_ops import cpu_ops_unavailable

ZEN4 = ["fpu", "sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512_bf16",
        "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16"]
AVX2_ONLY = ["fpu", "sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"]


def test_the_cap_keeps_what_an_avx2_cpu_lists():
    assert cap_flags(ZEN4, "avx2") == AVX2_ONLY
    assert cap_flags(ZEN4, None) == ZEN4


def test_the_variable_is_read_and_a_wrong_value_is_refused_by_name(monkeypatch):
    monkeypatch.delenv(ISA_CAP_VARIABLE, raising=False)
    assert isa_cap() is None
    monkeypatch.setenv(ISA_CAP_VARIABLE, "AVX2")
    assert isa_cap() == "avx2"
    monkeypatch.setenv(ISA_CAP_VARIABLE, "avx512")
    with pytest.raises(ValueError, match="TANDEM_CPU_ISA='avx512' is invalid: choose avx2, or leave it unset"):
        isa_cap()


def test_cpu_flags_are_capped(monkeypatch, tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: " + " ".join(ZEN4) + "\n")
    monkeypatch.setattr(cpu, "CPUINFO", str(info))
    monkeypatch.delenv(ISA_CAP_VARIABLE, raising=False)
    assert cpu.cpu_flags() == ZEN4
    monkeypatch.setenv(ISA_CAP_VARIABLE, "avx2")
    assert cpu.cpu_flags() == AVX2_ONLY


def test_torch_onednn_and_mkl_are_capped_unless_told_otherwise(monkeypatch):
    names = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(ISA_CAP_VARIABLE, raising=False)
    assert apply_isa_cap() is None
    assert not any(name in os.environ for name in names)
    monkeypatch.setenv(ISA_CAP_VARIABLE, "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2_VNNI")  # the user's own choice stays
    assert apply_isa_cap() == "avx2"
    assert os.environ["ATEN_CPU_CAPABILITY"] == "avx2" and os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2_VNNI"
    assert os.environ["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"


def test_the_command_refuses_a_wrong_cap_before_anything_runs(monkeypatch, capsys):
    monkeypatch.setenv(ISA_CAP_VARIABLE, "sse")
    assert main(["bench", "peers", "--help"]) == 2
    assert "TANDEM_CPU_ISA='sse' is invalid" in capsys.readouterr().err


# Each kernel asked for its AVX-512 form explicitly (avx512=1), or one that needs AVX512-BF16, and the stripes'
# float32 product as chosen (avx512=-1), which has an AVX2 form: what ran.
KERNELS = """
import json, torch
from tandem.kernels.block_linear import Nibbles, NibbleStripes, block_gemm_q4
from tandem.kernels.cpu_ops import cpu_ops_unavailable
assert cpu_ops_unavailable() is None
torch.manual_seed(0)
q = torch.randint(0, 256, (32, 32), dtype=torch.uint8)
scale, offset = torch.rand(32, 2).half(), torch.rand(32, 2).half()
x = torch.randn(2, 64)
outcome = {}
def attempt(name, call):
    try:
        call()
        outcome[name] = "ran"
    except RuntimeError as e:
        outcome[name] = "refused: " + str(e).splitlines()[0]
attempt("block_gemm_q4", lambda: block_gemm_q4(x, Nibbles(q, scale, offset), avx512=1))
stripes = NibbleStripes.from_nibbles(Nibbles(q, scale, offset))
attempt("block_gemm_q4_stripes", lambda: torch.ops.tandem.block_gemm_q4_stripes(x, stripes.q, stripes.scale, stripes.offset, True, 1))
attempt("block_gemm_q4_stripes, bfloat16", lambda: torch.ops.tandem.block_gemm_q4_stripes(x, stripes.q, stripes.scale, stripes.offset, False))
attempt("block_gemm_q4_stripes, float32", lambda: torch.ops.tandem.block_gemm_q4_stripes(x, stripes.q, stripes.scale, stripes.offset, True))
cache = torch.randn(4, 16, 1, 64)
attempt("paged_decode_attention", lambda: torch.ops.tandem.paged_decode_attention(
    torch.randn(1, 2, 64), cache, cache, torch.tensor([[0, 1]]), torch.tensor([20]), 0.125, 0, 1))
print(json.dumps(outcome))
"""


def kernels_run(cap: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != ISA_CAP_VARIABLE}
    if cap:
        env[ISA_CAP_VARIABLE] = cap
    out = subprocess.run([sys.executable, "-c", KERNELS], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_the_kernels_keep_to_avx2_under_the_cap(monkeypatch):
    assert cpu_ops_unavailable() is None
    capped = kernels_run("avx2")
    assert capped["block_gemm_q4"].startswith("refused: ") and "AVX-512" in capped["block_gemm_q4"]
    assert capped["paged_decode_attention"].startswith("refused: ") and "AVX-512" in capped["paged_decode_attention"]
    for name in ("block_gemm_q4_stripes", "block_gemm_q4_stripes, bfloat16"):
        assert capped[name].startswith("refused: ") and "TANDEM_CPU_ISA" in capped[name]
    assert capped["block_gemm_q4_stripes, float32"] == "ran"  # its AVX2 form
    monkeypatch.delenv(ISA_CAP_VARIABLE, raising=False)  # what this CPU lists, even in a capped run of the tests
    flags = cpu.cpu_flags()
    uncapped = kernels_run(None)
    avx512 = all(flag in flags for flag in ("avx512f", "avx512bw"))
    assert (uncapped["block_gemm_q4"] == "ran") == avx512
    assert (uncapped["paged_decode_attention"] == "ran") == avx512
    assert (uncapped["block_gemm_q4_stripes"] == "ran") == avx512
    assert (uncapped["block_gemm_q4_stripes, bfloat16"] == "ran") == ("avx512_bf16" in flags)
    assert uncapped["block_gemm_q4_stripes, float32"] == "ran"
