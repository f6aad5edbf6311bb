"""The message of a failed capture: one line saying where it failed (the module and the
user's source line), why, and what to try."""

from __future__ import annotations

import inspect
import linecache
import os
import traceback

import torch
from torch import nn

_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN = frozenset(os.path.join(os.path.dirname(os.path.abspath(__file__)), f)
                 for f in ("capture.py", "capture_errors.py", "export_graph.py"))
"""autopar's own capture code, whose frames are not the user's line."""


def explain_failure(e: BaseException, model: nn.Module, wrapper: nn.Module | None = None) -> str:
    """One line saying where the capture failed (module and source line), why, and what
    to try, from an exception raised while exporting ``model``."""
    what, line, _ = failure_site(e, model, wrapper)
    return f"cannot capture {what}{line}: {type(e).__name__}: {first_line(e)}. " \
           f"Hint: {hint(e, model)}."


def first_line(e: BaseException) -> str:
    """The first line of the exception's message (at most 300 characters)."""
    text = str(e).strip()
    return text.splitlines()[0][:300].rstrip(". ") if text else "no message"


def failure_site(e: BaseException, model: nn.Module,
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
        if not generated and not fname.startswith(_TORCH_DIR) and fname not in _OWN:
            code = linecache.getline(frame.f_code.co_filename, lineno).strip()
            line = f" at {os.path.basename(fname)}:{lineno} (`{code}`)" if code else \
                f" at {os.path.basename(fname)}:{lineno}"
    if in_loss and module is None:
        return "the loss function", line, True
    if module is not None:
        return f"module '{path or '<root>'}' ({type(module).__name__})", line, False
    return f"the model ({type(model).__name__})", line, False


def hint(e: BaseException, model: nn.Module) -> str:
    """What to try for the exception ``e`` raised while exporting ``model``."""
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
