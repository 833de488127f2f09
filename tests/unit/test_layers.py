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
    ("tandem.server.loop.engine", "tandem.operator.spec", "Nothing below the tools imports the operator"),
    ("tandem.kernels.sampling", "tandem.operator.decision", "Nothing below the tools imports the operator"),
    # the tools: the operator's pure modules only, also through one of them
    ("tandem.tools.bench_autoscale", "tandem.operator.scaler", "The tools use only the operator's pure modules"),
    ("tandem.tools.stack", "kubernetes", "The tools use only the operator's pure modules"),
    ("tandem.operator.spec", "tandem.operator.kube", "The tools use only the operator's pure modules"),
    ("tandem.operator.render", "tandem.server.config", "The operator stands on common alone"),
    ("tandem.server.edge.serve", "tandem.tools.stack", "Layers"),
    ("tandem.kernels.sampling", "tandem.server.scheduling.sampling_params", "Layers"),
    # the server's packages: no package imports one above it
    ("tandem.server.loop.engine", "tandem.server.edge.metrics", "The server's packages"),
    ("tandem.server.disagg.decode", "tandem.server.loop.intake", "The server's packages"),
    ("tandem.server.model.llama", "tandem.server.disagg.layout", "The server's packages"),
    ("tandem.server.scheduling.scheduler", "tandem.server.model.config", "The server's packages"),
    ("tandem.server.kvcache.prefix_cache", "tandem.server.scheduling.request", "The server's packages"),
    ("tandem.server.scheduling.scheduler", "torch", "The scheduling core and the KV bookkeeping"),
    ("tandem.server.kvcache.slot_table", "numpy", "The scheduling core and the KV bookkeeping"),
    # a module that does not exist yet is covered by its package's rule, with no edit to the contract
    ("tandem.server.kvcache.not_written_yet", "torch", "The scheduling core and the KV bookkeeping"),
    ("tandem.server.kvcache.kv_events", "smg_grpc_proto", "Only the serving edge speaks gRPC"),
    ("tandem.server.loop.engine", "grpc", "Only the serving edge speaks gRPC"),
    ("tandem.server.parallel.not_written_yet", "google.protobuf", "Only the serving edge speaks gRPC"),
])
def test_a_forbidden_import_breaks_its_contract(importer, imported, broken, monkeypatch, capsys):
    results = lint_with((importer, imported), monkeypatch, capsys)
    assert [name for name, r in results.items() if r == "BROKEN"] == [n for n in CONTRACTS if n.startswith(broken)]
    assert all(r == "KEPT" for name, r in results.items() if not name.startswith(broken)), results


def test_only_the_edge_escapes_the_grpc_contract():
    """Every package and plain module of tandem.server but edge/ is a source of the gRPC contract, so
    a new package is covered the day it is made (or this test names it)."""
    contract = next(c for c in tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]
                    if c["name"].startswith("Only the serving edge speaks gRPC"))
    server = ROOT / "server"
    children = {f"tandem.server.{p.stem}" for p in server.iterdir()
                if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}
    assert children - {"tandem.server.edge"} <= set(contract["source_modules"]), children - set(contract["source_modules"])
    assert "tandem.server.edge" not in contract["source_modules"]


def test_the_tools_may_use_only_the_operators_pure_modules():
    """The tools' contract forbids every module of tandem.operator but the pure ones `tandem bench
    autoscale` runs, so a new operator module is forbidden to the tools until it is added here."""
    contract = next(c for c in tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]
                    if c["name"].startswith("The tools use only the operator's pure modules"))
    modules = {f"tandem.operator.{p.stem}" for p in (ROOT / "operator").glob("*.py")}
    pure = {f"tandem.operator.{m}" for m in ("decision", "signals", "spec", "schema")}
    assert pure <= modules
    assert modules - pure == {m for m in contract["forbidden_modules"] if m.startswith("tandem.operator.")}
