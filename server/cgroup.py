"""What this process may use of the machine: memory and CPUs, as its cgroup limits them.

In a container, /proc/meminfo and the CPU count describe the node, not the container: a pod limited
to 4 GiB on a 256 GiB node would size its KV pool from ~200 GiB and be OOM-killed under load, and a
pod limited to 2 CPUs would run a thread per core of the node. The limits that hold are the cgroup's:

    cgroup v2   memory.max, memory.current, memory.stat (inactive_file), cpu.max
    cgroup v1   memory.limit_in_bytes, memory.usage_in_bytes, memory.stat (total_inactive_file),
                cpu.cfs_quota_us, cpu.cfs_period_us

read from this process's cgroup (/proc/self/cgroup) where the hierarchy is mounted
(/proc/self/mountinfo), and from every ancestor visible there: the one that leaves the least room
holds (a pod's limit may sit on the pod's cgroup above the container's, and be shared). Memory in
use is the working set, as the kubelet counts it: usage less the inactive page cache, which the
kernel reclaims before it kills.

Everything here reads files under `root` ("/" in production; a folder laid out the same way in the
tests).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

# cgroup v1 writes "no limit" as the largest page-aligned int64 (2**63 - 4096); no machine has 2**62 bytes.
_V1_UNLIMITED = 2**62


@dataclass(frozen=True)
class CgroupLimits:
    """The limits that hold for this process; None where its cgroups set none (or none is readable)."""

    version: int | None = None  # 1 or 2; None where no cgroup hierarchy with a controller we read is mounted
    memory_limit: int | None = None  # bytes
    memory_in_use: int | None = None  # bytes: the working set of the cgroup whose limit leaves the least room
    cpu_quota: float | None = None  # CPUs' worth of time per period (2.5: two and a half CPUs)

    @property
    def memory_available(self) -> int | None:
        """Bytes the limit still leaves: the limit less the working set."""
        if self.memory_limit is None:
            return None
        return max(0, self.memory_limit - (self.memory_in_use or 0))

    @property
    def cpus(self) -> int | None:
        """Whole CPUs the quota allows, at least 1: a thread per CPU of time. (Rounded down: with 1.5
        CPUs, two threads would be throttled in turn and each parallel region wait for the slower.)"""
        return None if self.cpu_quota is None else max(1, math.floor(self.cpu_quota + 1e-9))


def read_limits(root: Path = Path("/")) -> CgroupLimits:
    """This process's cgroup limits (`root`: where /proc and /sys are found)."""
    memberships = _memberships(root / "proc/self/cgroup")
    mounts = _mounts(root / "proc/self/mountinfo")
    memory = _folders(root, memberships, mounts, "memory")
    cpu = _folders(root, memberships, mounts, "cpu")
    version = next((v for v, folders in (memory, cpu) if folders), None)
    limit, in_use = _memory(memory)
    return CgroupLimits(version, limit, in_use, _cpu_quota(cpu))


def _memberships(path: Path) -> dict[str, str]:
    """Controller -> this process's cgroup path; "" is cgroup v2's unified hierarchy."""
    found = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, cgroup = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            found[controller] = cgroup
    return found


@dataclass(frozen=True)
class _Mount:
    root: str  # the cgroup path mounted there
    point: str
    version: int
    controllers: frozenset[str]


def _mounts(path: Path) -> list[_Mount]:
    mounts = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return mounts
    for line in lines:
        fields, _, rest = line.partition(" - ")
        fields, rest = fields.split(), rest.split()
        if len(fields) < 5 or not rest or rest[0] not in ("cgroup", "cgroup2"):
            continue
        options = set(rest[2].split(",")) if len(rest) > 2 else set()
        version = 2 if rest[0] == "cgroup2" else 1
        mounts.append(_Mount(_unescape(fields[3]), _unescape(fields[4]), version, frozenset(options)))
    return mounts


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def _folders(root: Path, memberships: dict[str, str], mounts: list[_Mount], controller: str) -> tuple[int, list[Path]]:
    """(version, folders): this process's cgroup folders for `controller`, its own first, then each
    ancestor the mount shows. A v1 hierarchy of the controller wins over v2's (in the hybrid layout the
    controller is attached to v1 alone); (0, []) where neither is mounted."""
    for mount in sorted(mounts, key=lambda m: m.version):
        cgroup = memberships.get(controller if mount.version == 1 else "")
        if cgroup is None or (mount.version == 1 and controller not in mount.controllers):
            continue
        # The mount shows the hierarchy from mount.root down. This process's cgroup lies below it, or is
        # it (a container: its own cgroup, mounted as the root).
        relative = os.path.relpath(cgroup, mount.root)
        base = root / mount.point.lstrip("/")
        here = base if relative.startswith("..") else base / relative
        folders = [here]
        while folders[-1] != base:
            folders.append(folders[-1].parent)
        return mount.version, folders
    return 0, []


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _stat(path: Path, key: str) -> int:
    text = _read(path) or ""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


