"""Capture: a model and example inputs -> an annotated :class:`~autopar.graph.Graph`.

The model is wrapped with its training loss and captured by ``torch.export`` in
non-strict mode (the training IR, which keeps ``linear``, ``layer_norm``, ``rms_norm``,
``scaled_dot_product_attention``, ``cross_entropy_loss``, ``einsum`` ... as single
nodes). Capture works on ``meta`` tensors, so a 175B-parameter model captures without
allocating a weight; the model is put in training mode (and a Hugging Face model's
``config.use_cache`` off) for the capture and restored afterwards.

Fast path: a long list of blocks, identical from some block s on (the first few may
differ), is cut after block s+1 for the export, and the captured block s+1 is
replicated to the full depth
(:func:`autopar.layers.replicate_layers`); anything that does not check out falls back
to exporting the full model. ``Graph.fx`` then holds the program of the cut model.
"""

from __future__ import annotations

import contextlib
import io
import linecache
import logging
import operator
import os
import re
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autopar.errors import CaptureError
from autopar.flops import flops_and_bytes
from autopar.fx_patterns import FLATTEN, Flattened, flattened_cats, without_checks
from autopar.graph import Graph, OpNode, ParamInfo, TensorMeta
from autopar.layers import cut_lists, detect_layers, repeated_lists, replicate_layers
from autopar.masks import mark_causal_masks

WRAPPED = "model"


