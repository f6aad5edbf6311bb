"""Capture: a model and example inputs -> an annotated :class:`~autopar.graph.Graph`.

The model is wrapped with its loss and captured by ``torch.export`` (non-strict, the
training IR, which keeps ``linear``, ``layer_norm``, ``scaled_dot_product_attention``
and ``cross_entropy_loss`` as single nodes). It works on ``meta`` tensors, so a
175B-parameter model captures without allocating a weight.
"""

from __future__ import annotations

import operator
import sys
import traceback
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from autopar.errors import CaptureError
from autopar.flops import flops_and_bytes
from autopar.graph import Graph, OpNode, ParamInfo, TensorMeta
from autopar.layers import detect_layers

WRAPPED = "model"


def default_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dim: LM logits (B, T, V) or class scores (B, C)."""
    return F.cross_entropy(output.flatten(0, -2).float(), targets.flatten())


def first_tensor(output: Any) -> torch.Tensor:
    """The logits of a model's output: a tensor, the first tensor of a tuple/list, or
    ``.logits`` / ``["logits"]`` of a Hugging Face ModelOutput or dict."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, dict):
        logits = output.get("logits")
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)):
        for o in output:
            if isinstance(o, torch.Tensor):
                return o
    raise CaptureError(f"the model returned {type(output).__name__}, which holds no tensor; "
                       "return logits, or pass loss_fn that takes the output as it is")


class LossWrapper(nn.Module):
    """``forward(*inputs, targets) = loss_fn(model(*inputs), targets)``."""

    def __init__(self, model: nn.Module, loss_fn: Callable | None) -> None:
        super().__init__()
        setattr(self, WRAPPED, model)
        self.loss_fn = loss_fn

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        *inputs, targets = args
        out = getattr(self, WRAPPED)(*inputs)
        if self.loss_fn is None:
            return default_loss(first_tensor(out), targets)
        return self.loss_fn(out, targets)


def _as_tuple(example_inputs: Any) -> tuple[torch.Tensor, ...]:
    inputs = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        kinds = ", ".join(type(t).__name__ for t in inputs) or "nothing"
        raise CaptureError(f"example_inputs must be a tensor or a tuple of tensors (got {kinds}); "
                           "pass the model's positional inputs, e.g. (token_ids,)")
    return tuple(inputs)


def _example_targets(model: nn.Module, inputs, loss_fn) -> torch.Tensor:
    with torch.no_grad():
        out = model(*inputs)
    if loss_fn is not None:
        return torch.zeros_like(first_tensor(out))
    logits = first_tensor(out)
    if logits.dim() < 2 or not logits.is_floating_point():
        raise CaptureError(f"the default loss needs float logits of shape (..., classes), got "
                           f"{tuple(logits.shape)} {logits.dtype}; pass loss_fn and targets")
    return torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)


def _failing_module(model: nn.Module, tb) -> str | None:
    names = {id(m): n for n, m in model.named_modules()}
    found = None
    for frame, _ in traceback.walk_tb(tb):
        self_obj = frame.f_locals.get("self")
        if isinstance(self_obj, nn.Module) and id(self_obj) in names:
            found = names[id(self_obj)] or "<root>"
    return found


def _export(wrapper: LossWrapper, args: tuple, model: nn.Module):
    try:
        return torch.export.export(wrapper, args, strict=False)
    except Exception as e:  # noqa: BLE001 — every failure becomes one clear message
        where = _failing_module(model, sys.exc_info()[2])
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        text = str(e).lower()
        if "data-dependent" in text or "guard" in text or "symbool" in text:
            hint = ("the forward branches on tensor values (data-dependent control flow); "
                    "make the branch depend only on shapes or configuration")
        else:
            hint = "rewrite that code with standard torch operations, or simplify the forward"
        mod = f"module '{where}' ({type(dict(model.named_modules())[where if where != '<root>' else ''] ).__name__})" \
            if where is not None else "the model"
        raise CaptureError(f"cannot capture {mod}: {type(e).__name__}: {first}. "
                           f"Hint: {hint}.") from None


def capture(model: nn.Module, example_inputs: Any, *, loss_fn: Callable | None = None,
            example_targets: torch.Tensor | None = None, name: str | None = None) -> Graph:
    """Capture one training step's forward pass (the loss included) as a Graph."""
    if not isinstance(model, nn.Module):
        raise CaptureError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    inputs = _as_tuple(example_inputs)
    targets = example_targets if example_targets is not None else _example_targets(
        model, inputs, loss_fn)
    wrapper = LossWrapper(model, loss_fn)
    ep = _export(wrapper, inputs + (targets,), model)
    return _to_graph(ep, model, inputs, name or type(model).__name__)


