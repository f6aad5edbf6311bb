"""What the emitted program needs to know about the user's model beyond the plan
(:class:`ModelFacts`), read by :func:`model_facts` from a ``meta`` (or CPU) build."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from autopar.errors import ConfigError, FactoryError
from autopar.loader import load
from autopar.runtime.tensor_parallel import tied_parameter_groups

__all__ = ["ModelFacts", "model_facts", "sample_shape"]


@dataclass(frozen=True)
class ModelFacts:
    """What the program needs to know about the model beyond the plan (read from a
    ``meta`` instance at generation time, or a CPU one where the factory cannot run on
    meta).

    Attributes:
        model: the model, on the meta device (or the CPU, see ``note``).
        tied: parameter names sharing one tensor, first owner first.
        input_shape: one sample's shape of the first example input (synthetic data).
        input_is_tokens: whether that input holds integer token ids.
        num_classes: the token vocabulary (first Embedding) or the last Linear's outputs.
        note: why the model was built on the CPU ('' when on meta).
    """

    model: nn.Module
    tied: list[list[str]]
    input_shape: tuple[int, ...]
    input_is_tokens: bool
    num_classes: int
    note: str = ""


def model_facts(model_spec: str) -> ModelFacts:
    """Build ``path/to/file.py:factory`` on the meta device and read its facts; a
    factory whose own code cannot run there (example data made on a real device) is
    built again on the CPU, and ``note`` says so."""
    note = ""
    try:
        with torch.device("meta"):
            model, inputs = load(model_spec)
    except FactoryError as e:
        model, inputs = load(model_spec)
        note = f"{e}; read the model from a CPU build instead"
    x = inputs[0]
    tokens = not torch.is_floating_point(x)
    layer = nn.Embedding if tokens else nn.Linear
    found = [m for m in model.modules() if isinstance(m, layer)]
    if not found:
        raise ConfigError(f"{model_spec}: cannot tell the number of classes for synthetic data "
                          f"(no {layer.__name__} in the model)")
    m = found[0] if tokens else found[-1]
    classes = m.num_embeddings if isinstance(m, nn.Embedding) else m.out_features
    return ModelFacts(model=model, tied=tied_parameter_groups(model),
                      input_shape=tuple(x.shape[1:]), input_is_tokens=tokens,
                      num_classes=int(classes), note=note)


def sample_shape(plan, facts: ModelFacts) -> tuple[int, ...]:
    """One sample's shape the program exports its stages for and makes synthetic data
    of: that of the plan's first input where the plan records it (a pipeline's stages
    are cut for the shapes it was planned for), else the factory's example's."""
    if plan.inputs and plan.inputs[0].get("shape"):
        return tuple(int(d) for d in plan.inputs[0]["shape"][1:])
    return facts.input_shape
