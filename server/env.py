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
