"""The tests' own shape: shared code lives in tests/helpers/ (or a conftest fixture), and no module under tests/
imports a test module (``test_*``) or conftest -- neither at the top, nor inside a function, nor in the source of a
child process held in a string (``python -c`` children put tests/ on sys.path and import from there)."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def _is_test_module(name: str) -> bool:
    top = name.split(".")[0]
    return top.startswith("test_") or top == "conftest"


def _imported(tree: ast.AST, strings: bool = True) -> list[tuple[int, str]]:
    """(line, module) for every import in ``tree`` and (``strings``) in every string constant that parses as Python
    (a child process's code)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif strings and isinstance(node, ast.Constant) and isinstance(node.value, str) and "import" in node.value:
            found += [(node.lineno, name) for child in _code_in(node.value) for _, name in _imported(child)]
    return found


def _code_in(text: str) -> list[ast.AST]:
    """The string as Python, or, when it does not parse (a ``str.format`` template: ``{tests!r}``), each of its lines
    that parses as an import statement."""
    try:
        return [ast.parse(textwrap.dedent(text))]
    except SyntaxError:
        pass
    trees = []
    for line in text.splitlines():
        if line.strip().startswith(("import ", "from ")):
            try:
                trees.append(ast.parse(line.strip()))
            except SyntaxError:
                continue
    return trees


def violations(source: str, filename: str = "<string>") -> list[str]:
    """``file:line imports module`` for each import of a test module (or conftest) in ``source``."""
    tree = ast.parse(source, filename)
    return [f"{filename}:{line} imports {name}" for line, name in _imported(tree) if _is_test_module(name)]


def _files() -> list[Path]:
    return sorted(TESTS.glob("*.py")) + sorted((TESTS / "helpers").glob("*.py"))


def test_no_module_under_tests_imports_a_test_module():
    files = _files()
    assert any(p.name == Path(__file__).name for p in files) and (TESTS / "helpers" / "models.py") in files
    bad = [v for p in files for v in violations(p.read_text(), str(p.relative_to(TESTS.parent)))]
    assert not bad, "import shared code from tests/helpers/ instead:\n" + "\n".join(bad)


@pytest.mark.slow
def test_the_walk_sees_imports_everywhere():
    """Not vacuous: the walk finds the helper imports, including ones only in a child process's source string."""
    trees = [ast.parse(p.read_text()) for p in _files() if p.name != Path(__file__).name]  # not the planted ones
    seen = {name for t in trees for _, name in _imported(t)}
    assert {"helpers.models", "helpers.cli", "helpers.checkpoints"} <= seen
    in_strings = {name for t in trees for _, name in set(_imported(t)) - set(_imported(t, strings=False))}
    assert any(name.startswith("helpers.") for name in in_strings), in_strings


def test_planted_violations_are_caught():
    # "{t}" keeps this template from parsing (the walk above reads this file too); format() plants the names.
    planted = textwrap.dedent('''
        import json
        import {t}_quantize
        from {t}_quantize_errors import run_cli
        from {c} import FIXTURE
        from helpers.cli import run_cli as fine

        def {t}_x():
            from {t}_runtime_perm import permute

        CHILD = """
            import sys
            from {t}_native import problem
        """
        TEMPLATE = """
            sys.path.insert(0, {{tests!r}})
            from {t}_gptq import make_gptq
        """
        NOT_CODE = "import from {t}_fake, in prose"
        ''').format(t="test", c="conftest")
    got = violations(planted, "planted.py")
    assert sorted(v.split(" imports ")[1] for v in got) == [
        "conftest", "test_gptq", "test_native", "test_quantize", "test_quantize_errors", "test_runtime_perm"
    ], got
    assert "planted.py:3 imports test_quantize" in got
    assert violations("from helpers.models import save_tiny\nimport testing\nimport pytest_timeout\n") == []
