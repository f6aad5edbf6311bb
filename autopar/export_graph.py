"""An exported program -> an annotated :class:`~autopar.graph.Graph`: one node per aten
op with its output shapes, FLOPs and bytes, module path and parameters; grad-mode and
autocast regions inlined; the patterns of :mod:`autopar.fx_patterns` read whole."""

from __future__ import annotations

import operator
import os
import re
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch
from torch import nn

from autopar.capture_errors import first_line
from autopar.errors import CaptureError
from autopar.flops import flops_and_bytes
from autopar.fx_patterns import FLATTEN, Flattened, flattened_cats, without_checks
from autopar.graph import Graph, OpNode, ParamInfo, TensorMeta
from autopar.masks import mark_causal_masks

WRAPPED = "model"
"""The attribute of :class:`autopar.capture.LossWrapper` that holds the user's model."""

# --- the exported program -> Graph -----------------------------------------------------------
# torch.export's node targets are torch._ops.OpOverload / HigherOrderOperator objects and
# an OpOverload's argument names come from its private ``_schema``: there is no public
# spelling of either (checked against torch 2.11-2.13).

_PARAM_KINDS = ("PARAMETER", "BUFFER", "CONSTANT_TENSOR")
_NO_GRAD_OPS = frozenset({"aten.detach.default", "aten.detach_.default"})
_TARGET_MAKERS = frozenset({"aten.zeros.default", "aten.zeros_like.default"})


@dataclass(frozen=True)
class _Ref:
    """A reference to a kept Graph node."""

    name: str


@dataclass
class _Builder:
    """The Graph under construction."""

    nodes: list[OpNode] = field(default_factory=list)
    by_name: dict[str, OpNode] = field(default_factory=dict)
    vals: dict[str, Any] = field(default_factory=dict)
    attrs: dict[Any, Any] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)
    make_targets: bool = False

    def add(self, node: OpNode, val: Any, at: int | None = None) -> _Ref:
        base, k = node.name, 1
        while node.name in self.by_name:
            node.name, k = f"{base}_{k}", k + 1
        self.nodes.insert(len(self.nodes) if at is None else at, node)
        self.by_name[node.name] = node
        self.vals[node.name] = val
        return _Ref(node.name)


def to_graph(ep: Any, model: nn.Module, inputs: tuple[torch.Tensor, ...], name: str) -> Graph:
    """The Graph of ``ep``, an ExportedProgram of ``LossWrapper(model)`` (layers are
    left to :func:`autopar.layers.detect_layers`)."""
    canon, aliases, trainable = _param_names(model)
    specs = {s.arg.name: s for s in ep.graph_signature.input_specs if hasattr(s.arg, "name")}
    # without example targets, LossWrapper makes them in the graph: they become an input
    n_user = sum(1 for s in specs.values() if s.kind.name == "USER_INPUT")
    b = _Builder(make_targets=n_user == len(inputs))
    params: dict[str, ParamInfo] = {}
    env: dict[Any, Any] = {}
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    chosen: dict[str, Any] = {}
    for ph in placeholders:
        spec = specs.get(ph.name)
        if spec is not None and spec.kind.name in _PARAM_KINDS:
            fqn = canon.get(_strip(str(spec.target)), _strip(str(spec.target)))
            if fqn not in chosen or (ph.users and not chosen[fqn].users):
                chosen[fqn] = ph
    for ph in placeholders:
        spec = specs.get(ph.name)
        kind = spec.kind.name if spec is not None else ""
        meta = _meta(ph.meta.get("val"))
        if kind in _PARAM_KINDS:
            fqn = canon.get(_strip(str(spec.target)), _strip(str(spec.target)))
            if chosen[fqn] is not ph:
                env[ph] = _Ref(chosen[fqn].name)
                continue
            train = kind == "PARAMETER" and trainable.get(fqn, True)
            params[fqn] = ParamInfo(fqn, meta, fqn.rpartition(".")[0], train,
                                    list(aliases.get(fqn, [])), kind != "PARAMETER")
            env[ph] = b.add(OpNode(ph.name, "param", fqn, out=meta, requires_grad=train),
                            ph.meta.get("val"))
        elif kind == "USER_INPUT" and meta is not None:
            env[ph] = b.add(OpNode(ph.name, "input", ph.name, out=meta), ph.meta.get("val"))
            b.inputs.append(env[ph].name)
        else:
            env[ph] = None
    out = _walk(b, ep.graph_module, ep.graph, env, grad=True)
    b.nodes = without_checks(b.nodes, [r.name for r in out or () if isinstance(r, _Ref)])
    kinds = [s.kind.name for s in ep.graph_signature.output_specs]
    loss = out[kinds.index("USER_OUTPUT")] if "USER_OUTPUT" in kinds else None
    if not isinstance(loss, _Ref):
        raise CaptureError("the loss is not a tensor computed by the forward; loss_fn must "
                           "return a scalar tensor")
    lmeta = b.by_name[loss.name].out
    if lmeta is None or lmeta.shape != () or not lmeta.is_float:
        raise CaptureError(f"the loss must be a scalar float tensor, got shape "
                           f"{lmeta.shape if lmeta else None}; reduce it (e.g. .mean()) in "
                           "loss_fn")
    x = inputs[0]
    seq = int(x.shape[1]) if x.dim() == 2 and not x.is_floating_point() and \
        x.dtype != torch.bool else None
    g = Graph(b.nodes, params, [], {}, b.inputs, loss.name, int(x.shape[0]), seq, name, ep)
    mark_causal_masks(g, model)
    return g


