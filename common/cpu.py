"""What the CPU can do, as the kernel and dtype choices need to know it."""

from __future__ import annotations


def cpu_flags() -> list[str]:
    """This CPU's feature flags (/proc/cpuinfo), empty where unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
