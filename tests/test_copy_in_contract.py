"""The copy-in contract of the emitted program: the runtime's functions copied into it
(``inspect.getsource`` in the program templates) may use only names the program has —
an import the program generator knows (:mod:`autopar.runtime.codegen_imports`), a
builtin, a name some template section defines, or a constant the generator writes
(``STAGE_RANKS = ...``). A helper a copied function calls but
no section copies (``route_tokens``' ``_own_rows``, once) fails here, for every
section, not only those a test happens to emit."""

from __future__ import annotations

import ast
import builtins
import inspect
import re
import symtable
import textwrap
from string import Template

from autopar.runtime import (codegen, codegen_imports, codegen_pipeline,
                             codegen_pipeline_templates, codegen_templates)

PLACEHOLDER = re.compile(r"\$(\{\w+\}|\w+)")


def _sections() -> dict[str, str]:
    """Every template section that parses as Python, placeholders filled with None."""
    out = {}
    for mod in (codegen_templates, codegen_pipeline_templates):
        for name, value in vars(mod).items():
            if not isinstance(value, Template):
                continue
            code = textwrap.dedent(PLACEHOLDER.sub("None", value.template).replace("$$", "$"))
            try:
                ast.parse(code)
            except SyntaxError:  # a fragment of a function body, not a section
                continue
            out[f"{mod.__name__.rpartition('.')[2]}.{name}"] = code
    return out


def _defined(code: str) -> set[str]:
    """The module-level names ``code`` defines (functions, classes, assignments, imports)."""
    names = set()
    for node in ast.parse(code).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _written_constants() -> set[str]:
    """The constants the program generator writes outside the templates: a name in
    capitals assigned at the start of one of its strings (``f"\\nSEQ_LEN = {...}"``)."""
    src = inspect.getsource(codegen) + inspect.getsource(codegen_pipeline)
    return set(re.findall(r"""(?:["']|\\n)([A-Z][A-Z0-9_]*) = """, src))


def _globals_used(code: str) -> set[str]:
    """The global names the functions and classes of ``code`` read."""
    used: set[str] = set()

    def walk(table: symtable.SymbolTable) -> None:
        if table.get_type() == "function":
            used.update(table.get_globals())
        for child in table.get_children():
            walk(child)
    walk(symtable.symtable(code, "<section>", "exec"))
    return used


def test_every_name_a_copied_function_uses_is_in_the_program() -> None:
    sections = _sections()
    assert len(sections) >= 15  # the runtime's copied functions are among them
    defined = set().union(*(_defined(code) for code in sections.values()))
    known = defined | set(codegen_imports._IMPORTS) | set(codegen_imports._FROM) | \
        set(dir(builtins)) | {"__file__", "__name__"} | _written_constants()
    missing = {name: sorted(_globals_used(code) - known) for name, code in sections.items()}
    assert {k: v for k, v in missing.items() if v} == {}
