"""The InferenceService examples (examples/*.yaml) as the operator's render.Instance."""

from __future__ import annotations

from pathlib import Path

import yaml

from tandem.operator import render
from tandem.operator.spec import parse_spec

REPO = Path(__file__).resolve().parents[2]
UID = "6b1a4a8e-1f0e-4a55-9a57-3c1f2f7f0001"


def instance(example: str, **spec_changes) -> render.Instance:
    body = yaml.safe_load((REPO / "examples" / f"{example}.yaml").read_text())
    spec = {**body["spec"], **spec_changes}
    return render.Instance(name=body["metadata"]["name"], namespace=body["metadata"].get("namespace", "default"),
                           uid=UID, spec=parse_spec(body["metadata"]["name"], spec))
