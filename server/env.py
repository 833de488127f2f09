"""Every environment variable tandem reads, read here and nowhere else."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """TANDEM_CACHE_DIR: where derived artifacts (converted tokenizers) are kept."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tandem"
    return Path(os.environ.get("TANDEM_CACHE_DIR", default))


def quiet_native_logs() -> None:
    """Mooncake logs through glog from INFO up; keep its warnings and errors unless the
    environment already says otherwise. Call before importing `mooncake`."""
    os.environ.setdefault("GLOG_minloglevel", "1")


PRELOADED_ALLOCATOR = "TANDEM_PRELOADED_ALLOCATOR"


def preloaded_allocator() -> str | None:
    """TANDEM_PRELOADED_ALLOCATOR: the malloc library `tandem serve` preloaded when it re-executed
    itself (edge/allocator.py); set only in the re-executed process."""
    return os.environ.get(PRELOADED_ALLOCATOR)


def with_preload(library: str) -> dict[str, str]:
    """This process's environment with `library` first in LD_PRELOAD (what the caller preloaded
    kept after it) and TANDEM_PRELOADED_ALLOCATOR naming it: the re-execution's environment."""
    preloaded = os.environ.get("LD_PRELOAD", "")
    return {**os.environ, PRELOADED_ALLOCATOR: library, "LD_PRELOAD": f"{library}:{preloaded}" if preloaded else library}


def crash_log() -> Path | None:
    """TANDEM_CRASH_LOG: a file where `tandem serve` records each engine failure, one line each, and
    counts the earlier ones at start (`tandem_engine_crashes_total`); on Kubernetes it lies in an
    emptyDir, which outlives the container restarts a crash causes. Unset: nothing recorded."""
    path = os.environ.get("TANDEM_CRASH_LOG")
    return Path(path) if path else None
