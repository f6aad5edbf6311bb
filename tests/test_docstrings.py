"""A module docstring says what the module is for, names its entry points and points to
where its formulas are written out (docs/), in at most 15 lines.

Every module of the package (the folders ``pyproject.toml`` maps into it) is parsed with
:mod:`ast`, never imported. A docstring's length is the lines it spans in the file, the
line of its closing quotes included. CONTRIBUTING.md states the same rule.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_layering import ROOT, package_modules

MAX_LINES = 15


def docstring_lines(path: Path) -> int:
    """The lines the module docstring of ``path`` spans (0 without one)."""
    text = ast.get_docstring(ast.parse(path.read_text(), filename=str(path)), clean=False)
    return 0 if text is None else text.count("\n") + 1


def long_docstrings(modules: dict[str, Path]) -> dict[str, int]:
    """Module -> docstring lines, for the modules over :data:`MAX_LINES`."""
    found = {}
    for module, path in modules.items():
        lines = docstring_lines(path)
        if lines > MAX_LINES:
            found[module] = lines
    return found


def test_module_docstrings_are_short() -> None:
    modules = package_modules()
    assert len(modules) > 50 and "autopar.solvers.problem" in modules, sorted(modules)
    long = long_docstrings(modules)
    assert not long, (
        f"module docstrings over {MAX_LINES} lines (CONTRIBUTING.md): say what the module is "
        "for and its entry points, and move formulas and specification to docs/ (or into "
        "the docstring of the function that implements them), rationale and measurements "
        "to the commit body or benchmarks/results/README.md:\n"
        + "\n".join(f"{modules[m].relative_to(ROOT)}: {n} lines" for m, n in sorted(long.items())))


def test_counts_the_lines_a_docstring_spans(tmp_path: Path) -> None:
    one = tmp_path / "one.py"
    one.write_text('"""One line."""\n\nX = 1\n')
    two = tmp_path / "two.py"
    two.write_text('"""Summary.\n\nBody.\n"""\n')
    none = tmp_path / "none.py"
    none.write_text("X = '''not a docstring'''\n")
    assert [docstring_lines(p) for p in (one, two, none)] == [1, 4, 0]
