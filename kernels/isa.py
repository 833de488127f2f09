"""What this CPU executes, not only what it lists. /proc/cpuinfo's flags are what the CPU reports,
and a virtual machine may report features it cannot run: on a 2-core Xeon VM `amx_tile` is listed,
and llama.cpp built for it died with SIGILL in `tilezero`. tandem's choices that rest on such a
feature (the dtype `auto` picks, the bfloat16 kernels) ask `runnable_flags()`, which runs one
instruction of each probed feature in a forked child (csrc/isa_probe.cpp) and drops the listed
features whose child dies.

AMX's probe asks Linux for the tile data first (arch_prctl), as oneDNN does before it uses tiles;
a process that never asks gets SIGILL on its first tile instruction however able the CPU is.
"""

from __future__ import annotations

import faulthandler
import functools
import logging
import os
import resource
import signal
from dataclasses import dataclass, field

from tandem.common.cpu import cpu_flags
from tandem.kernels.cpu_ops import cpu_ops_unavailable

log = logging.getLogger("tandem.kernels")

PROBED = ("avx512_bf16", "amx_bf16")  # the listed features whose instructions are run before they are trusted


@dataclass(frozen=True)
class CpuFeatures:
    listed: tuple[str, ...]
    faults: dict[str, str] = field(default_factory=dict)  # listed, probed, and fatal: feature -> how it died
    unprobed: str | None = None  # why nothing was probed (the kernels cannot run); the list is trusted then

    @property
    def runnable(self) -> list[str]:
        return [flag for flag in self.listed if flag not in self.faults]

    def describe(self) -> str:
        """What was found, for the startup log."""
        probed = [flag for flag in PROBED if flag in self.listed]
        if not probed:
            return "nothing to probe"
        if self.unprobed:
            return f"{', '.join(probed)} listed, not probed ({self.unprobed})"
        runs = [flag for flag in probed if flag not in self.faults]
        parts = [f"{', '.join(runs)} run{'s' if len(runs) == 1 else ''}"] if runs else []
        parts += [f"{flag} listed but faults ({how}), so unused" for flag, how in self.faults.items()]
        return "probed: " + "; ".join(parts)


def probe(feature: str) -> str | None:
    """Run `feature`'s probe in a forked child: None if it ran, else how the child died."""
    import torch

    pid = os.fork()
    if pid == 0:  # the child: no core file, no traceback dump, no Python cleanup, only the exit status
        code = 1
        try:
            faulthandler.disable()
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            torch.ops.tandem.isa_probe(feature)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return signal.Signals(os.WTERMSIG(status)).name
    return None if os.WEXITSTATUS(status) == 0 else f"exit status {os.WEXITSTATUS(status)}"


@functools.cache
def cpu_features() -> CpuFeatures:
    listed = tuple(cpu_flags())
    if not any(flag in listed for flag in PROBED):
        return CpuFeatures(listed)
    if (why := cpu_ops_unavailable()) is not None:
        return CpuFeatures(listed, unprobed=f"tandem's CPU kernels cannot run: {why}")
    faults = {}
    for flag in PROBED:
        if flag in listed and (how := probe(flag)) is not None:
            faults[flag] = how
            log.warning("the CPU lists %s, but its instructions fault here (%s): tandem does not use it", flag, how)
    return CpuFeatures(listed, faults)


def runnable_flags() -> list[str]:
    """/proc/cpuinfo's flags less the probed features whose instructions fault here."""
    return cpu_features().runnable