def default_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dim: LM logits (B, T, V) or class scores (B, C),
    computed in fp32 as trainers do."""
    return F.cross_entropy(output.flatten(0, -2).float(), targets.flatten())


def first_tensor(output: Any) -> torch.Tensor:
    """The logits of a model's output: a tensor, ``.logits`` / ``["logits"]`` of a
    Hugging Face ModelOutput or dict, or the first tensor of a tuple/list."""
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
                       "return the logits, or pass a loss_fn that takes the output as it is")


class LossWrapper(nn.Module):
    """``forward(*inputs[, targets]) = loss_fn(model(*inputs), targets)``.

    Without targets among the arguments it makes them in the graph (capture turns that
    creation op into a graph input): int64 zeros of shape ``logits.shape[:-1]`` (class
    targets) for the default loss; for a custom one, class targets when ``made`` is
    "class" and ``zeros_like(output)`` when it is "like". When that loss raises, the
    exception gets a note with the made targets' shape (read by :func:`_loss_failure`).
    """

    def __init__(self, model: nn.Module, loss_fn: Callable | None, has_targets: bool,
                 made: str = "class") -> None:
        super().__init__()
        setattr(self, WRAPPED, model)
        self.loss_fn = loss_fn
        self.has_targets = has_targets
        self.made = made

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        inputs, targets = (args[:-1], args[-1]) if self.has_targets else (args, None)
        out = getattr(self, WRAPPED)(*inputs)
        if self.loss_fn is not None:
            if targets is not None:
                return self.loss_fn(out, targets)
            targets = made_targets(first_tensor(out), self.made)
            try:
                return self.loss_fn(out, targets)
            except Exception as e:
                e.add_note(f"{_TARGETS_NOTE}{tuple(targets.shape)}")
                raise
        logits = first_tensor(out)
        if logits.dim() < 2 or not logits.is_floating_point():
            raise CaptureError(
                f"the default loss needs float logits of shape (..., classes), but the model "
                f"returned {tuple(logits.shape)} {str(logits.dtype).removeprefix('torch.')}; "
                "pass loss_fn (and example_targets) for this model")
        if targets is None:
            targets = made_targets(logits, "class")
        return default_loss(logits, targets)


def made_targets(logits: torch.Tensor, made: str) -> torch.Tensor:
    """Targets made up for a capture without example targets: int64 zeros of shape
    ``logits.shape[:-1]`` (``made="class"``) or ``zeros_like(logits)`` ("like")."""
    if made == "class":
        return torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return torch.zeros_like(logits)


# the targets a custom loss is tried with when none are given, in order, and their names
MADE_TARGETS = (("class", "int64 class targets"), ("like", "float targets shaped like the output"))
_TARGETS_NOTE = "autopar made up targets of shape "


class _LossFailure(CaptureError):
    """The export failed inside the loss function: ``reason`` is the exception in one
    line, ``targets`` " of shape (..)" of the made-up targets ('' when unknown)."""

    def __init__(self, message: str, reason: str, targets: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.targets = targets


def capture(model: nn.Module, example_inputs: torch.Tensor | tuple | list, *,
            loss_fn: Callable | None = None, example_targets: torch.Tensor | None = None,
            name: str | None = None, fast: bool = True) -> Graph:
    """Capture one training step's forward pass, the loss included, as a Graph.

    Args:
        model: the model, on any device (``meta`` plans without memory).
        example_inputs: a tensor or a tuple of tensors, the forward's positional inputs;
            dim 0 is the batch.
        loss_fn: ``loss_fn(output, targets) -> scalar``; default: cross-entropy over the
            output's last dim with int64 targets of shape ``output.shape[:-1]``.
        example_targets: the targets, one per sample (dim 0 is the batch). Without them
            the default loss gets int64 zeros of shape ``output.shape[:-1]``; a custom
            loss is tried with those (class targets) and then with
            ``zeros_like(output)``, the second export only when the first fails in the
            loss. They are a graph input.
        name: ``Graph.model_name`` (default: the model's class name).
        fast: capture long lists of identical blocks from their first two blocks.

    Raises:
        CaptureError: the model or inputs are not what capture needs, or torch.export
            cannot trace the forward (the message names the module, the line and why),
            or a custom loss fails with every kind of made-up targets.
    """
    if not isinstance(model, nn.Module):
        raise CaptureError(f"model must be a torch.nn.Module, got {type(model).__name__}; "
                           "wrap the function in an nn.Module whose forward calls it")
    inputs = _as_tuple(example_inputs)
    _check_targets(example_targets, inputs)
    inputs = _batch_of_two(inputs)
    if example_targets is not None:
        example_targets = _batch_of_two((example_targets,))[0]
    args = inputs + ((example_targets,) if example_targets is not None else ())
    label = name or type(model).__name__
    guessing = loss_fn is not None and example_targets is None
    failures: list[tuple[str, _LossFailure]] = []
    with _training_mode(model):
        for made, what in MADE_TARGETS if guessing else MADE_TARGETS[:1]:
            wrapper = LossWrapper(model, loss_fn, example_targets is not None, made)
            try:
                with _broadcast_targets_fail(guessing and made == "class"):
                    return _capture_with(model, wrapper, args, inputs, label, fast)
            except _LossFailure as e:
                if not guessing:
                    raise CaptureError(str(e)) from None
                failures.append((what, e))
    tried = "; ".join(f"with {what}{e.targets} it raised {e.reason}" for what, e in failures)
    raise CaptureError(f"cannot capture the loss function without example targets: {tried}. "
                       "Hint: pass example_targets, one global batch of the targets loss_fn "
                       "takes (e.g. example_targets=targets beside example_inputs)")


def _capture_with(model: nn.Module, wrapper: LossWrapper, args: tuple,
                  inputs: tuple[torch.Tensor, ...], label: str, fast: bool) -> Graph:
    """The Graph of ``wrapper``: the fast path when it works, else the full export."""
    g = _fast_capture(model, wrapper, args, inputs, label) if fast else None
    if g is None:
        g = to_graph(_export(wrapper, args, model), model, inputs, label)
        detect_layers(g)
    return g


@contextlib.contextmanager
def _broadcast_targets_fail(enabled: bool) -> Iterator[None]:
    """While made-up class targets are tried, torch's warning that a loss broadcasts its
    targets against the output (``F.mse_loss`` of (B, 1) and (B,)) is an error: such
    targets would capture a different computation, so float targets are tried next."""
    with warnings.catch_warnings():
        if enabled:
            warnings.filterwarnings("error", message="Using a target size", category=UserWarning)
        yield


def _check_targets(example_targets: Any, inputs: tuple[torch.Tensor, ...]) -> None:
    """``example_targets``: None, or a tensor with the inputs' batch size in dim 0."""
    if example_targets is None:
        return
    batch = int(inputs[0].shape[0])
    if not isinstance(example_targets, torch.Tensor) or example_targets.dim() == 0 or \
            example_targets.shape[0] != batch:
        got = (f"a tensor of shape {tuple(example_targets.shape)}"
               if isinstance(example_targets, torch.Tensor) else type(example_targets).__name__)
        raise CaptureError(f"example_targets must be a tensor whose dim 0 is the batch of "
                           f"example_inputs ({batch} samples), got {got}; pass the targets of "
                           "the same example batch, as loss_fn(output, targets) takes them")


def _fast_capture(model: nn.Module, wrapper: LossWrapper, args: tuple,
                  inputs: tuple[torch.Tensor, ...], label: str) -> Graph | None:
    """Export with long block lists cut to two blocks and replicate the second block;
    None when there is nothing to cut or anything does not check out."""
    lists = repeated_lists(model)
    if not lists:
        return None
    with cut_lists(lists) as used_len:
        try:
            with _quiet():
                ep = torch.export.export(wrapper, args, strict=False)
        except CaptureError:
            return None
        except Exception as e:  # noqa: BLE001 — any other failure: the full export reports it
            if _failure_site(e, model, wrapper)[2]:  # the loss fails however deep the model
                raise _loss_failure(e, model, wrapper) from None
            return None
    if used_len or any(s.kind.name == "CONSTANT_TENSOR" for s in ep.graph_signature.input_specs
                       for lst in lists
                       if str(s.target).startswith(f"{WRAPPED}.{lst.path}.")):
        return None
    g: Graph | None = to_graph(ep, model, inputs, label)
    detect_layers(g)
    for lst in lists:
        g = replicate_layers(g, lst.path, lst.count, lst.start) if g is not None else None
    return g


def _batch_of_two(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """A batch of one captured as a batch of two (the sample twice, contiguous, so that
    a forward that calls ``view`` on its input still can): with one sample a reshape
    such as (1, T, C) -> (1, T, H, D) cannot tell the batch dim from the unit dims, and
    the batch split would be lost. Costs are scaled from the captured batch to the
    planned one, so the plan is the same."""
    if tensors[0].shape[0] != 1:
        return tensors
    return tuple(t.expand(2, *t.shape[1:]).contiguous() if t.dim() and t.shape[0] == 1 else t
                 for t in tensors)


def _as_tuple(example_inputs: Any) -> tuple[torch.Tensor, ...]:
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) \
        else (example_inputs,)
    if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        kinds = ", ".join(type(t).__name__ for t in inputs) or "nothing"
        raise CaptureError(f"example_inputs must be a tensor or a tuple of tensors, got "
                           f"({kinds}); pass only the forward's tensor inputs, positionally, "
                           f"e.g. (token_ids,), and fix its other arguments (numbers, flags, "
                           f"keyword inputs) in a wrapper module whose forward takes only "
                           f"those tensors")
    if inputs[0].dim() == 0:
        raise CaptureError("the first example input is a 0-d tensor; capture reads the batch "
                           "size from its dim 0, so pass a batched input")
    return inputs


@contextlib.contextmanager
def _training_mode(model: nn.Module) -> Iterator[None]:
    """Training mode and no KV cache for the capture; the model's flags are restored."""
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.train()
        with kv_cache_off(model):
            yield
    finally:
        for m, mode in modes:
            m.training = mode


def cache_configs(model: nn.Module) -> list[Any]:
    """The Hugging Face configs in ``model`` whose key/value cache is on
    (``config.use_cache``): the root's and any submodule's (a model wrapped in the
    user's own module keeps its config below the root), each once."""
    seen: set[int] = set()
    out = []
    for m in model.modules():
        config = getattr(m, "config", None)
        if config is not None and id(config) not in seen and getattr(config, "use_cache", None):
            seen.add(id(config))
            out.append(config)
    return out


@contextlib.contextmanager
def kv_cache_off(model: nn.Module) -> Iterator[None]:
    """Every key/value cache of ``model`` (:func:`cache_configs`) off for the block,
    then on again. Training uses none, and a model that builds one is exported with
    its cache updates (whose constants also stop the fast capture)."""
    configs = cache_configs(model)
    for config in configs:
        config.use_cache = False
    try:
        yield
    finally:
        for config in configs:
            config.use_cache = True


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence torch's loggers and stderr while exporting: a failure is reported once,
    by CaptureError. What else was written to stderr is replayed on success."""
    saved = {}
    for lname, lg in list(logging.root.manager.loggerDict.items()):
        # loggers left at NOTSET follow "torch", so only the ones with a level are set
        if lname.split(".")[0] == "torch" and isinstance(lg, logging.Logger) and \
                (lname == "torch" or lg.level != logging.NOTSET):
            saved[lname] = lg.level
            lg.setLevel(logging.CRITICAL)
    buf = io.StringIO()
    ok = False
    try:
        with contextlib.redirect_stderr(buf):
            yield
        ok = True
    finally:
        for lname, level in saved.items():
            logging.getLogger(lname).setLevel(level)
        if ok and buf.getvalue():
            sys.stderr.write(buf.getvalue())


def _export(wrapper: LossWrapper, args: tuple, model: nn.Module) -> Any:
    try:
        with _quiet():
            return torch.export.export(wrapper, args, strict=False)
    except CaptureError as e:
        raise CaptureError(str(e)) from None
    except Exception as e:  # noqa: BLE001 — every failure becomes one clear message
        if _failure_site(e, model, wrapper)[2]:
            raise _loss_failure(e, model, wrapper) from None
        msg = explain_failure(e, model, wrapper)
    raise CaptureError(msg) from None


def _loss_failure(e: BaseException, model: nn.Module, wrapper: LossWrapper) -> _LossFailure:
    """The error of an export that failed inside the loss function."""
    notes = [n for n in getattr(e, "__notes__", []) if n.startswith(_TARGETS_NOTE)]
    shape = f" of shape {notes[-1].removeprefix(_TARGETS_NOTE)}" if notes else ""
    return _LossFailure(explain_failure(e, model, wrapper),
                        f"{type(e).__name__}: {_first_line(e)}", shape)


# --- the error message -------------------------------------------------------------------

_TORCH_DIR = os.path.dirname(torch.__file__)
_HERE = os.path.abspath(__file__)


def explain_failure(e: BaseException, model: nn.Module, wrapper: nn.Module | None = None) -> str:
    """One line saying where the capture failed (module and source line), why, and what
    to try, from an exception raised while exporting ``model``."""
    what, line, _ = _failure_site(e, model, wrapper)
    return f"cannot capture {what}{line}: {type(e).__name__}: {_first_line(e)}. " \
           f"Hint: {_hint(e, model)}."


def _first_line(e: BaseException) -> str:
    """The first line of the exception's message (at most 300 characters)."""
    text = str(e).strip()
    return text.splitlines()[0][:300].rstrip(". ") if text else "no message"


def _failure_site(e: BaseException, model: nn.Module,
                  wrapper: nn.Module | None) -> tuple[str, str, bool]:
    """(what failed: a module, the loss function or the model; " at file:line (`code`)"
    of the innermost user frame; whether it failed in the loss function)."""
    names = {id(m): n for n, m in model.named_modules()}
    module: nn.Module | None = None
    path: str | None = None
    in_loss = False
    line = ""
    for frame, lineno in traceback.walk_tb(e.__traceback__):
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            module, path, in_loss = owner, names[id(owner)], False
        elif wrapper is not None and owner is wrapper:
            in_loss = True
        fname = os.path.abspath(frame.f_code.co_filename)
        generated = frame.f_code.co_filename.startswith("<")
        if not generated and not fname.startswith(_TORCH_DIR) and fname != _HERE:
            code = linecache.getline(frame.f_code.co_filename, lineno).strip()
            line = f" at {os.path.basename(fname)}:{lineno} (`{code}`)" if code else \
                f" at {os.path.basename(fname)}:{lineno}"
    if in_loss and module is None:
        return "the loss function", line, True
    if module is not None:
        return f"module '{path or '<root>'}' ({type(module).__name__})", line, False
    return f"the model ({type(model).__name__})", line, False


def _hint(e: BaseException, model: nn.Module) -> str:
    t = f"{type(e).__name__} {e}".lower()
    if any(k in t for k in ("data-dependent", "datadependent", "data dependent", ".item()",
                            "_local_scalar_dense", "unbacked", "guardondatadependent")):
        return ("the forward branches on tensor values (data-dependent control flow); make "
                "the branch depend only on shapes or configuration (or use torch.cond), or "
                "pass example inputs that take the training path")
    if any(k in t for k in ("numpy", "data pointer", "tolist", "cannot access storage")):
        return ("the forward reads tensor values in Python (.numpy(), .tolist(), ...); keep "
                "that computation in torch operations")
    if isinstance(e, TypeError) and any(k in t for k in ("argument", "positional")):
        try:
            import inspect
            full = inspect.signature(model.forward)  # shown without its annotations
            sig = str(full.replace(
                parameters=[p.replace(annotation=p.empty) for p in full.parameters.values()],
                return_annotation=full.empty))
        except (TypeError, ValueError):
            sig = "(...)"
        return (f"example_inputs do not match forward{sig}; pass one tensor per positional "
                "argument, as a tuple in the forward's order")
    if "same device" in t or "expected all tensors to be on" in t:
        return ("build the model and the example inputs on the same device (both on 'meta' "
                "to plan without memory)")
    if "scalar type" in t or "indices" in t or "expected tensor for argument" in t:
        return "check the example inputs' dtypes: token ids must be int64 (torch.long)"
    if any(k in t for k in ("shape", "size mismatch", "cannot be multiplied", "dimension",
                            "must match the size", "reduction dim", "same size")):
        return "check the example inputs' shapes: they must be what the forward expects"
    if "unsupported" in t or isinstance(e, NotImplementedError):
        return ("the forward uses a construct or operator torch.export cannot trace; rewrite "
                "it with standard torch operations")
    return ("torch.export (non-strict) could not trace that code; rewrite it with standard "
            "torch operations, or try torch.export.export on that module to see the full "
            "trace")


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
    b.nodes = without_checks(b.nodes, [r.name for r in _flat(out) if isinstance(r, _Ref)])
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


def _flat(a: Any) -> list[Any]:
    return [y for x in a for y in _flat(x)] if isinstance(a, (list, tuple)) else [a]


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
                        f"depends on tensor values ({type(e).__name__}: {_first_line(e)}). "
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
