"""The router Deployment the operator renders, run: smg accepts its command line and reads the
worker manifest the operator writes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

from support.examples import instance
from support.serving import free_port
from tandem.operator import render


def test_rendered_router_command_line_starts_smg(tmp_path):
    """smg accepts every flag the operator renders and reads the rendered worker manifest."""
    inst = instance("full")
    args = render.router_args(inst)
    workers = tmp_path / "workers.json"
    workers.write_text(render.render_workers_configmap(inst)["data"]["workers.json"])
    args[args.index("--discovery-file") + 1] = str(workers)
    port, health = free_port(), free_port()
    for flag, value in (("--port", port), ("--health-check-port", health), ("--prometheus-port", free_port())):
        args[args.index(flag) + 1] = str(value)
    args[args.index("--host") + 1] = "127.0.0.1"
    args[args.index("--prometheus-host") + 1] = "127.0.0.1"
    log = tmp_path / "router.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "smg", *args], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"smg exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"smg never answered /liveness:\n{log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{health}/liveness", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/workers", timeout=5) as r:
            assert r.status == 200
        # The full example passes --log-level info, so smg logs what it read from the manifest.
        listed = f"lists {len(json.loads(workers.read_text())['workers'])} worker(s)"
        while listed not in log.read_text():
            assert time.monotonic() < deadline, f"smg did not read the manifest:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    text = log.read_text()
    assert "invalid discovery manifest" not in text and "error: unrecognized arguments" not in text, text[-3000:]
