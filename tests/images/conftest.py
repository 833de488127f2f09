"""The images tier: tandem's images built by scripts/build-images.sh, run as containers on a Docker
engine (started here where none answers, after installing Debian's docker.io; stopped again at the
end). What it measures (image sizes, build time, time to first token) is printed in the run's summary."""

from __future__ import annotations

import os

import pytest

from support.docker import IMAGES, REPORT, Network, build_images, engine


@pytest.fixture(scope="session")
def docker(tmp_path_factory):
    with engine(tmp_path_factory.mktemp("dockerd")) as client:
        yield client


@pytest.fixture(scope="session")
def images(docker, tmp_path_factory) -> dict[str, str]:
    """target -> image, built (or brought up to date) once per run."""
    log = tmp_path_factory.mktemp("build") / "build-images.log"
    sizes = build_images(docker, log)
    REPORT["build"] = log.read_text().splitlines()[-1]
    for image, size in sizes.items():
        REPORT[f"size {image}"] = f"{size / 1e6:.0f} MB"
    return dict(IMAGES)


@pytest.fixture(scope="session")
def network(docker):
    net = Network.create(docker, f"tandem-images-{os.getpid()}")
    yield net
    net.remove()


def pytest_terminal_summary(terminalreporter):
    if REPORT:
        terminalreporter.section("tandem images")
        for key, value in REPORT.items():
            terminalreporter.write_line(f"{key}: {value}")