def _walk(b: _Builder, gm: Any, graph: Any, env: dict, grad: bool) -> Any:
    """Add ``graph``'s nodes to ``b`` (inlining grad-mode and autocast regions) and
    return its output, resolved (an ``unbind`` read whole by a ``cat`` as one flatten:
    :mod:`autopar.fx_patterns`)."""
    merged, unread = flattened_cats(graph)
    for fx in graph.nodes:
        if fx.op == "placeholder" or fx in unread:
            continue
        if fx.op == "get_attr":
            obj = gm
            for part in str(fx.target).split("."):
                obj = getattr(obj, part)
            b.attrs[fx] = obj
            env[fx] = None
        elif fx.op == "output":
            return _resolve(fx.args[0], env)
        elif fx.op == "call_function":
            _call(b, fx, env, grad, merged.get(fx))
        else:
            raise CaptureError(f"unexpected {fx.op} node {fx.name} in the exported program")
    return None


def _call(b: _Builder, fx: Any, env: dict, grad: bool, flat: Flattened | None = None) -> None:
    tgt = fx.target
    if isinstance(tgt, torch._ops.HigherOrderOperator):
        env[fx] = _inline(b, fx, env, grad)
        return
    if tgt is operator.getitem and not isinstance(env.get(fx.args[0]), _Ref):
        env[fx] = env[fx.args[0]][fx.args[1]]
        return
    val = fx.meta.get("val")
    try:
        metas = [_meta(v) for v in (val if isinstance(val, (list, tuple)) else [val])]
    except RuntimeError as e:  # a shape only known at run time: torch's GuardOn... error
        if "DataDependent" not in type(e).__name__:
            raise
        raise _dynamic_shape(fx, e) from None
    outs = [m for m in metas if m is not None]
    if not outs:
        env[fx] = _scalar(val)
        return
    target = "getitem" if tgt is operator.getitem else (
        str(tgt) if isinstance(tgt, torch._ops.OpOverload) else getattr(tgt, "__name__", str(tgt)))
    args = _normalized(fx)
    if flat is not None:
        target, args = FLATTEN, [flat.source, flat.dim, flat.dim + 1]
    path, mtype = _module_of(fx)
    if b.make_targets and target in _TARGET_MAKERS and path == "" and mtype == "LossWrapper":
        b.make_targets = False
        at = max(k for k, n in enumerate(b.nodes) if n.kind in ("input", "param")) + 1
        env[fx] = b.add(OpNode(fx.name, "input", fx.name, out=outs[0], outs=outs), val, at)
        b.inputs.append(env[fx].name)
        return
    ins = _tensor_refs(args, env)
    node = OpNode(fx.name, "op", target, ins, _render(args, env), outs[0], outs,
                  module_path=path, module_type=mtype)
    srcs = [b.by_name[i] for i in ins]
    node.params = [s.target for s in srcs if s.kind == "param"]
    node.requires_grad = grad and outs[0].is_float and target not in _NO_GRAD_OPS and \
        any(s.requires_grad for s in srcs)
    keys = {_storage(b.vals[i]) for i in ins} - {None}
    first = val[0] if isinstance(val, (list, tuple)) else val
    node.flops, node.bytes = flops_and_bytes(node, [s.out for s in srcs],
                                             aliases_input=_storage(first) in keys)
    env[fx] = b.add(node, first)


def _dynamic_shape(fx: Any, e: RuntimeError) -> CaptureError:
    """The error for an exported op whose output shape depends on tensor values (boolean
    indexing, ``nonzero``, ``unique``, ...), naming the module and the user's line."""
    path, mtype = _module_of(fx)
    what = f"module '{path or '<root>'}' ({mtype})" if mtype else "the model"
    frames = re.findall(r'File "([^"]+)", line (\d+), in \w+\n\s*(.*)',
                        fx.meta.get("stack_trace") or "")
    line = ""
    if frames:
        fname, lineno, code = frames[-1]
        line = f" at {os.path.basename(fname)}:{lineno} (`{code.strip()}`)"
    target = str(fx.target).removeprefix("aten.")
    return CaptureError(f"cannot capture {what}{line}: {target} gives a tensor whose shape "
                        f"depends on tensor values ({type(e).__name__}: {first_line(e)}). "
                        f"Hint: autopar plans tensors of fixed shapes; compute with a mask "
                        f"(torch.where, or multiplying by the condition) instead of boolean "
                        f"indexing, nonzero or unique.")


