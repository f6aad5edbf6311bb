"""The model's exported program as one flat graph that calls its blocks as modules.

:func:`export_program` exports the model with ``torch.export.export(model, inputs,
strict=False)``, keeping the call signature of each *outlined* module
(:func:`outlined_paths`: every block, and every other module that owns parameters,
contains no block and sits in no block); :func:`outlined_graph` rewrites the program
so that each such call is one ``call_module`` of the model's own module. A stage cut
from this graph (:mod:`autopar.pipeline_split`) holds the model's own blocks
under their own paths.

The functions here use torch alone, so :mod:`autopar.runtime.codegen_pipeline` copies
their source into an emitted program. What export captures, and which parts of it
are read (torch 2.11 to 2.13): docs/capture.md, section
``autopar.pipeline_export``.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx, nn
from torch.export.graph_signature import (ConstantArgument, InputKind, OutputKind,
                                          TensorArgument)

from autopar.capture import kv_cache_off

__all__ = ["StageSplitError", "outlined_paths", "export_program", "outlined_graph",
           "retarget_devices"]


class StageSplitError(ValueError):
    """The model's exported program cannot be cut into pipeline stages as asked."""


def outlined_paths(model: nn.Module, blocks: list[str]) -> list[str]:
    """``blocks``, then the outermost modules that own parameters, are not the root,
    and neither contain a block nor sit in one, in module order."""
    found = list(blocks)
    inside = tuple(b + "." for b in blocks)

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if path in blocks or path.startswith(inside):
                continue
            if any(b.startswith(path + ".") for b in blocks):
                visit(path, child)
            elif any(True for _ in child.parameters()):
                found.append(path)

    visit("", model)
    return found


def export_program(model: nn.Module, inputs: tuple[torch.Tensor, ...],
                   paths: list[str]) -> torch.export.ExportedProgram:
    """``torch.export.export(model, inputs, strict=False)`` keeping the call signature
    of each of ``paths``, in the model's own mode, with a Hugging Face model's KV cache
    (``config.use_cache``, which training does not use) off while it exports."""
    with kv_cache_off(model):
        return torch.export.export(model, tuple(inputs), strict=False,
                                   preserve_module_call_signature=tuple(paths))


def _called_once(ep: torch.export.ExportedProgram, paths: list[str],
                 blocks: list[str]) -> dict[str, Any]:
    """The call signature of each of ``paths`` that the forward calls exactly once (a
    module called twice or never is left as aten ops; a block must be called once)."""
    entries = {e.fqn: e.signature for e in ep.module_call_graph}
    called = {}
    for path in paths:
        once = entries.get(path) is not None and f"{path}@1" not in entries
        if once:
            called[path] = entries[path]
        elif path in blocks:
            how = "more than once" if f"{path}@1" in entries else "never"
            raise StageSplitError(
                f"block '{path}' is called {how} by the model's forward; pipeline stages are cut "
                "at block calls, so each block must run exactly once per forward")
    return called


def _owner(node: fx.Node, called: dict[str, Any], blocks: list[str]) -> str | None:
    """The outlined module whose call computes ``node`` (a block before any other)."""
    stack = [path for path, _ in (node.meta.get("nn_module_stack") or {}).values()]
    for path in stack:
        if path in blocks and path in called:
            return path
    return next((p for p in stack if p in called), None)


def _leaf_paths(spec: Any) -> list[tuple[Any, ...]]:
    """The index path (keys into tuples, lists and dicts) of each leaf of a pytree
    spec, in leaf order."""
    tree = spec.unflatten(list(range(spec.num_leaves)))
    paths: list[tuple[Any, ...]] = [()] * spec.num_leaves

    def walk(obj: Any, path: tuple[Any, ...]) -> None:
        if isinstance(obj, int) and not isinstance(obj, bool):
            paths[obj] = path
        elif isinstance(obj, dict):
            for key, value in obj.items():
                walk(value, path + (key,))
        elif isinstance(obj, (tuple, list)):
            for i, value in enumerate(obj):
                walk(value, path + (i,))
        else:
            raise StageSplitError(f"a module returns a {type(obj).__name__}; an outlined "
                                  "module may return tensors in tuples, lists and dicts")

    walk(tree, ())
    return paths


