"""A Docker engine for the images tier (tests/images): the client, the engine (started here, after
installing Debian's docker.io, where none answers; stopped again by whoever started it), the images
built by scripts/build-images.sh, and networks of the tests' own.

Docker is driven through its command-line client: what a platform engineer types is what runs."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TAG = "dev"
IMAGES = {target: f"tandem/{target}:{TAG}" for target in ("router", "operator", "server-cpu")}
REPORT: dict[str, str] = {}  # what the images tier measured, printed in the run's summary (tests/images/conftest.py)


class DockerError(RuntimeError):
    pass


@dataclass(frozen=True)
class Docker:
    """One docker client, driven through its command line."""

    client: str

    def run(self, *args: str, check: bool = True, timeout: float = 120, input: str | None = None) -> subprocess.CompletedProcess:
        proc = subprocess.run([self.client, *args], capture_output=True, text=True, timeout=timeout, input=input)
        if check and proc.returncode != 0:
            raise DockerError(f"docker {' '.join(args)}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
        return proc

    def __call__(self, *args: str, **kwargs) -> str:
        """The command's standard output, stripped; DockerError when it fails."""
        return self.run(*args, **kwargs).stdout.strip()

    def answers(self) -> bool:
        try:
            return self.run("info", check=False, timeout=20).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def inspect(self, kind: str, name: str) -> dict:
        return json.loads(self(kind, "inspect", name))[0]


def pick_client() -> Docker | None:
    """The first client that builds with BuildKit, as scripts/build-images.sh picks it: one with the
    buildx plugin, or one older than 23.0 (Debian's docker.io 20.10), whose own builder is BuildKit."""
    for name in (os.environ.get("DOCKER"), "docker", "/usr/bin/docker"):
        path = shutil.which(name) if name else None
        if path is None:
            continue
        if subprocess.run([path, "buildx", "version"], capture_output=True).returncode == 0:
            return Docker(path)
        version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
        if (m := re.match(r"Docker version (\d+)\.", version)) and int(m[1]) < 23:
            return Docker(path)
    return None


@contextmanager
def engine(log_dir: Path):
    """A Docker engine that answers: the running one, or dockerd started here (Debian's docker.io
    installed first where missing) and stopped on exit, which takes root. As the project's machines run
    it: no iptables rules, no default bridge; the tests make networks of their own."""
    docker = pick_client()
    if docker is not None and docker.answers():
        yield docker
        return
    if os.geteuid() != 0:
        raise DockerError("no Docker engine answers this user, and starting one (after installing Debian's "
                          "docker.io) takes root: run the images tier as root, or start dockerd and give this "
                          "user its socket")
    if shutil.which("dockerd") is None or docker is None:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "docker.io"]):
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
            if proc.returncode != 0:
                raise DockerError(f"no Docker engine answers, and installing Debian's docker.io failed: "
                                  f"{' '.join(cmd)}\n{proc.stderr[-2000:]}")
        docker = pick_client()
        assert docker is not None, "docker.io installed, yet no client that builds with BuildKit"
    log = open(log_dir / "dockerd.log", "w")
    daemon = subprocess.Popen(["dockerd", "--iptables=false", "--bridge=none"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not docker.answers():
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise DockerError(f"dockerd did not start:\n{(log_dir / 'dockerd.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield docker
    finally:
        daemon.terminate()
        try:
            daemon.wait(60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        log.close()


def build_images(docker: Docker, log_path: Path) -> dict[str, int]:
    """scripts/build-images.sh with this client: {image: size in bytes}. Its log goes to `log_path`."""
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.run(["bash", str(REPO / "scripts" / "build-images.sh")], stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "DOCKER": docker.client, "TAG": TAG}, timeout=1800)
    if proc.returncode != 0:
        raise DockerError(f"scripts/build-images.sh failed ({proc.returncode}):\n{log_path.read_text()[-5000:]}")
    with open(log_path, "a") as log:
        log.write(f"build-images.sh took {time.monotonic() - start:.0f} s\n")
    return {image: int(docker("image", "inspect", "-f", "{{.Size}}", image)) for image in IMAGES.values()}


@dataclass
class Network:
    """A user-defined Docker network of the test's own, with a subnet of its own so that containers get
    the addresses they are given (a pod's IP is known before it starts, as its env needs it). The host
    reaches every address on it through the network's gateway, as a node reaches its pods."""

    docker: Docker
    name: str
    subnet: str = ""
    gateway: str = ""
    _next: int = 10

    @classmethod
    def create(cls, docker: Docker, name: str) -> "Network":
        for _ in range(20):
            third = random.randrange(64, 250)
            subnet, gateway = f"10.244.{third}.0/24", f"10.244.{third}.1"
            proc = docker.run("network", "create", "--subnet", subnet, "--gateway", gateway, name, check=False)
            if proc.returncode == 0:
                return cls(docker, name, subnet, gateway)
            if "overlap" not in proc.stderr:
                raise DockerError(f"docker network create {name}: {proc.stderr}")
        raise DockerError("no free 10.244.x.0/24 subnet for a test network")

    def address(self) -> str:
        """A new address on the network."""
        ip = f"{self.subnet.rsplit('.', 1)[0]}.{self._next}"
        self._next += 1
        return ip

    def remove(self) -> None:
        self.docker.run("network", "rm", self.name, check=False)
