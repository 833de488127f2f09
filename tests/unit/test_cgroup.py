"""What a server may use of the machine, read from its cgroup (server/cgroup.py) over folders laid out as
/proc and /sys are: cgroup v1 (Docker on a v1 host), v2 (a pod with its own cgroup namespace), a limit
on an ancestor, none at all; and the budgets and threads that follow."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.server import cgroup
from tandem.server.cgroup import CgroupLimits, cpu_budget, memory_budget, read_limits
from tandem.server.parallel import group

GiB = 2**30
DOCKER = "/docker/0123abcd"


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def v1(root: Path, limit: int, usage: int, inactive: int, quota: int, period: int = 100000) -> Path:
    """A container on a cgroup v1 host: each controller's hierarchy mounted at its own cgroup."""
    return write(root, {
        "proc/self/cgroup": f"12:memory:{DOCKER}\n4:cpu,cpuacct:{DOCKER}\n1:name=systemd:{DOCKER}\n0::{DOCKER}\n",
        "proc/self/mountinfo": (
            f"79 78 0:46 / /sys/fs/cgroup rw,nosuid - tmpfs tmpfs rw,mode=755\n"
            f"80 79 0:29 {DOCKER} /sys/fs/cgroup/cpu,cpuacct ro,nosuid - cgroup cgroup rw,cpu,cpuacct\n"
            f"83 79 0:32 {DOCKER} /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory\n"),
        "sys/fs/cgroup/memory/memory.limit_in_bytes": f"{limit}\n",
        "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{usage}\n",
        "sys/fs/cgroup/memory/memory.stat": f"cache 5\ninactive_file 1\ntotal_inactive_file {inactive}\n",
        "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": f"{quota}\n",
        "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": f"{period}\n",
        "proc/meminfo": "MemTotal: 263000000 kB\nMemAvailable: 209715200 kB\n",
    })


def v2(root: Path, cgroup_path: str, files: dict[str, str]) -> Path:
    """cgroup v2 mounted at /sys/fs/cgroup from the hierarchy's root (a host, or a node's view)."""
    return write(root, {
        "proc/self/cgroup": f"0::{cgroup_path}\n",
        "proc/self/mountinfo": "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n",
        **{f"sys/fs/cgroup{name}": text for name, text in files.items()},
    })


def test_cgroup_v1_container(tmp_path):
    root = v1(tmp_path, limit=4 * GiB, usage=GiB + 300, inactive=300, quota=150000)
    assert read_limits(root) == CgroupLimits(version=1, memory_limit=4 * GiB, memory_in_use=GiB, cpu_quota=1.5)
    limits = read_limits(root)
    assert limits.memory_available == 3 * GiB and limits.cpus == 1  # a thread per whole CPU of time


def test_hybrid_layout_reads_the_v1_controllers(tmp_path):
    """systemd's hybrid layout: the controllers on v1, an empty v2 hierarchy beside them (mounted first,
    at /sys/fs/cgroup/unified, and holding a memory.max of its own that is not the process's limit)."""
    root = v1(tmp_path, limit=2 * GiB, usage=GiB, inactive=0, quota=200000)
    mountinfo = root / "proc/self/mountinfo"
    mountinfo.write_text("78 77 0:45 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw,nsdelegate\n" + mountinfo.read_text())
    write(root, {"sys/fs/cgroup/unified/memory.max": f"{GiB // 2}\n", "sys/fs/cgroup/unified/cpu.max": "50000 100000\n"})
    assert read_limits(root) == CgroupLimits(version=1, memory_limit=2 * GiB, memory_in_use=GiB, cpu_quota=2.0)


def test_a_cgroup_outside_the_mounted_hierarchy_reads_the_mount_itself(tmp_path):
    """Docker on cgroup v1 without a cgroup namespace mounts the container's own cgroup, while a process
    may report a path the mount does not show: the mount's own folder is read."""
    root = v1(tmp_path, limit=GiB, usage=0, inactive=0, quota=-1)
    (root / "proc/self/cgroup").write_text("12:memory:/elsewhere/other\n4:cpu,cpuacct:/elsewhere/other\n")
    assert read_limits(root).memory_limit == GiB


def test_cgroup_v1_without_limits(tmp_path):
    root = v1(tmp_path, limit=9223372036854771712, usage=GiB, inactive=0, quota=-1)
    limits = read_limits(root)
    assert (limits.version, limits.memory_limit, limits.cpu_quota, limits.memory_available, limits.cpus) == (
        1, None, None, None, None)