def _memory(found: tuple[int, list[Path]]) -> tuple[int | None, int | None]:
    """(limit, working set) of the folder whose limit leaves the least room: a parent's looser limit
    can leave less than the process's own when its other members use it."""
    version, folders = found
    files = {2: ("memory.max", "memory.current", "inactive_file"),
             1: ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")}.get(version)
    if files is None:
        return None, None
    limit_file, usage_file, inactive = files
    tightest: tuple[int, int] | None = None  # (limit, working set)
    for folder in folders:
        raw = _read(folder / limit_file)
        if raw is None or not raw.isdigit() or int(raw) >= _V1_UNLIMITED:  # "max", unreadable or no limit
            continue
        working_set = max(0, int(_read(folder / usage_file) or 0) - _stat(folder / "memory.stat", inactive))
        if tightest is None or int(raw) - working_set < tightest[0] - tightest[1]:
            tightest = (int(raw), working_set)
    return tightest if tightest is not None else (None, None)


def _cpu_quota(found: tuple[int, list[Path]]) -> float | None:
    """The smallest CPU quota among the folders, in CPUs."""
    version, folders = found
    quotas = []
    for folder in folders:
        if version == 2:
            quota, _, period = (_read(folder / "cpu.max") or "max").partition(" ")
        else:
            quota, period = _read(folder / "cpu.cfs_quota_us") or "-1", _read(folder / "cpu.cfs_period_us") or ""
        if quota not in ("max", "-1") and quota.isdigit() and period.isdigit() and int(period) > 0:
            quotas.append(int(quota) / int(period))
    return min(quotas) if quotas else None


def host_memory_available(root: Path = Path("/")) -> int:
    """MemAvailable of /proc/meminfo, in bytes."""
    with open(root / "proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def memory_budget(limits: CgroupLimits, host_available: int) -> tuple[int, str]:
    """Bytes this process may still allocate, and where that figure comes from: the host's
    MemAvailable, or what the cgroup's memory limit leaves where that is less."""
    left = limits.memory_available
    if left is None:
        return host_available, f"{gib(host_available)} available on the host (no cgroup memory limit)"
    if left >= host_available:
        return host_available, (f"{gib(host_available)} available on the host (cgroup v{limits.version} "
                                f"memory limit {gib(limits.memory_limit)} leaves more)")
    return left, (f"cgroup v{limits.version} memory limit {gib(limits.memory_limit)}, "
                  f"{gib(limits.memory_in_use or 0)} in use: {gib(left)} available (the host has {gib(host_available)})")


def cpu_budget(limits: CgroupLimits, cores: int) -> tuple[int, str]:
    """Whole CPUs this process may compute on, of the `cores` it may be scheduled on: fewer where the
    cgroup's CPU quota allows less time; and where that figure comes from."""
    if limits.cpus is None or limits.cpus >= cores:
        return cores, f"{cores} CPUs this process may run on" + ("" if limits.cpus is None else (
            f" (cgroup v{limits.version} CPU quota {limits.cpu_quota:g} allows as many)"))
    return limits.cpus, f"cgroup v{limits.version} CPU quota {limits.cpu_quota:g} of the {cores} CPUs this process may run on"


def memory_available() -> tuple[int, str]:
    """`memory_budget` of this process, now."""
    return memory_budget(read_limits(), host_memory_available())


def usable_cpus() -> tuple[int, str]:
    """`cpu_budget` of this process: its cgroup's quota, and the CPUs its affinity allows."""
    return cpu_budget(read_limits(), len(os.sched_getaffinity(0)))
