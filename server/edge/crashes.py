"""The engine's failures, counted across the container restarts they cause: a file (`TANDEM_CRASH_LOG`,
an emptyDir on Kubernetes) holds one line per failure, `<unix time> <reason>`; a new process counts
them so that `tandem_engine_crashes_total` keeps rising from one container to the next, and logs
the last one's reason."""

from __future__ import annotations

import logging
import time
from pathlib import Path

log = logging.getLogger("tandem.serve")


class CrashLog:
    """`path` None: failures are only counted in this process."""

    def __init__(self, path: Path | None):
        self.path = path
        self.earlier: list[str] = []  # the lines of the failures before this process
        if path is not None and path.exists():
            self.earlier = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
        if self.earlier:
            log.warning("the engine failed %d time(s) before this start; the last: %s", len(self.earlier),
                        self.earlier[-1].partition(" ")[2])

    def record(self, reason: str) -> None:
        """Append one failure (its reason on one line). A file that cannot be written is logged, not raised:
        the server is failing already."""
        if self.path is None:
            return
        line = f"{time.time():.0f} {' '.join(reason.split())}\n"
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as f:
                f.write(line)
        except OSError as e:
            log.error("cannot record the engine failure in %s (TANDEM_CRASH_LOG): %s", self.path, e)
