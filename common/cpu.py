"""What the CPU can do, as the kernel and dtype choices need to know it.

`TANDEM_CPU_ISA=avx2` caps it: tandem then sees and uses what an AVX2-only CPU offers (no AVX-512,
no AMX, no AVX-VNNI), in its own choices and kernels (`cpu_flags`; csrc/isa_cap.h) and, through
`apply_isa_cap`, in torch's, oneDNN's and MKL's. It is for measuring, on a larger CPU, what tandem does on
the AVX2-only machines it also serves (a Zen 3, say) where none is at hand; the memory system and
clocks stay the larger machine's.
"""

from __future__ import annotations

import os

CPUINFO = "/proc/cpuinfo"
ISA_CAP_VARIABLE = "TANDEM_CPU_ISA"
ISA_CAPS = ("avx2",)
# Families an AVX2-only CPU lacks: every AVX-512 and AMX flag, and the later VEX-encoded extensions.
_ABOVE_AVX2 = ("avx512", "amx", "avx_vnni", "avx_ifma", "avx_ne_convert", "avx10")


def isa_cap() -> str | None:
    """The instruction set `TANDEM_CPU_ISA` caps tandem at (avx2), or None where it is unset.
    Raises ValueError for any other value."""
    value = os.environ.get(ISA_CAP_VARIABLE, "")
    if not value:
        return None
    if value.lower() not in ISA_CAPS:
        raise ValueError(f"{ISA_CAP_VARIABLE}={value!r} is invalid: choose {', '.join(ISA_CAPS)}, or leave it unset")
    return value.lower()


def cap_flags(flags: list[str], cap: str | None) -> list[str]:
    """`flags` as a CPU capped at `cap` would list them (None: all of them)."""
    if cap is None:
        return list(flags)
    return [flag for flag in flags if not flag.startswith(_ABOVE_AVX2)]


def cpu_flags() -> list[str]:
    """This CPU's feature flags (/proc/cpuinfo), empty where unreadable; without those above AVX2
    where `TANDEM_CPU_ISA=avx2`."""
    try:
        with open(CPUINFO) as f:
            listed = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        listed = []
    return cap_flags(listed, isa_cap())


# The variables that hold torch's own kernels, oneDNN's and MKL's within each cap.
LIBRARY_CAPS = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}}


def apply_isa_cap() -> str | None:
    """Where `TANDEM_CPU_ISA` caps the instruction set, keep torch's own kernels, oneDNN's and MKL's
    within it too (`LIBRARY_CAPS`; a value already set is left alone), for this process and those
    it starts. Call before torch computes anything. Returns the cap."""
    cap = isa_cap()
    for name, value in LIBRARY_CAPS.get(cap, {}).items():
        os.environ.setdefault(name, value)
    return cap
