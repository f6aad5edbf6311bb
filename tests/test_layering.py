"""Imports flow one way: capture -> strategies -> cost -> solve -> plan -> runtime,
with the API and CLI on top.

Every module of the package (the folders ``pyproject.toml`` maps into it) is parsed
with :mod:`ast`, never imported, and put in a layer; a module may import its own
layer and the layers below, never one above. Imports inside functions and under
``if TYPE_CHECKING`` count too.

====  ==========  ===========================================================
layer name        modules
====  ==========  ===========================================================
0     base        autopar.errors, autopar.graph, autopar.memory_choices,
                  autopar.schema, autopar.units_text
1     capture     autopar.flops, autopar.layers, autopar.masks, autopar.fx_patterns,
                  autopar.capture_errors, autopar.export_graph, autopar.capture,
                  autopar.loader, autopar.pipeline_export, autopar.pipeline_split
2     strategies  autopar.sharding, autopar.strategies.*
3     cost        autopar.cost_models.*, autopar.cluster
4     solve       autopar.solvers.*
5     plan        autopar.plans, autopar.spec, autopar.summary, autopar.summary_words,
                  autopar.assemble, autopar.report, autopar.report_figures,
                  autopar.report_svg, autopar.report_png, autopar.batch_default,
                  autopar.explain, autopar.explain_words, autopar.planner,
                  autopar.planner_inputs
6     runtime     autopar.runtime.*
7     api         autopar (the package's __init__), autopar.api, autopar.compare,
                  autopar.cli, autopar.cli_checkpoint, autopar.demo, autopar.launch,
                  autopar.train, autopar.train_args, autopar.cli_train,
                  autopar.cli_options
8     examples    autopar.examples.*: imported by autopar.cli, autopar.demo and
                  autopar.train alone
====  ==========  ===========================================================

``ALLOWED`` lists today's remaining upward imports, each with why it is still there.
A new upward import fails; so does an ALLOWED pair that no longer occurs, so the list
only shrinks. CONTRIBUTING.md carries the same table.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LAYERS: list[tuple[str, tuple[str, ...]]] = [  # (name, modules); "x.*" is x and below
    ("base", ("autopar.errors", "autopar.graph", "autopar.memory_choices",
              "autopar.schema", "autopar.units_text")),
    ("capture", ("autopar.flops", "autopar.layers", "autopar.masks", "autopar.fx_patterns",
                 "autopar.capture_errors", "autopar.export_graph", "autopar.capture",
                 "autopar.loader", "autopar.pipeline_export", "autopar.pipeline_split")),
    ("strategies", ("autopar.sharding", "autopar.strategies.*")),
    ("cost", ("autopar.cost_models.*", "autopar.cluster")),
    ("solve", ("autopar.solvers.*",)),
    ("plan", ("autopar.plans", "autopar.spec", "autopar.summary", "autopar.summary_words",
              "autopar.assemble", "autopar.report", "autopar.report_figures",
              "autopar.report_svg", "autopar.report_png", "autopar.batch_default",
              "autopar.explain", "autopar.explain_words", "autopar.planner",
              "autopar.planner_inputs")),
    ("runtime", ("autopar.runtime.*",)),
    ("api", ("autopar", "autopar.api", "autopar.compare", "autopar.cli", "autopar.cli_checkpoint",
             "autopar.demo", "autopar.launch", "autopar.train", "autopar.train_args",
             "autopar.cli_train", "autopar.cli_options")),
    ("examples", ("autopar.examples.*",)),
]
EXAMPLES = len(LAYERS) - 1
EXAMPLE_USERS = frozenset({"autopar.cli", "autopar.demo", "autopar.train"})  # examples' importers

ALLOWED: frozenset[tuple[str, str]] = frozenset({
    # a profiler times the runtime's own code, so it runs it:
    ("autopar.cost_models.profiling.host_dispatch",
     "autopar.runtime.recompute"),  # selective_context
    ("autopar.cost_models.profiling.host_wrappers",
     "autopar.runtime.dtensor_layout"),  # DTensor ops
})


def _covers(pattern: str, module: str) -> bool:
    if pattern.endswith(".*"):
        base = pattern[:-2]
        return module == base or module.startswith(base + ".")
    return module == pattern


def layer_of(module: str) -> int | None:
    """The layer of ``module``: the most specific pattern that covers it."""
    best: tuple[int, int] | None = None
    for i, (_, patterns) in enumerate(LAYERS):
        for p in patterns:
            if _covers(p, module) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    return None if best is None else best[0]


def _describe(layer: int) -> str:
    return f"layer {layer} {LAYERS[layer][0]}"


def package_modules() -> dict[str, Path]:
    """Module name -> source file, for every module the package installs."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs: dict[str, str] = tool.get("package-dir", {})

    def folder(package: str) -> Path:
        if package in dirs:
            return ROOT / dirs[package]
        parent, _, leaf = package.rpartition(".")
        return folder(parent) / leaf if parent else ROOT / package

    modules: dict[str, Path] = {}
    for package in tool["packages"]:
        for path in sorted(folder(package).glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            modules[name] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str:
    """The module an import of ``name`` loads last: ``name`` itself, or the nearest
    package above it (a name imported from a module's namespace)."""
    while name not in modules and "." in name:
        name = name.rpartition(".")[0]
    return name


def _for_types_only(tree: ast.AST) -> set[int]:
    """The ids of the nodes under ``if TYPE_CHECKING:``, which never run."""
    return {id(n) for branch in ast.walk(tree) if isinstance(branch, ast.If)
            and isinstance(branch.test, ast.Name) and branch.test.id == "TYPE_CHECKING"
            for stmt in branch.body for n in ast.walk(stmt)}


def imports(modules: dict[str, Path], types: bool = True) -> dict[tuple[str, str], int]:
    """(importer, imported) -> the first line it happens on, for imports of the package;
    without ``types``, only the imports that run (not those under ``if TYPE_CHECKING``)."""
    found: dict[tuple[str, str], int] = {}
    for importer, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        package = importer if path.stem == "__init__" else importer.rpartition(".")[0]
        skipped = set() if types else _for_types_only(tree)
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1])
                    source = f"{base}.{node.module}" if node.module else base
                else:
                    source = node.module or ""
                names = [f"{source}.{a.name}" for a in node.names]
            for name in names:
                if name != "autopar" and not name.startswith("autopar."):
                    continue
                imported = _resolve(name, modules)
                if imported != importer:
                    found.setdefault((importer, imported), node.lineno)
    return found


