"""An import inside a function says why it is not at the top of its file.

The developer guide's rule: imports sit at the top of the file, unless a comment names the
cycle broken or the heavy dependency deferred. The comment stands on the import's line, or just
above it (above the group of imports it belongs to).
"""

from __future__ import annotations

import ast
from pathlib import Path

import batchgen

ROOT = Path(batchgen.__file__).parent


def unexplained_imports(source: str) -> list[tuple[int, str]]:
    """``(line, module)`` of each import inside a function of ``source`` without a comment on its
    line or on the nearest line above it that is no import and not blank."""
    lines = source.splitlines()
    found: list[tuple[int, str]] = []

    def explained(lineno: int) -> bool:
        if "#" in lines[lineno - 1]:
            return True
        k = lineno - 2
        while k >= 0 and (not lines[k].strip() or lines[k].strip().startswith(("from ", "import "))):
            if "#" in lines[k]:
                return True
            k -= 1
        return k >= 0 and lines[k].strip().startswith("#")

    def walk(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)) and in_function and not explained(child.lineno):
                name = child.module or "" if isinstance(child, ast.ImportFrom) else child.names[0].name
                found.append((child.lineno, "." * getattr(child, "level", 0) + name))
            walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    walk(ast.parse(source), False)
    return found


def test_the_scan_finds_an_unexplained_import_and_reads_comments() -> None:
    source = ("import os\n"
              "def a():\n    import json\n    return json\n"
              "def b():\n    import json  # deferred: a reason\n"
              "def c():\n    # deferred: a reason\n    import json\n    import re\n\n    return re\n"
              "def d():\n    x = 1\n    import json\n")
    assert unexplained_imports(source) == [(3, "json"), (15, "json")]


def test_every_import_inside_a_function_says_why() -> None:
    missing = [f"{path.relative_to(ROOT).as_posix()}:{line} ({module})"
               for path in sorted(ROOT.rglob("*.py"))
               for line, module in unexplained_imports(path.read_text(encoding="utf-8"))]
    assert not missing, ("imports inside functions without a comment naming the cycle or the heavy "
                         "dependency they avoid: move them to the top, or say why: " + ", ".join(missing))
