"""tandem's own CPU operators (kernels/csrc/*.cpp), built into one library by torch's extension
builder on first use and cached under $TORCH_EXTENSIONS_DIR (about a minute with two cores; the
set-up script builds it ahead). They register as `torch.ops.tandem.*`:

- `block_gemm`: projections over GGUF-style int8 blocks (block_linear.py);
- `block_gemm_q4`: the same over 4-bit blocks, two to a byte, as GGUF's Q4_0 and Q4_1 keep them;
- `block_gemm_q8`: the same over int8 blocks with float16 scales, as GGUF's Q8_0 keeps them;
- `block_gemm_bf16`, `block_gemm_q4_bf16`, `block_gemm_q8_bf16`: those three multiplied in bfloat16;
- `isa_probe`: one instruction of a CPU feature, run in a child process (isa.py);
- `paged_decode_attention`: decode attention read in place from the paged KV cache (torch_attention.py);
- `prompt_attention_bf16`: a prompt piece's attention read in place from a float32 cache, in bfloat16;
- `rms_norm`, `add_rms_norm_`, `rope_`, `silu_mul`: a layer's steps between projections (layer_ops.py);
- `parallel_threads`: how many threads a parallel region runs on (a check for the tests);
- `idle_compute_threads`: the calling thread's compute threads to SCHED_IDLE (`--compute-priority idle`).

They split their work with at::parallel_for, which is compiled into the library from ATen's
headers: built without OpenMP it runs serially and says nothing (a two-core decode step ran its
projections on one core until that was seen), so the library is built with -fopenmp and binds
to the OpenMP runtime torch has already loaded, sharing its thread pool and torch.set_num_threads.

They are written for AVX2 + FMA + F16C (the bfloat16 block products' and prompt_attention_bf16's
functions for AVX512-BF16, checked when they run; block_gemm_q4's, block_gemm_q8's and
paged_decode_attention's AVX-512 ones where the CPU has it), and built with -ffp-contract=off: the
compiler never fuses a multiply and an add the source keeps apart, so element-wise steps round as torch's do. Where they cannot run (another CPU, no
compiler, `TANDEM_CPU_KERNELS=0`), `cpu_ops_unavailable()` says why and callers keep their torch
paths.

An image builds them once (`python -m tandem.kernels.cpu_ops --install DIR`, the Dockerfile's
server-cpu) and names DIR in `TANDEM_KERNELS_DIR`: a server there loads the library built for exactly
its sources, flags and torch (`build_key()`), with no compiler in the image. Where DIR holds no such
library, the kernels are built as anywhere else.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path

from tandem.common.cpu import cpu_flags

log = logging.getLogger("tandem.kernels")

NAME = "tandem_cpu_ops"
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = sorted(_CSRC.glob("*.cpp"))
_CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off")
_LDFLAGS = ("-fopenmp",)
_REQUIRED_FLAGS = ("avx2", "fma", "f16c")
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
    if (prebuilt := prebuilt_library()) is not None:
        import torch

        if not prebuilt.exists():
            log.warning("%s holds no CPU kernels built for these sources and this torch (%s): building them",
                        prebuilt.parent, prebuilt.name)
        else:
            try:
                torch.ops.load_library(str(prebuilt))
                log.info("tandem's CPU kernels: %s, built with the image", prebuilt)
                return None
            except Exception as e:  # a library that cannot load here (a missing symbol or library)
                log.warning("tandem's CPU kernels in %s do not load (%s): building them", prebuilt, e)
    try:
        _build()
    except Exception as e:  # no compiler, no ninja: serve with the torch paths
        log.warning("tandem's CPU kernels are unavailable, using torch's: %s", e)
        return f"they did not build: {type(e).__name__}: {str(e)[:200]}"
    return None


def _build(build_directory: Path | None = None) -> None:
    """Build (or find in torch's extension cache) and load the library; with `build_directory`, build
    it there, afresh."""
    from torch.utils.cpp_extension import load

    # Lists of their own: torch's builder appends to the flags it is given.
    load(NAME, [str(s) for s in _SOURCES], extra_cflags=list(_CFLAGS), extra_ldflags=list(_LDFLAGS),
         is_python_module=False, build_directory=str(build_directory) if build_directory else None)


def build_key() -> str:
    """What a built library depends on: every file of csrc/ (sources and headers), the compiler and
    linker flags, and torch's version (whose headers and C++ ABI it is built against)."""
    import torch

    digest = hashlib.sha256(f"{torch.__version__}\0{_CFLAGS}\0{_LDFLAGS}".encode())
    for path in sorted(p for p in _CSRC.iterdir() if p.suffix in (".cpp", ".h")):
        digest.update(f"\0{path.name}\0".encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def prebuilt_library() -> Path | None:
    """The library an image built for these sources, under TANDEM_KERNELS_DIR; None where it is unset."""
    folder = os.environ.get("TANDEM_KERNELS_DIR")
    return Path(folder) / f"{NAME}-{build_key()}.so" if folder else None


def install(folder: Path) -> Path:
    """Build the library afresh and put it in `folder` under its build key, for `TANDEM_KERNELS_DIR`.
    Builds on any x86-64 machine: what the CPU can run is checked where the library is loaded."""
    with tempfile.TemporaryDirectory() as build:
        _build(Path(build))
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / f"{NAME}-{build_key()}.so"
        shutil.copyfile(Path(build) / f"{NAME}.so", target)
    return target


def idle_compute_threads() -> int:
    """Move the calling thread and the OpenMP workers of its parallel regions (the threads that
    run its torch CPU work) to Linux's SCHED_IDLE policy: they compute only in the time no other
    process's thread wants a core. Returns how many threads that is. RuntimeError where tandem's
    CPU kernels cannot run, or where the kernel refuses."""
    if (why := cpu_ops_unavailable()) is not None:
        raise RuntimeError(f"tandem's CPU kernels are unavailable here: {why}")
    import torch

    return torch.ops.tandem.idle_compute_threads()


if __name__ == "__main__":  # the set-up script and the image: build now, not in the first server that starts
    parser = argparse.ArgumentParser(prog="python -m tandem.kernels.cpu_ops", description=__doc__.split("\n\n")[0])
    parser.add_argument("--install", type=Path, metavar="DIR", help="build into DIR, for TANDEM_KERNELS_DIR=DIR")
    args = parser.parse_args()
    if args.install:
        print("tandem CPU kernels:", install(args.install))
    else:
        print("tandem CPU kernels:", cpu_ops_unavailable() or "ready")
