"""The layers (docs/architecture.md, "Layers") hold: import-linter's contracts from pyproject.toml,
on the real import graph and on one with a forbidden import added, which they must catch."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = ROOT / "pyproject.toml"
CONTRACTS = [c["name"] for c in tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def test_every_contract_is_kept():
    proc = subprocess.run([LINT_IMPORTS, "--config", PYPROJECT, "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"Contracts: {len(CONTRACTS)} kept, 0 broken." in proc.stdout


def lint_with(extra_import: tuple[str, str], monkeypatch, capsys) -> dict[str, str]:
    """Lint the real graph plus `extra_import` (importer, imported): {contract name: KEPT|BROKEN}."""
    from importlinter import cli
    from importlinter.adapters.building import GraphBuilder
    from importlinter.application.app_config import settings
    from importlinter.configuration import configure

    class WithExtraImport(GraphBuilder):
        def build(self, *args, **kwargs):
            graph = super().build(*args, **kwargs)
            importer, imported = extra_import
            graph.add_import(importer=importer, imported=imported, line_number=1, line_contents=f"import {imported}")
            return graph

    monkeypatch.setattr(sys, "path", list(sys.path))  # lint_imports puts the working directory on it
    monkeypatch.chdir(ROOT)
    configure()
    settings.configure(GRAPH_BUILDER=WithExtraImport())
    try:
        code = cli.lint_imports(config_filename=str(PYPROJECT), no_cache=True, no_logo=True)
    finally:
        configure()
    out = " ".join(capsys.readouterr().out.split())  # long names wrap
    results = {name: "BROKEN" if f"{name} BROKEN" in out else "KEPT" if f"{name} KEPT" in out else "?" for name in CONTRACTS}
    assert (code != 0) == ("BROKEN" in results.values()), out
    return results


@pytest.mark.parametrize("importer, imported, broken", [
    ("tandem.server.engine", "tandem.operator.spec", "Nothing below the CLI imports the operator"),
    ("tandem.operator.render", "tandem.server.config", "The operator stands on common alone"),
    ("tandem.server.serve", "tandem.tools.stack", "Layers"),
    ("tandem.kernels.sampling", "tandem.server.sampling_params", "Layers"),
    ("tandem.server.scheduler", "torch", "The scheduler and its memory"),
    ("tandem.server.kv_events", "smg_grpc_proto", "The engine speaks no protobuf"),
])
def test_a_forbidden_import_breaks_its_contract(importer, imported, broken, monkeypatch, capsys):
    results = lint_with((importer, imported), monkeypatch, capsys)
    assert [name for name, r in results.items() if r == "BROKEN"] == [n for n in CONTRACTS if n.startswith(broken)]
    assert all(r == "KEPT" for name, r in results.items() if not name.startswith(broken)), results