def _inline(b: _Builder, fx: Any, env: dict, grad: bool) -> Any:
    """Inline a grad-mode or autocast region (the only higher-order ops non-strict export
    emits for plain models) and return its outputs."""
    hop = fx.target.name()
    if hop == "wrap_with_set_grad_enabled":
        at, enabled = 1, bool(fx.args[0])
    elif hop == "wrap_with_autocast":
        at, enabled = 4, grad
    else:
        path, mtype = _module_of(fx)
        raise CaptureError(f"cannot capture module '{path or '<root>'}' ({mtype}): it uses "
                           f"torch.{hop} (control flow or a wrapped region), which autopar "
                           "cannot plan through. Hint: make the forward straight-line code")
    sub = b.attrs[fx.args[at]]
    operands = [_resolve(a, env) for a in fx.args[at + 1:]]
    sub_env = dict(zip([n for n in sub.graph.nodes if n.op == "placeholder"], operands))
    return _walk(b, sub, sub.graph, sub_env, enabled)


def _normalized(fx: Any) -> list[Any]:
    """The node's arguments in its schema's order, keyword-only ones included and
    trailing defaults left out."""
    args = list(fx.args)
    if not fx.kwargs:
        return args
    if not isinstance(fx.target, torch._ops.OpOverload):
        return args + list(fx.kwargs.values())
    schema = fx.target._schema.arguments[len(args):]
    given = [k for k, a in enumerate(schema) if a.name in fx.kwargs]
    for a in schema[: (max(given) + 1) if given else 0]:
        args.append(fx.kwargs[a.name] if a.name in fx.kwargs else
                    (a.default_value if a.has_default_value() else None))
    return args


def _resolve(a: Any, env: dict) -> Any:
    if isinstance(a, torch.fx.Node):
        return env.get(a)
    if isinstance(a, (list, tuple)):
        return type(a)(_resolve(x, env) for x in a)
    return a


def _tensor_refs(args: Any, env: dict) -> list[str]:
    out: list[str] = []
    for a in args:
        if isinstance(a, (list, tuple)):
            out += _tensor_refs(a, env)
        elif isinstance(a, torch.fx.Node) and isinstance(env.get(a), _Ref):
            out.append(env[a].name)
    return out


def _render(a: Any, env: dict) -> Any:
    """JSON-friendly: tensors as "%name", lists as lists, torch enums as strings."""
    if isinstance(a, torch.fx.Node):
        v = env.get(a)
        return f"%{v.name}" if isinstance(v, _Ref) else (v if _is_scalar(v) else f"<{a.name}>")
    if isinstance(a, (list, tuple)):
        return [_render(x, env) for x in a]
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return _scalar(a)
    return str(a).removeprefix("torch.")


def _is_scalar(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float))


def _scalar(v: Any) -> Any:
    """A concrete Python value for a non-tensor FX value, when it has one."""
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        try:
            return type(v.node.hint)(v.node.hint) if v.node.hint is not None else None
        except (AttributeError, TypeError):
            return None
    return v if _is_scalar(v) else None


def _meta(v: Any) -> TensorMeta | None:
    if isinstance(v, torch.Tensor):
        return TensorMeta(tuple(int(s) for s in v.shape), str(v.dtype).removeprefix("torch."))
    return None


def _storage(v: Any) -> int | None:
    try:
        return v.untyped_storage()._cdata if isinstance(v, torch.Tensor) else None
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


def _strip(fqn: str) -> str:
    return fqn[len(WRAPPED) + 1:] if fqn.startswith(WRAPPED + ".") else fqn


def _module_of(fx: Any) -> tuple[str, str]:
    """(module path without the wrapper's prefix, class name) of the innermost module on
    the node's ``nn_module_stack``."""
    stack = fx.meta.get("nn_module_stack") or {}
    if not stack:
        return "", ""
    path, typ = list(stack.values())[-1]
    typ = typ.__name__ if isinstance(typ, type) else str(typ).rsplit(".", 1)[-1]
    path = str(path).removeprefix("L['self']").lstrip(".")
    path = "" if path == WRAPPED else _strip(path)
    return path, typ


def _param_names(model: nn.Module) -> tuple[dict[str, str], dict[str, list[str]],
                                             dict[str, bool]]:
    """(name -> canonical name, canonical name -> other names, name -> requires_grad) of
    every parameter and buffer; tied tensors are canonical under their first name."""
    by_id: dict[int, list[str]] = {}
    for n, t in chain(model.named_parameters(remove_duplicate=False),
                      model.named_buffers(remove_duplicate=False)):
        by_id.setdefault(id(t), []).append(n)
    canon = {n: names[0] for names in by_id.values() for n in names}
    aliases = {names[0]: names[1:] for names in by_id.values()}
    grads = {n: p.requires_grad for n, p in model.named_parameters(remove_duplicate=False)}
    return canon, aliases, grads
