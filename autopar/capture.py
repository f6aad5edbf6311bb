"""Capture: a model and example inputs -> an annotated :class:`~autopar.graph.Graph`.

The model is wrapped with its training loss and captured by ``torch.export`` in
non-strict mode (the training IR, which keeps ``linear``, ``rms_norm``,
``scaled_dot_product_attention``, ``cross_entropy_loss`` ... as single nodes), on
``meta`` tensors when the model is, in training mode with a Hugging Face model's KV
cache off. Fast path: a long list of identical blocks is cut after two for the export
and the captured block replicated to the full depth
(:func:`autopar.layers.replicate_layers`); ``Graph.fx`` then holds the cut model's
program. The program becomes a Graph in :mod:`autopar.export_graph`; a failed export,
one clear message in :mod:`autopar.capture_errors`.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autopar.capture_errors import explain_failure, failure_site, first_line
from autopar.errors import CaptureError
from autopar.export_graph import WRAPPED, to_graph
from autopar.graph import Graph
from autopar.layers import (cut_lists, detect_layers, repeated_lists, replicate_layers,
                            restored_modules)


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
    with restored_modules(model), cut_lists(lists) as used_len:
        try:
            with _quiet():
                ep = torch.export.export(wrapper, args, strict=False)
        except CaptureError:
            return None
        except Exception as e:  # noqa: BLE001 — any other failure: the full export reports it
            if failure_site(e, model, wrapper)[2]:  # the loss fails however deep the model
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
        if failure_site(e, model, wrapper)[2]:
            raise _loss_failure(e, model, wrapper) from None
        msg = explain_failure(e, model, wrapper)
    raise CaptureError(msg) from None


def _loss_failure(e: BaseException, model: nn.Module, wrapper: LossWrapper) -> _LossFailure:
    """The error of an export that failed inside the loss function."""
    notes = [n for n in getattr(e, "__notes__", []) if n.startswith(_TARGETS_NOTE)]
    shape = f" of shape {notes[-1].removeprefix(_TARGETS_NOTE)}" if notes else ""
    return _LossFailure(explain_failure(e, model, wrapper),
                        f"{type(e).__name__}: {first_line(e)}", shape)
