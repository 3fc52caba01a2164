"""Functions outside ``kernels/`` stay under 60 lines, or say in their docstring why not.

The developer guide's rule: a function longer than ``MAX_LINES`` (its ``def`` line to its last
line, docstring included) needs a docstring line that says ``longer than 60 lines`` and why.
"""

from __future__ import annotations

import ast
from pathlib import Path

import batchgen

MAX_LINES = 60
MARKER = "longer than 60 lines"
ROOT = Path(batchgen.__file__).parent


def long_functions(source: str) -> list[tuple[str, int]]:
    """``(qualified name, lines)`` of each function in ``source`` over ``MAX_LINES`` lines whose
    docstring does not say why it is longer."""
    found: list[tuple[str, int]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                lines = child.end_lineno - child.lineno + 1  # type: ignore[operator]
                if lines > MAX_LINES and MARKER not in (ast.get_docstring(child) or "").lower():
                    found.append((name, lines))
                walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                walk(child, prefix + child.name + ".")

    walk(ast.parse(source), "")
    return found


def test_the_scan_finds_a_long_function_and_reads_its_docstring() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES))
    method_body = "".join("    " + line + "\n" for line in body.splitlines())
    source = ("class A:\n    def long(self):\n" + method_body
              + "def short():\n    return 1\n"
              + "def explained():\n    '''Longer than 60 lines: one table.'''\n" + body)
    assert long_functions(source) == [("A.long", MAX_LINES + 1)]


def test_no_function_outside_kernels_grows_over_60_lines_unexplained() -> None:
    over = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("kernels/"):
            continue
        for name, lines in long_functions(path.read_text(encoding="utf-8")):
            over.append(f"{rel}:{name} ({lines} lines)")
    assert not over, (f"functions over {MAX_LINES} lines: split them, or say in the docstring "
                      f"why ('{MARKER}: ...'): " + ", ".join(over))