def _tensor_meta(v: Any) -> TensorMeta | None:
    if isinstance(v, torch.Tensor):
        return TensorMeta(tuple(int(s) for s in v.shape), str(v.dtype).removeprefix("torch."))
    return None


def _render(a: Any, kept: set[str]) -> Any:
    if isinstance(a, torch.fx.Node):
        return f"%{a.name}" if a.name in kept else str(a.name)
    if isinstance(a, (list, tuple)):
        return [_render(x, kept) for x in a]
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    return str(a).removeprefix("torch.")


def _tensor_inputs(args: Any, kept: set[str]) -> list[str]:
    out: list[str] = []
    for a in args:
        if isinstance(a, torch.fx.Node) and a.name in kept:
            out.append(a.name)
        elif isinstance(a, (list, tuple)):
            out += _tensor_inputs(a, kept)
    return out


def _module_of(node: torch.fx.Node) -> tuple[str, str]:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", ""
    path, typ = list(stack.values())[-1]
    typ = typ if isinstance(typ, str) else getattr(typ, "__name__", str(typ))
    prefix = "L['self']." if path.startswith("L['self']") else ""
    path = path[len(prefix):] if prefix else path
    if path == WRAPPED:
        path = ""
    elif path.startswith(WRAPPED + "."):
        path = path[len(WRAPPED) + 1:]
    return path, typ.rsplit(".", 1)[-1]


def _to_graph(ep, model: nn.Module, inputs, name: str) -> Graph:
    sig = {s.arg.name: s for s in ep.graph_signature.input_specs if hasattr(s.arg, "name")}
    strip = lambda fqn: fqn[len(WRAPPED) + 1:] if fqn.startswith(WRAPPED + ".") else fqn  # noqa
    alias = _aliases(model)
    nodes: list[OpNode] = []
    params: dict[str, ParamInfo] = {}
    kept: set[str] = set()
    grad: dict[str, bool] = {}
    user_inputs: list[str] = []
    loss = ""
    by_name: dict[str, OpNode] = {}
    for fx in ep.graph.nodes:
        val = fx.meta.get("val")
        if fx.op == "placeholder":
            spec = sig.get(fx.name)
            kind = str(getattr(spec, "kind", "")).rsplit(".", 1)[-1]
            meta = _tensor_meta(val)
            if kind in ("PARAMETER", "BUFFER", "CONSTANT_TENSOR"):
                fqn = strip(str(spec.target))
                if not fx.users:
                    continue  # a tied duplicate: recorded as an alias of the one used
                trainable = kind == "PARAMETER"
                params[fqn] = ParamInfo(fqn, meta, fqn.rpartition(".")[0], trainable,
                                        [a for a in alias.get(fqn, []) if a != fqn])
                nodes.append(OpNode(fx.name, "param", fqn, out=meta, requires_grad=trainable))
                by_name[fx.name] = nodes[-1]
                grad[fx.name] = trainable
            else:
                nodes.append(OpNode(fx.name, "input", fx.name, out=meta))
                by_name[fx.name] = nodes[-1]
                user_inputs.append(fx.name)
                grad[fx.name] = False
            kept.add(fx.name)
            continue
        if fx.op == "output":
            outs = [a for a in fx.args[0] if isinstance(a, torch.fx.Node)]
            loss = outs[0].name if outs else ""
            continue
        if fx.op != "call_function":
            continue
        metas = [m for m in (val if isinstance(val, (list, tuple)) else [val])]
        outs = [m for m in (_tensor_meta(v) for v in metas) if m is not None]
        if not outs:
            continue
        target = "getitem" if fx.target is operator.getitem else str(fx.target)
        ins = _tensor_inputs(list(fx.args) + list(fx.kwargs.values()), kept)
        path, mtype = _module_of(fx)
        node = OpNode(fx.name, "op", target, ins, _render(list(fx.args), kept), outs[0], outs,
                      module_path=path, module_type=mtype)
        node.params = [by_name[i].target for i in ins if by_name[i].kind == "param"]
        node.requires_grad = any(grad.get(i, False) for i in ins) and outs[0].is_float
        grad[fx.name] = node.requires_grad
        in_metas = [by_name[i].out for i in ins]
        node.flops, node.bytes = flops_and_bytes(node, in_metas)
        nodes.append(node)
        by_name[fx.name] = node
        kept.add(fx.name)
    seq = None
    if inputs and inputs[0].dim() == 2 and not inputs[0].is_floating_point():
        seq = int(inputs[0].shape[1])
    g = Graph(nodes, params, [], {}, user_inputs, loss, int(inputs[0].shape[0]), seq, name, ep)
    detect_layers(g)
    return g


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    by_id: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(fqn)
    return {n: names for names in by_id.values() for n in names}