def upward(modules: dict[str, Path]) -> dict[tuple[str, str], int]:
    """The imports that break the layering: of a higher layer, or of the examples from
    anywhere but :data:`EXAMPLE_USERS`."""
    bad = {}
    for (importer, imported), line in imports(modules).items():
        a, b = layer_of(importer), layer_of(imported)
        if a is None or b is None:
            continue  # reported by test_every_module_has_a_layer
        if b == EXAMPLES and a != EXAMPLES:
            if importer not in EXAMPLE_USERS:
                bad[(importer, imported)] = line
        elif b > a:
            bad[(importer, imported)] = line
    return bad


def test_every_module_has_a_layer() -> None:
    missing = [m for m in package_modules() if layer_of(m) is None]
    assert not missing, (f"{', '.join(missing)} belong to no layer: add each to LAYERS in "
                         "tests/test_layering.py and to the table in CONTRIBUTING.md")


def test_imports_flow_one_way() -> None:
    modules = package_modules()
    assert len(modules) > 50 and "autopar.runtime.codegen" in modules, sorted(modules)
    new = {pair: line for pair, line in upward(modules).items() if pair not in ALLOWED}
    lines = []
    for (importer, imported), line in sorted(new.items()):
        a, b = layer_of(importer), layer_of(imported)
        assert a is not None and b is not None
        where = f"{modules[importer].relative_to(ROOT)}:{line}"
        if b == EXAMPLES:
            lines.append(f"{importer} ({_describe(a)}) imports {imported} ({_describe(b)}) at "
                         f"{where}: only {' and '.join(sorted(EXAMPLE_USERS))} may import "
                         "the examples; move what it needs out of examples/ into the package")
        else:
            lines.append(f"{importer} ({_describe(a)}) imports {imported} ({_describe(b)}) at "
                         f"{where}: a layer imports only itself and those below; move what "
                         f"it needs down to layer {a} or below (a constant or small pure "
                         f"helper both sides can import), or move the importing code up")
    assert not lines, "imports against the layering (CONTRIBUTING.md):\n" + "\n".join(lines)


def cycles(pairs: set[tuple[str, str]]) -> list[list[str]]:
    """The import cycles among ``pairs`` (importer, imported): each strongly connected
    group of more than one module, sorted."""
    out: dict[str, set[str]] = {}
    for a, b in pairs:
        out.setdefault(a, set()).add(b)

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for m in out.get(todo.pop(), ()):
                if m not in seen:
                    seen.add(m)
                    todo.append(m)
        return seen

    reached = {m: reach(m) for m in out}
    groups = {frozenset(m2 for m2 in reached[m] if m in reached.get(m2, ())) | {m}
              for m in out if m in reached[m]}
    return sorted(sorted(g) for g in groups)


def test_no_import_cycles() -> None:
    """No module imports, through others, one that imports it back (imports that run:
    a type named under ``if TYPE_CHECKING`` is left out, as Plan is in autopar.summary,
    which Plan.summary() imports)."""
    found = cycles(set(imports(package_modules(), types=False)))
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_cycles_are_found() -> None:
    assert cycles({("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("d", "e"), ("e", "d"),
                   ("f", "a")}) == [["a", "b", "c"], ["d", "e"]]


def test_allowed_list_only_shrinks() -> None:
    gone = sorted(ALLOWED - set(upward(package_modules())))
    assert not gone, ("these ALLOWED imports no longer happen; remove them from ALLOWED in "
                      "tests/test_layering.py:\n" + "\n".join(f"{a} -> {b}" for a, b in gone))


def test_checker_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The checker finds an upward import written inside a function, as a relative
    import, and as ``from package import module``."""
    pkg = tmp_path / "autopar"
    (pkg / "runtime").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "graph.py").write_text("def f():\n    from autopar.runtime import lower\n")
    (pkg / "flops.py").write_text("from . import plans\n")
    (pkg / "plans.py").write_text("")
    (pkg / "runtime" / "__init__.py").write_text("")
    (pkg / "runtime" / "lower.py").write_text("from autopar.examples import zoo\n")
    modules = {"autopar": pkg / "__init__.py", "autopar.graph": pkg / "graph.py",
               "autopar.flops": pkg / "flops.py", "autopar.plans": pkg / "plans.py",
               "autopar.runtime": pkg / "runtime" / "__init__.py",
               "autopar.runtime.lower": pkg / "runtime" / "lower.py",
               "autopar.examples.zoo": pkg / "zoo.py"}
    (pkg / "zoo.py").write_text("from autopar.graph import f\n")
    assert set(upward(modules)) == {("autopar.graph", "autopar.runtime.lower"),
                                    ("autopar.flops", "autopar.plans"),
                                    ("autopar.runtime.lower", "autopar.examples.zoo")}
