"""The code's shape holds (scripts/code_shape.py measures it by `ast`): no class over CLASS_LIMIT lines
in server/, kernels/ and operator/, no import cycle between modules that runs (a cycle through
`if TYPE_CHECKING:` imports is only annotations), no import up the layers, and the measures
themselves see what they claim to."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("code_shape", ROOT / "scripts" / "code_shape.py")
shape = sys.modules["code_shape"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(shape)


def test_no_class_over_the_limit():
    classes, _ = shape.classes_and_functions(shape.modules())
    over = [f"{c.module}.{c.name}: {c.lines} lines" for c in classes
            if c.lines > shape.CLASS_LIMIT and c.module.startswith(shape.LIMITED)]
    assert not over, f"classes over {shape.CLASS_LIMIT} lines: {over}"


def test_no_import_cycle_that_runs():
    assert shape.cycles(shape.imports(shape.modules(), type_checking=False)) == []


def test_no_import_runs_up_the_layers():
    assert shape.upward(shape.imports(shape.modules())) == []


def test_the_measures_see_a_long_class_cycles_and_an_upward_import(tmp_path, monkeypatch):
    loop = tmp_path / "server" / "loop"
    loop.mkdir(parents=True)
    (tmp_path / "server" / "scheduling").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(shape.CLASS_LIMIT + 5))
    (loop / "big.py").write_text(f"class Big:\n{body}\n")
    (loop / "a.py").write_text("from tandem.server.loop import b\n")
    (loop / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tandem.server.loop import a\n")
    (loop / "c.py").write_text("import tandem.server.loop.d\n")
    (loop / "d.py").write_text("def f():\n    from tandem.server.loop.c import g\n")
    (tmp_path / "server" / "scheduling" / "low.py").write_text("import tandem.server.loop.big\n")
    monkeypatch.setattr(shape, "ROOT", tmp_path)
    mods = shape.modules()
    classes, _ = shape.classes_and_functions(mods)
    assert [(c.name, c.lines) for c in classes] == [("Big", shape.CLASS_LIMIT + 6)]
    assert shape.cycles(shape.imports(mods)) == [["tandem.server.loop.a", "tandem.server.loop.b"],
                                                 ["tandem.server.loop.c", "tandem.server.loop.d"]]
    assert shape.cycles(shape.imports(mods, type_checking=False)) == [["tandem.server.loop.c", "tandem.server.loop.d"]]
    assert shape.upward(shape.imports(mods)) == [("tandem.server.scheduling.low", "tandem.server.loop.big")]