class _Outliner:
    """Builds :func:`outlined_graph`'s graph; one instance per call."""

    def __init__(self, model: nn.Module, ep: torch.export.ExportedProgram,
                 called: dict[str, Any], blocks: list[str]) -> None:
        self.model, self.ep, self.called, self.blocks = model, ep, called, blocks
        self.graph = fx.Graph()
        self.env: dict[fx.Node, Any] = {}
        self.attrs: dict[str, Any] = {}
        self.by_name = {n.name: n for n in ep.graph.nodes}
        self.inputs = {s.arg.name: s for s in ep.graph_signature.input_specs}
        self.owner = {n: _owner(n, called, blocks) for n in ep.graph.nodes}

    def value(self, node: fx.Node) -> Any:
        """The new graph's value of an exported node, or a clear error."""
        if node not in self.env:
            raise StageSplitError(
                f"'{node.name}', computed inside module '{self.owner.get(node)}', is used "
                "outside it without being its output (a value kept on the module, or a "
                "mutation); pipeline stages need modules that return what others read")
        return self.env[node]

    def placeholder(self, node: fx.Node) -> None:
        """A user input stays an input; a parameter, buffer or constant is read by name."""
        spec = self.inputs[node.name]
        if spec.kind == InputKind.USER_INPUT:
            self.env[node] = self.graph.placeholder(node.name)
            return
        if spec.kind == InputKind.PARAMETER:
            target, value = spec.target, self.model.get_parameter(spec.target)
        elif spec.kind == InputKind.BUFFER:
            target, value = spec.target, self.model.get_buffer(spec.target)
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            target, value = "_constant_" + spec.target.replace(".", "_"), \
                self.ep.constants[spec.target]
        else:
            raise StageSplitError(f"the exported program has a {spec.kind.name} input "
                                  f"('{node.name}'), which pipeline stages cannot hold")
        self.attrs[target] = value
        get = self.graph.get_attr(target)
        get.meta["param"] = spec.kind == InputKind.PARAMETER
        self.env[node] = get

    def call(self, path: str) -> None:
        """One ``call_module`` of the model's own module, and its outputs."""
        sig = self.called[path]
        leaves = []
        for arg in sig.inputs:
            if isinstance(arg, ConstantArgument):
                leaves.append(arg.value)
            elif isinstance(arg, TensorArgument):
                leaves.append(self.value(self.by_name[arg.name]))
            else:
                raise StageSplitError(f"module '{path}' takes a {type(arg).__name__}; an "
                                      "outlined module may take tensors and constants")
        args, kwargs = sig.in_spec.unflatten(leaves)
        node = self.graph.call_module(path, tuple(args), dict(kwargs))
        for arg, keys in zip(sig.outputs, _leaf_paths(sig.out_spec)):
            if not isinstance(arg, TensorArgument):
                continue
            out = node
            for key in keys:
                out = self.graph.call_function(operator.getitem, (out, key))
            source = self.by_name[arg.name]
            out.meta["val"] = source.meta.get("val")
            self.env[source] = out
        self._check_params(path)

    def _check_params(self, path: str) -> None:
        """An outlined module may read only parameters it holds itself."""
        own = {id(p) for p in self.model.get_submodule(path).parameters()}
        for n, owner in self.owner.items():
            if owner != path:
                continue
            for a in n.all_input_nodes:
                spec = self.inputs.get(a.name) if a.op == "placeholder" else None
                if spec is not None and spec.kind == InputKind.PARAMETER and \
                        id(self.model.get_parameter(spec.target)) not in own:
                    raise StageSplitError(
                        f"module '{path}' reads parameter '{spec.target}', which it does not "
                        "hold; a block must own the parameters it uses (share a module's "
                        "weight by tying parameters, not by calling another module)")

    def output(self, node: fx.Node) -> None:
        """The model's outputs; a buffer mutation is left to the module making it."""
        outs = []
        for spec, value in zip(self.ep.graph_signature.output_specs, node.args[0]):
            if spec.kind == OutputKind.USER_OUTPUT:
                outs.append(self.value(value) if isinstance(value, fx.Node) else value)
            elif spec.kind != OutputKind.BUFFER_MUTATION or self.owner.get(value) is None:
                raise StageSplitError(
                    f"the forward mutates {spec.target or spec.arg} outside its modules "
                    f"({spec.kind.name}); move the update into a module's forward")
        self.graph.output(tuple(outs))

    def run(self) -> fx.Graph:
        """Copy the exported graph, one call per outlined module."""
        done: set[str] = set()
        for node in self.ep.graph.nodes:
            owner = self.owner[node]
            if node.op == "placeholder":
                self.placeholder(node)
            elif node.op == "output":
                self.output(node)
            elif owner is None:
                self.env[node] = self.graph.node_copy(node, self.value)
            elif owner not in done:
                self.call(owner)
                done.add(owner)
        return self.graph


def outlined_graph(model: nn.Module, ep: torch.export.ExportedProgram, paths: list[str],
                   blocks: list[str]) -> tuple[fx.Graph, dict[str, Any]]:
    """The exported program ``ep`` of ``model`` (exported keeping the signatures of
    ``paths``) as one graph in which each of ``paths`` called once is a
    ``call_module`` of the model's own module with the arguments the forward passed
    it, the rest aten ops, and parameters, buffers and constants ``get_attr`` nodes by
    name; also return what those nodes read (target -> tensor). Raises
    StageSplitError when a block is not called exactly once, or a module's internals
    are used outside it."""
    outliner = _Outliner(model, ep, _called_once(ep, paths, blocks), blocks)
    return outliner.run(), outliner.attrs


def retarget_devices(graph: fx.Graph, src: torch.device, dst: torch.device) -> None:
    """Make the graph's constant devices ``src`` (the device it was exported on, e.g.
    ``meta``) into ``dst``, the device the stages run on (``torch.arange(T,
    device=...)``)."""
    if src == dst:
        return

    def move(a: Any) -> Any:
        return dst if isinstance(a, torch.device) and a.type == src.type else a

    for node in graph.nodes:
        node.args = fx.node.map_aggregate(node.args, move)
        node.kwargs = fx.node.map_aggregate(node.kwargs, move)
