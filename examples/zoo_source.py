"""A zoo model as a standalone Python file, for programs that must run with torch alone.

:func:`model_source` writes the model's classes (this package's own source, its
imports of each other removed) and a ``build()`` factory returning the model and one
example sample: ``autopar codegen --model tiny-gpt`` writes it beside the program.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from types import ModuleType

from autopar.examples import gpt, llama, mlp, moe, zoo

__all__ = ["model_source"]


def _modules(model_class: type) -> list[ModuleType]:
    """The example modules that define ``model_class``, those it builds on first."""
    if model_class is moe.MoETransformer:
        return [llama, moe]
    return [{gpt.GPT: gpt, llama.Llama: llama, mlp.MLP: mlp}[model_class]]


def _split(module: ModuleType) -> tuple[list[str], str]:
    """A module's import lines (but ``__future__`` and this package's) and the text of
    everything after its docstring and imports."""
    text = inspect.getsource(module)
    lines = text.splitlines()
    tree = ast.parse(text)
    imports, last = [], 0
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            line = "\n".join(lines[node.lineno - 1:node.end_lineno])
            if not (isinstance(node, ast.ImportFrom) and
                    (node.module == "__future__" or (node.module or "").startswith("autopar"))):
                imports.append(line)
            last = node.end_lineno or last
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and last == 0:
            last = node.end_lineno or last
        else:
            break
    return imports, "\n".join(lines[last:]).strip("\n")


def model_source(name: str, seq_len: int | None = None) -> str:
    """The text of a Python file that defines zoo model ``name``'s classes and
    ``build()``, which returns the model (position tables for ``seq_len`` tokens, as
    :func:`autopar.examples.zoo.get` builds it) and one example sample of its inputs."""
    model, (x,) = zoo.get(name, seq_len=seq_len)
    imports: list[str] = []
    bodies = []
    for module in _modules(type(model)):
        found, body = _split(module)
        imports += [line for line in found if line not in imports]
        bodies.append(body)
    config = getattr(model, "config", None) or getattr(model, "cfg", None)
    if dataclasses.is_dataclass(config):
        make = f"{type(model).__name__}({config!r})"
    else:
        make = f"{type(model).__name__}(in_dim={x.shape[-1]})"
    dtype = "" if x.is_floating_point() else ", dtype=torch.long"
    example = f"torch.zeros(1, {x.shape[-1]}{dtype})"
    return (f'"""{zoo.describe(name)}: the zoo model {name!r} of autopar, standalone."""\n\n'
            "from __future__ import annotations\n\n" + "\n".join(imports) + "\n\n\n" +
            "\n\n\n".join(bodies) + "\n\n\n"
            "def build() -> tuple[nn.Module, tuple[torch.Tensor]]:\n"
            f'    """The {name} model and one example sample of its inputs."""\n'
            f"    return {make}, ({example},)\n")
