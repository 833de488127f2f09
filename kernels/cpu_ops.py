"""tandem's own CPU operators (kernels/csrc/*.cpp), built into one library by torch's extension
builder on first use and cached under $TORCH_EXTENSIONS_DIR (about a minute with two cores; the
set-up script builds it ahead). They register as `torch.ops.tandem.*`:

- `block_gemm`, `block_gemm_bf16`: projections over GGUF-style int8 blocks (block_linear.py);
- `paged_decode_attention`: decode attention read in place from the paged KV cache (torch_attention.py);
- `rms_norm`, `add_rms_norm_`, `rope_`, `silu_mul`: a layer's steps between projections (layer_ops.py);
- `parallel_threads`: how many threads a parallel region runs on (a check for the tests);
- `idle_compute_threads`: the calling thread's compute threads to SCHED_IDLE (`--compute-priority idle`).

They split their work with at::parallel_for, which is compiled into the library from ATen's
headers: built without OpenMP it runs serially and says nothing (a two-core decode step ran its
projections on one core until that was seen), so the library is built with -fopenmp and binds
to the OpenMP runtime torch has already loaded, sharing its thread pool and torch.set_num_threads.

They are written for AVX2 + FMA (block_gemm_bf16's functions for AVX512-BF16, checked when it
runs), and built with -ffp-contract=off: the compiler never fuses a multiply and an add the source
keeps apart, so element-wise steps round as torch's do. Where they cannot run (another CPU, no
compiler, `TANDEM_CPU_KERNELS=0`), `cpu_ops_unavailable()` says why and callers keep their torch
paths.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from tandem.common.cpu import cpu_flags

log = logging.getLogger("tandem.kernels")

_SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))
_REQUIRED_FLAGS = ("avx2", "fma")
_lock = threading.Lock()
_why: list[str | None] = []  # filled once: None (loaded) or the reason they are unavailable


def cpu_ops_unavailable() -> str | None:
    """None when torch.ops.tandem.* can run here, else why not. Builds or loads them on first call."""
    with _lock:
        if not _why:
            _why.append(_load())
        return _why[0]


def _load() -> str | None:
    if os.environ.get("TANDEM_CPU_KERNELS", "1") == "0":
        return "TANDEM_CPU_KERNELS=0"
    missing = [f for f in _REQUIRED_FLAGS if f not in cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    try:
        from torch.utils.cpp_extension import load

        load("tandem_cpu_ops", [str(s) for s in _SOURCES], extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off"],
             extra_ldflags=["-fopenmp"], is_python_module=False)
    except Exception as e:  # no compiler, no ninja: serve with the torch paths
        log.warning("tandem's CPU kernels are unavailable, using torch's: %s", e)
        return f"they did not build: {type(e).__name__}: {str(e)[:200]}"
    return None


def idle_compute_threads() -> int:
    """Move the calling thread and the OpenMP workers of its parallel regions (the threads that
    run its torch CPU work) to Linux's SCHED_IDLE policy: they compute only in the time no other
    process's thread wants a core. Returns how many threads that is. RuntimeError where tandem's
    CPU kernels cannot run, or where the kernel refuses."""
    if (why := cpu_ops_unavailable()) is not None:
        raise RuntimeError(f"tandem's CPU kernels are unavailable here: {why}")
    import torch

    return torch.ops.tandem.idle_compute_threads()


if __name__ == "__main__":  # the set-up script: build now, not in the first server that starts
    print("tandem CPU kernels:", cpu_ops_unavailable() or "ready")
