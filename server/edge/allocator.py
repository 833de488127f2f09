"""Which malloc a CPU server process runs on (`--allocator`).

torch's CPU tensors come from malloc and go back to it on every forward pass: a prompt piece's
activations are megabytes each. With glibc's malloc, its _int_malloc, malloc_consolidate and
_int_free took 2.4% of the engine thread's samples in a profile of the c8 workload, serial work the
other compute thread waits through. tcmalloc keeps freed memory in its caches (vLLM's CPU guide has
it preloaded too): `tandem bench peers`, five paired repeats, c8 throughput 1.04x glibc's (median),
one stream's TPOT 0.93x (docs/performance-log.md, "CPU servers on tcmalloc").

A malloc is chosen before the process allocates anything, so tcmalloc can only be preloaded: the
`tandem serve` command re-executes itself once, the same command line with LD_PRELOAD naming the
library, before torch is imported. TANDEM_PRELOADED_ALLOCATOR (server/env.py) keeps that to one
re-execution even where the preload fails, and tells the new process what was asked, for its log line.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tandem.server.env import preloaded_allocator, with_preload

TCMALLOC = "libtcmalloc_minimal.so.4"  # Debian's libtcmalloc-minimal4
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib")


def find_tcmalloc(dirs: tuple[str, ...] = LIBRARY_DIRS) -> str | None:
    for d in dirs:
        path = Path(d) / TCMALLOC
        if path.exists():
            return str(path)
    return None


def mapped_tcmalloc() -> bool:
    """Whether tcmalloc is loaded into this process (preloaded, it is malloc)."""
    try:
        return "libtcmalloc" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def cuda_device_present() -> bool:
    """An NVIDIA device on this machine, looked for without importing torch (which would allocate)."""
    return Path("/proc/driver/nvidia").exists() or Path("/dev/nvidia0").exists()


def choose(allocator: str, device: str, library: str | None, cuda_present: bool) -> tuple[str | None, str]:
    """(the library to preload, or None for the system's malloc; why). `library`: where tcmalloc
    is installed (None: nowhere). Raises ValueError for --allocator tcmalloc without it."""
    if allocator == "system":
        return None, "--allocator system"
    if allocator == "tcmalloc":
        if library is None:
            raise ValueError(f"--allocator tcmalloc: {TCMALLOC} is not installed in any of {', '.join(LIBRARY_DIRS)} "
                             "(Debian: apt-get install libtcmalloc-minimal4)")
        return library, "--allocator tcmalloc"
    on_cpu = device == "cpu" or (device == "auto" and not cuda_present)
    if not on_cpu:
        return None, f"auto: the device is not a CPU (--device {device}), whose tensors malloc does not hold"
    if library is None:
        return None, f"auto: {TCMALLOC} is not installed (Debian: libtcmalloc-minimal4)"
    return library, "auto: a CPU server, whose activations come from malloc on every pass"


def preload(allocator: str, device: str) -> None:
    """Re-execute this process's command line with the chosen malloc preloaded, once; returns
    where nothing is to change (the system's malloc, already preloaded, or the re-execution done)."""
    library, _ = choose(allocator, device, find_tcmalloc(), cuda_device_present())
    if library is None or preloaded_allocator() is not None or mapped_tcmalloc():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, with_preload(library))


def describe(allocator: str, device: str) -> str:
    """The log line's words: which malloc this process runs on, and why."""
    library, why = choose(allocator, device, find_tcmalloc(), cuda_device_present())
    if mapped_tcmalloc():
        return f"tcmalloc ({preloaded_allocator() or 'preloaded by the environment'}; {why})"
    if library is not None:
        return f"the system's: {library} is not preloaded ({why})"
    return f"the system's ({why})"
