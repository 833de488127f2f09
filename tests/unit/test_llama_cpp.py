"""The llama.cpp peer's build options: the instructions this CPU runs, never AMX, never -march=native."""

from __future__ import annotations

from tandem.tools.llama_cpp import ggml_isa_options


def options(runnable: list[str]) -> dict[str, str]:
    return dict(o.removeprefix("-D").split("=") for o in ggml_isa_options(runnable))


def test_an_avx2_cpu_gets_no_avx512():
    got = options(["avx2", "fma", "f16c", "bmi2"])
    assert got["GGML_NATIVE"] == "OFF" and got["GGML_AVX2"] == "ON" and got["GGML_FMA"] == "ON"
    assert all(got[o] == "OFF" for o in ("GGML_AVX512", "GGML_AVX512_BF16", "GGML_AVX512_VNNI", "GGML_AVX512_VBMI"))


def test_avx512_extensions_follow_what_runs_and_amx_stays_off():
    got = options(["avx2", "fma", "avx512f", "avx512vbmi", "avx512_vnni", "amx_tile", "amx_bf16"])  # bf16 faulted
    assert got["GGML_AVX512"] == got["GGML_AVX512_VBMI"] == got["GGML_AVX512_VNNI"] == "ON"
    assert got["GGML_AVX512_BF16"] == "OFF"
    assert got["GGML_AMX_TILE"] == got["GGML_AMX_INT8"] == got["GGML_AMX_BF16"] == "OFF"
    assert options(["avx2", "avx512_bf16"])["GGML_AVX512_BF16"] == "OFF"  # no AVX512F, no extension
