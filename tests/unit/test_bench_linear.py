"""`tandem bench linear --whole-model` runs end to end on the built-in model's shapes and times every
block form a float32 model on this CPU can hold, the file's 4-bit and 8-bit forms among them."""

from __future__ import annotations

import json
import subprocess
import sys


def test_the_whole_model_pass_times_each_block_form():
    proc = subprocess.run([sys.executable, "-m", "tandem.cli.main", "bench", "linear", "--whole-model", "--rows", "1"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line["bench"] == "linear" and line["rows"] == 1 and line["projections"] == 30 * 4 + 1
    for form in ("int8 blocks", "4-bit blocks", "8-bit blocks"):
        assert line[form]["ms"] > 0, form
    assert line["int8 blocks"]["vs_int8_blocks"] == 1.0
