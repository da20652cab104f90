"""The package's shape stays as docs/architecture.md draws it: no import cycle, and no arrow pointing up.

Every ``import`` / ``from ... import`` in edgeq/ (module level or inside a function: a lazy import is still a
dependency) is read with ``ast``, resolved to an edgeq module, and checked against the layer table below.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "edgeq"

# layer of each top-level piece of edgeq; a module may import its own layer's siblings (no cycle) and any lower layer
LAYERS = {
    "errors": 0, "keys": 0, "env": 0, "cpu": 0, "console": 0, "scheme": 1, "memory": 1,
    "io": 2,
    "quantize": 3,
    "layouts": 4,
    "convert": 5, "runtime": 5,
    "integrations": 6,
    "inspect": 7, "fidelity": 7, "bench": 7, "route": 7,
    "demo": 8,
    "cli": 9,
}
# pieces of one layer that must not import each other at all (not only not in a cycle)
APART = [{"convert", "runtime"}]
# the package's own __init__ installs the transformers integration on `import edgeq` (documented in it)
EXEMPT = {"edgeq"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The edgeq module ``name`` refers to (``from edgeq.io import hf`` names the module edgeq.io.hf)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            # `from edgeq import env` imports the module edgeq.env; `from edgeq.io.hf import Checkpoint` the module
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for n in names:
            if n == "edgeq" or n.startswith("edgeq."):
                target = _resolve(n)
                if target and target != module:
                    found.add(target)
    return found


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _piece(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def test_every_piece_has_a_layer():
    missing = sorted({_piece(m) for m in MODULES if m not in EXEMPT} - set(LAYERS))
    assert not missing, f"add these to LAYERS (and docs/architecture.md): {missing}"


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import in ``graph`` that points to a higher layer, or across a pair kept APART."""
    bad = []
    for m, deps in graph.items():
        if m in EXEMPT:
            continue
        for d in deps:
            if d == "edgeq":
                bad.append(f"{m} -> edgeq (import the module that holds the name, not the package)")
                continue
            a, b = _piece(m), _piece(d)
            if LAYERS[b] > LAYERS[a] or any({a, b} == pair for pair in APART):
                bad.append(f"{m} (layer {LAYERS[a]}) -> {d} (layer {LAYERS[b]})")
    return sorted(bad)


def cycles(graph: dict[str, set[str]]) -> list[str]:
    """Every import cycle found by a depth-first walk of ``graph``, as ``a -> b -> a``."""
    state: dict[str, int] = {}
    found = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if d in EXEMPT:
                continue
            if state.get(d) == 1:
                found.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return found


def test_no_arrow_points_up():
    bad = upward(GRAPH)
    assert not bad, "imports that point up or across:\n  " + "\n  ".join(bad)


def test_no_import_cycle():
    found = cycles(GRAPH)
    assert not found, "import cycles:\n  " + "\n  ".join(found)


def test_the_checks_catch_what_they_guard():
    """Not vacuous: a planted upward arrow, a planted cross arrow and a planted cycle are each reported."""
    graph = {k: set(v) for k, v in GRAPH.items()}
    graph["edgeq.io.hf"].add("edgeq.cli.main")
    graph["edgeq.runtime.loader"].add("edgeq.convert.plan")
    graph["edgeq.keys"].add("edgeq.errors")
    graph["edgeq.errors"].add("edgeq.keys")
    assert "edgeq.io.hf (layer 2) -> edgeq.cli.main (layer 9)" in upward(graph)
    assert "edgeq.runtime.loader (layer 5) -> edgeq.convert.plan (layer 5)" in upward(graph)
    assert "edgeq.errors -> edgeq.keys -> edgeq.errors" in cycles(graph)


def test_no_module_over_400_lines_without_a_reason():
    """docs/architecture.md: small modules. A module over the bound says why in a ``# size:`` comment."""
    big = [f"{m} ({n} lines)" for m, p in MODULES.items()
           if (n := len(p.read_text().splitlines())) > 400 and "# size:" not in p.read_text()]
    assert not big, "modules over 400 lines: " + ", ".join(sorted(big))


def test_no_function_over_60_lines_without_a_reason():
    """Small functions: one over 60 lines says why in its docstring, starting a sentence with "Long because"."""
    long = []
    for m, p in MODULES.items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                if "Long because" not in (ast.get_docstring(node) or ""):
                    long.append(f"{m}.{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, "functions over 60 lines: " + ", ".join(sorted(long))


def test_the_version_is_said_once():
    """keys.VERSION is edgeq's version; pyproject.toml must say the same (the wheel's metadata)."""
    import tomllib

    from edgeq.keys import VERSION

    pyproject = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())
    assert pyproject["project"]["version"] == VERSION
