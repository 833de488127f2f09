"""Each image on its own: it runs as the operator's non-root user; its entry point answers --help; the
operator image prints the CRD that crds/ holds; the server image loads the CPU kernels it was built
with and carries no compiler; and a change to tandem's Python code rebuilds only an image's last layer."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from support.docker import REPO, TAG
from tandem.operator import render

TARGETS = ("router", "operator", "server-cpu")
# What each entry point's --help says: smg's banner, `tandem operator`'s flags, `tandem`'s commands.
HELP = {"router": "Shepherd Model Gateway", "operator": "--router-image", "server-cpu": "serve"}


@pytest.mark.parametrize("target", TARGETS)
def test_runs_as_the_operators_non_root_user(docker, images, target):
    uid = render.SERVER_UID
    assert docker.inspect("image", images[target])["Config"]["User"] == f"{uid}:{uid}"
    assert docker("run", "--rm", "--entrypoint", "id", images[target]) == f"uid={uid}(tandem) gid={uid}(tandem) groups={uid}(tandem)"


@pytest.mark.parametrize("target", TARGETS)
def test_entry_point_answers_help(docker, images, target):
    proc = docker.run("run", "--rm", images[target], "--help", check=False)
    assert proc.returncode == 0 and HELP[target] in proc.stdout, proc.stdout + proc.stderr


def test_operator_image_prints_the_crd_of_the_repository(docker, images):
    (crd,) = (REPO / "crds").glob("*.yaml")
    assert docker.run("run", "--rm", images["operator"], "crd").stdout == crd.read_text()


def test_server_image_loads_the_kernels_it_was_built_with(docker, images):
    """Built at image build time for exactly the installed sources: no build at start, no compiler."""
    proc = docker.run("run", "--rm", "--entrypoint", "python", images["server-cpu"], "-c",
                      "import logging; logging.basicConfig(level=logging.INFO)\n"
                      "from tandem.kernels.cpu_ops import cpu_ops_unavailable; print(cpu_ops_unavailable())")
    assert proc.stdout.strip() == "None", proc.stderr
    assert "/opt/tandem/kernels/tandem_cpu_ops-" in proc.stderr and "built with the image" in proc.stderr
    compilers = docker.run("run", "--rm", "--entrypoint", "sh", images["server-cpu"], "-c", "command -v c++ g++ gcc cc",
                           check=False)
    assert compilers.stdout == "", compilers.stdout


def layers(docker, image: str) -> list[str]:
    return docker.inspect("image", image)["RootFS"]["Layers"]


def test_a_code_change_rebuilds_only_the_last_layer(docker, images, tmp_path):
    """The repository copied as it is (tracked and untracked files, torch's wheel), a line added to the
    engine and to a module of common/ that the kernels do not build from, the operator and server images
    built from the copy: every layer of each but the last is the one already built (the kernels too)."""
    copy = tmp_path / "repo"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    wheels = [str(p.relative_to(REPO)) for p in (REPO / "docker" / "wheels").glob("*.whl")]
    for name in [f for f in files if f and (REPO / f).is_file()] + wheels:
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(REPO / name, copy / name)
        except OSError:
            shutil.copy2(REPO / name, copy / name)
    for changed in ("server/loop/engine.py", "common/stats.py"):
        (copy / changed).unlink()  # a file of its own, not the repository's through the hard link
        (copy / changed).write_text((REPO / changed).read_text() + "# a change\n")
    tag, targets = f"{TAG}-changed", ("operator", "server-cpu")
    proc = subprocess.run(["bash", str(copy / "scripts" / "build-images.sh")], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "DOCKER": docker.client, "TAG": tag, "TARGETS": " ".join(targets)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    try:
        for target in targets:
            before, after = layers(docker, images[target]), layers(docker, f"tandem/{target}:{tag}")
            assert len(before) == len(after) and before[:-1] == after[:-1] and before[-1] != after[-1], target
    finally:
        for target in targets:
            docker.run("rmi", f"tandem/{target}:{tag}", check=False)


def test_server_image_resolves_every_shared_library(docker, images):
    """Every native library of the image's Python packages finds what it links, on the system or in a
    package that loads it first (tvm_ffi's for xgrammar). A missing Debian library shows otherwise only
    when a server first imports the module: Mooncake's libcurl did."""
    script = ("site=$(python -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])'); "
              "find \"$site\" -name '*.so*' -type f | while read -r f; do "
              "ldd \"$f\" 2>/dev/null | sed -n \"s|^\\s*\\(\\S*\\) => not found|\\1 $f|p\"; done; "
              "echo ---; find \"$site\" -name '*.so*' -printf '%f\\n'")
    out = docker.run("run", "--rm", "--entrypoint", "sh", images["server-cpu"], "-c", script, timeout=300).stdout
    missing, _, bundled = out.partition("---\n")
    unresolved = [line for line in missing.splitlines() if line.split()[0] not in set(bundled.split())]
    assert not unresolved, "\n".join(unresolved)


def test_the_build_script_says_why_when_no_engine_answers(docker, tmp_path):
    proc = subprocess.run(["bash", str(REPO / "scripts" / "build-images.sh")], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "DOCKER": docker.client, "DOCKER_HOST": f"unix://{tmp_path}/none.sock"})
    assert proc.returncode == 1 and "no Docker engine answers" in proc.stderr and f"{tmp_path}/none.sock" in proc.stderr
