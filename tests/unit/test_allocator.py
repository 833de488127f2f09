"""`--allocator`: which malloc a server process runs on, and the one re-execution that preloads it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.server.config import ServeConfig
from tandem.server.edge.allocator import LIBRARY_DIRS, TCMALLOC, choose, describe, find_tcmalloc
from tandem.server.env import PRELOADED_ALLOCATOR as MARKER

LIB = f"/usr/lib/x86_64-linux-gnu/{TCMALLOC}"


@pytest.mark.parametrize("choice, device, library, cuda, preloaded", [
    ("auto", "cpu", LIB, False, LIB),
    ("auto", "auto", LIB, False, LIB),          # auto device without an NVIDIA device: a CPU server
    ("auto", "auto", LIB, True, None),          # ... with one: CUDA, whose tensors malloc does not hold
    ("auto", "cuda:1", LIB, True, None),
    ("auto", "cpu", None, False, None),         # not installed: the system's, said so
    ("system", "cpu", LIB, False, None),
    ("tcmalloc", "cuda", LIB, True, LIB),       # asked for: wherever
])
def test_choose(choice, device, library, cuda, preloaded):
    got, why = choose(choice, device, library, cuda)
    assert got == preloaded
    assert why.startswith("auto:" if choice == "auto" else f"--allocator {choice}")


def test_asking_for_tcmalloc_where_it_is_missing_names_the_flag_and_the_package():
    with pytest.raises(ValueError, match=r"--allocator tcmalloc: libtcmalloc_minimal\.so\.4 .*libtcmalloc-minimal4"):
        choose("tcmalloc", "cpu", None, False)


def test_auto_is_the_default():
    assert ServeConfig().allocator == "auto"


def test_find_looks_in_each_directory(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / TCMALLOC).touch()
    assert find_tcmalloc((str(tmp_path / "a"), str(tmp_path / "b"))) == str(tmp_path / "b" / TCMALLOC)
    assert find_tcmalloc((str(tmp_path / "a"),)) is None


# The re-execution itself, in a child that runs this program: preload() replaces the process with
# the same command line once, so the program runs twice and prints once, from the second run.
PROGRAM = """
import os, sys
from tandem.server.edge.allocator import mapped_tcmalloc, preload
from tandem.server.env import PRELOADED_ALLOCATOR as MARKER
print("run", os.getpid(), file=sys.stderr)
preload(sys.argv[1], "cpu")
print(mapped_tcmalloc(), os.environ.get(MARKER), os.environ.get("LD_PRELOAD"))
"""


def run(choice: str, **env: str) -> tuple[list[str], int]:
    """The program's printed words, and how many times it ran (in one process: exec keeps the pid)."""
    base = {k: v for k, v in os.environ.items() if k not in (MARKER, "LD_PRELOAD")}
    done = subprocess.run([sys.executable, "-c", PROGRAM, choice], env={**base, **env}, capture_output=True,
                          text=True, timeout=60, check=True)
    pids = [line.split()[1] for line in done.stderr.splitlines() if line.startswith("run ")]
    assert len(set(pids)) == 1, pids
    return done.stdout.split(), len(pids)


def test_a_cpu_server_re_executes_itself_once_with_tcmalloc_preloaded():
    library = find_tcmalloc()
    assert library is not None, f"{TCMALLOC} is missing: scripts/setup.sh installs libtcmalloc-minimal4"
    out, runs = run("auto")
    assert runs == 2  # one re-execution
    assert out == ["True", library, library]


def test_an_ld_preload_the_caller_set_is_kept_after_tcmalloc():
    library = find_tcmalloc()
    assert library is not None, f"{TCMALLOC} is missing: scripts/setup.sh installs libtcmalloc-minimal4"
    libm = next(str(p) for d in LIBRARY_DIRS if (p := Path(d) / "libm.so.6").exists())
    out, runs = run("auto", LD_PRELOAD=libm)
    assert runs == 2
    assert out == ["True", library, f"{library}:{libm}"]


def test_system_malloc_means_no_re_execution():
    out, runs = run("system")
    assert runs == 1
    assert out == ["False", "None", "None"]


def test_the_log_line_says_which_malloc_and_why():
    """In this process, which nothing preloaded."""
    assert describe("system", "cpu") == "the system's (--allocator system)"
    assert describe("auto", "cuda").startswith("the system's (auto: the device is not a CPU (--device cuda)")


def test_a_preload_that_did_not_take_is_not_retried(tmp_path):
    """The marker set and tcmalloc not mapped (the preload failed): no second re-execution."""
    out, runs = run("auto", **{MARKER: str(tmp_path / "missing.so")})
    assert runs == 1
    assert out[0] == "False"