def test_a_shared_parent_with_less_room_holds(tmp_path):
    """The container's own 3 GiB with 0.5 GiB used, under a parent's 4 GiB of which its other members
    use 3.9: 0.1 GiB is what is left, not 2.5."""
    parent, ctr = "/system.slice", "/system.slice/server"
    root = v2(tmp_path, ctr, {
        f"{parent}/memory.max": f"{4 * GiB}\n", f"{parent}/memory.current": f"{39 * GiB // 10}\n",
        f"{ctr}/memory.max": f"{3 * GiB}\n", f"{ctr}/memory.current": f"{GiB // 2}\n",
    })
    limits = read_limits(root)
    assert (limits.memory_limit, limits.memory_available) == (4 * GiB, 4 * GiB - 39 * GiB // 10)


def test_cgroup_v2_the_tightest_limit_of_the_ancestors_holds(tmp_path):
    """A pod's limit on its pod cgroup, a looser one on the container's: the pod's holds, with the pod's
    working set; the CPU quota comes from wherever it is smallest."""
    pod, ctr = "/kubepods/burstable/pod7", "/kubepods/burstable/pod7/ctr1"
    root = v2(tmp_path, ctr, {
        f"{pod}/memory.max": f"{2 * GiB}\n", f"{pod}/memory.current": f"{GiB}\n",
        f"{pod}/memory.stat": f"anon 5\ninactive_file {GiB // 4}\n", f"{pod}/cpu.max": "max 100000\n",
        f"{ctr}/memory.max": "max\n", f"{ctr}/memory.current": "1000\n", f"{ctr}/cpu.max": "50000 100000\n",
    })
    assert read_limits(root) == CgroupLimits(version=2, memory_limit=2 * GiB, memory_in_use=3 * GiB // 4, cpu_quota=0.5)
    assert read_limits(root).cpus == 1


def test_cgroup_v2_in_its_own_namespace(tmp_path):
    root = v2(tmp_path, "/", {"/memory.max": f"{GiB}\n", "/memory.current": f"{GiB // 2}\n", "/cpu.max": "200000 100000\n"})
    assert read_limits(root) == CgroupLimits(version=2, memory_limit=GiB, memory_in_use=GiB // 2, cpu_quota=2.0)


def test_no_cgroup_hierarchy(tmp_path):
    root = write(tmp_path, {"proc/self/cgroup": "", "proc/self/mountinfo": "22 1 8:1 / / rw - ext4 /dev/sda rw\n"})
    assert read_limits(root) == CgroupLimits()
    assert read_limits(tmp_path / "nowhere") == CgroupLimits()


def test_budgets_say_where_they_come_from():
    limited = CgroupLimits(version=1, memory_limit=4 * GiB, memory_in_use=GiB, cpu_quota=1.0)
    assert memory_budget(limited, 200 * GiB) == (3 * GiB, "cgroup v1 memory limit 4.00 GiB, 1.00 GiB in use: "
                                                          "3.00 GiB available (the host has 200.00 GiB)")
    assert memory_budget(limited, 2 * GiB)[0] == 2 * GiB  # the host has less than the limit leaves
    assert memory_budget(CgroupLimits(), 5 * GiB) == (5 * GiB, "5.00 GiB available on the host (no cgroup memory limit)")
    assert cpu_budget(limited, 16) == (1, "cgroup v1 CPU quota 1 of the 16 CPUs this process may run on")
    assert cpu_budget(CgroupLimits(version=2, cpu_quota=32.0), 16)[0] == 16
    assert cpu_budget(CgroupLimits(), 8) == (8, "8 CPUs this process may run on")


@pytest.mark.parametrize("cpus, num_threads, size, default, expected", [
    (1, None, 1, 8, 1),    # a container's CPU limit under torch's default
    (16, None, 1, 8, 8),   # torch's default (physical cores) where more CPUs are allowed
    (4, None, 2, 8, 2),    # tensor-parallel ranks share what is allowed
    (1, None, 2, 8, 1),
    (1, 6, 1, 8, 6),       # --num-threads wins
])
def test_threads_follow_the_cpus_a_server_may_use(monkeypatch, cpus, num_threads, size, default, expected):
    monkeypatch.setattr(group, "usable_cpus", lambda: (cpus, "test"))
    assert group.threads_per_rank(num_threads, size, default)[0] == expected


def test_the_live_process_reads_without_error():
    limits = read_limits()
    assert limits.version in (None, 1, 2)
    assert cgroup.memory_available()[0] > 0 and cgroup.usable_cpus()[0] >= 1
