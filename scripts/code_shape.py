"""The shape of tandem's code, by `ast`: the largest classes, the largest function per package, and the
import structure between modules (imports running up the layers, cycles).

    .venv/bin/python scripts/code_shape.py [--classes N] [--json]

tests/unit/test_code_shape.py holds the limits it reports (no class over CLASS_LIMIT lines in server/,
kernels/ and operator/; no import cycle between modules).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# folder -> the dotted name it installs as (pyproject.toml, [tool.setuptools.package-dir])
FOLDERS = {"cli": "tandem.cli", "tools": "tandem.tools", "server": "tandem.server", "kernels": "tandem.kernels",
           "operator": "tandem.operator", "common": "tandem.common"}
CLASS_LIMIT = 250
LIMITED = ("tandem.server", "tandem.kernels", "tandem.operator")
# top to bottom (pyproject.toml's layer contracts); an import from a lower layer to a higher one runs upward
LAYERS = ["tandem.cli", "tandem.tools", "tandem.server", "tandem.kernels", "tandem.common"]
SERVER_LAYERS = [("edge",), ("loop", "parallel"), ("disagg",), ("model",), ("scheduling",), ("kvcache",)]


@dataclass(frozen=True)
class Block:
    module: str
    name: str
    lines: int

    @property
    def package(self) -> str:
        return package_of(self.module)


def modules() -> dict[str, Path]:
    """Every module of tandem: dotted name -> file."""
    found = {}
    for folder, dotted in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((dotted, *parts))] = path
    return found


def _span(node: ast.AST) -> int:
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return node.end_lineno - first + 1


def classes_and_functions(mods: dict[str, Path]) -> tuple[list[Block], list[Block]]:
    classes, functions = [], []
    for module, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.append(Block(module, node.name, _span(node)))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append(Block(module, node.name, _span(node)))
    return classes, functions


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:`: for annotations, never run."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            ids |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return ids


def imports(mods: dict[str, Path], type_checking: bool = True) -> dict[str, set[str]]:
    """module -> the tandem modules it imports (at the top or inside a function; those under
    `if TYPE_CHECKING:` only with `type_checking`)."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text(), str(path))
        skip = set() if type_checking else _type_checking_only(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                names = [f"{base}.{a.name}" for a in node.names] + [base]
            for name in names:
                while name and name not in mods:
                    name = name.rpartition(".")[0]
                if name and name != module:
                    graph[module].add(name)
    return graph


def _rank(module: str) -> tuple[int, int] | None:
    for i, top in enumerate(LAYERS):
        if module == top or module.startswith(top + "."):
            if top != "tandem.server":
                return i, 0
            rest = module[len(top) + 1:].split(".")[0]
            for j, group in enumerate(SERVER_LAYERS):
                if rest in group:
                    return i, j + 1
            return i, 0 if not rest else len(SERVER_LAYERS) + 1  # server/config.py, env.py: shared below
    return None


def upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    out = []
    for src, targets in graph.items():
        for dst in targets:
            a, b = _rank(src), _rank(dst)
            if a and b and (b[0] < a[0] or (a[0] == b[0] and 0 < b[1] < a[1] and a[1] <= len(SERVER_LAYERS))):
                out.append((src, dst))
    return sorted(out)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan). A package's __init__ that
    imports its own modules is left out: it re-exports them, it does not depend on them."""
    edges = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in graph.items()}
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def package_of(module: str) -> str:
    """tandem.server.<sub> for the server's subpackages, else the top-level folder's package."""
    parts = module.split(".")
    if parts[1] == "server" and len(parts) > 3:
        return ".".join(parts[:3])
    if parts[1] == "server" and len(parts) == 3 and (ROOT / "server" / parts[2]).is_dir():
        return module
    return ".".join(parts[:2])


def package_edges(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for src, targets in graph.items():
        for dst in targets:
            if package_of(src) != package_of(dst):
                out.setdefault(package_of(src), set()).add(package_of(dst))
    return out


def report(top: int) -> dict:
    mods = modules()
    classes, functions = classes_and_functions(mods)
    graph = imports(mods)
    largest_fn: dict[str, Block] = {}
    for f in functions:
        if f.package not in largest_fn or f.lines > largest_fn[f.package].lines:
            largest_fn[f.package] = f
    return {
        "classes": [vars(c) for c in sorted(classes, key=lambda c: -c.lines)[:top]],
        "over_limit": [vars(c) for c in classes if c.lines > CLASS_LIMIT and c.module.startswith(LIMITED)],
        "largest_function_per_package": {p: vars(f) for p, f in sorted(largest_fn.items())},
        "modules": len(mods),
        "imports": sum(len(t) for t in graph.values()),
        "package_edges": {p: sorted(t) for p, t in sorted(package_edges(graph).items())},
        "upward": upward(graph),
        "cycles": cycles(graph),
        "runtime_cycles": cycles(imports(mods, type_checking=False)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--classes", type=int, default=15, help="how many of the largest classes to list")
    parser.add_argument("--json", action="store_true", help="print the whole report as JSON")
    args = parser.parse_args()
    r = report(args.classes)
    if args.json:
        print(json.dumps(r, indent=1))
        return
    print(f"{r['modules']} modules, {r['imports']} imports between them")
    print(f"\nlargest classes (limit {CLASS_LIMIT} lines in {', '.join(LIMITED)}):")
    for c in r["classes"]:
        print(f"  {c['lines']:5d}  {c['module']}.{c['name']}")
    print("\nlargest function per package:")
    for p, f in r["largest_function_per_package"].items():
        print(f"  {f['lines']:5d}  {p}: {f['module'].rsplit('.', 1)[-1]}.{f['name']}")
    print(f"\nimports running up the layers: {len(r['upward'])}")
    for src, dst in r["upward"]:
        print(f"  {src} -> {dst}")
    print(f"\nimport cycles between modules: {len(r['cycles'])}, of which {len(r['runtime_cycles'])} without the "
          "imports under `if TYPE_CHECKING:`")
    for comp in r["cycles"]:
        print("  " + " <-> ".join(comp) + ("" if comp in r["runtime_cycles"] else "  (TYPE_CHECKING only)"))
    print("\npackage -> packages it imports:")
    for p, ts in r["package_edges"].items():
        print(f"  {p} -> {', '.join(ts)}")


if __name__ == "__main__":
    main()
