"""The options that name a search space (one per field of :class:`autopar.Spec`),
shared by ``autopar plan``, ``compare`` and ``train``: :func:`add_spec_args` defines
them, :func:`spec_from_args` reads them back, :func:`spec_argv` writes a Spec as
them again (what ``autopar train`` hands each torchrun rank); and ``--memory-budget``
(:func:`add_memory_budget_arg`). Imports no torch."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from autopar.errors import ConfigError

if TYPE_CHECKING:
    from autopar.spec import Spec

__all__ = ["ESTIMATE_DEFAULTS", "add_memory_budget_arg", "add_spec_args", "parse_bytes",
           "spec_argv", "spec_from_args"]


ESTIMATE_DEFAULTS = {"dp": "the devices the other degrees leave", "tp": "1", "pp": "1",
                     "cp": "1", "cp_variant": "allgather", "ep": "1",
                     "expert_tp": "the solver's choice",
                     "microbatch_size": "the largest that gives pp micro-batches",
                     "schedule": "1f1b", "virtual_stages": "the solver's choice",
                     "recompute": "the solver's choice", "zero": "0",
                     "sequence_parallel": "off", "loss_parallel": "the solver's choice",
                     "split_weights": "the solver's choice", "offload": "off",
                     "compile": "off"}
"""What ``autopar compare`` scores for each configuration option left out
(:meth:`autopar.Spec.for_estimate`)."""


def add_spec_args(g: argparse._ActionsContainer,
                  defaults: dict[str, str] | None = None) -> None:
    """One option per field of :class:`autopar.Spec`, by the field's name; each left out
    is None, which the help calls ``defaults[field]`` (default: the solver's choice).
    The values are checked by Spec itself."""
    from autopar.plans import RECOMPUTE, SCHEDULES

    g = _DefaultsNoted(g, defaults or {})

    g.add_argument("--dp", type=int, help="data-parallel degree")
    g.add_argument("--tp", type=int, help="tensor-parallel degree")
    g.add_argument("--pp", type=int, help="pipeline-parallel degree")
    g.add_argument("--cp", type=int, help="context-parallel degree: each sequence split over "
                   "cp ranks")
    g.add_argument("--cp-variant", metavar="{allgather,ring,ulysses}",
                   help="how attention reaches the keys of the other cp ranks")
    g.add_argument("--ep", type=int, help="expert-parallel degree: the experts split over ep "
                   "of the dp ranks (ep divides dp), or of dp x tp with --expert-tp 1")
    g.add_argument("--expert-tp", type=int, help="ranks splitting each expert: tp (as the "
                   "rest of the model) or 1 (whole experts, ep folded over dp x tp, as "
                   "Megatron-Core's expert tensor parallelism 1)")
    g.add_argument("--microbatch-size", "--microbatch", type=int, dest="microbatch_size",
                   help="samples per forward/backward pass on one data-parallel rank")
    g.add_argument("--schedule", metavar="{" + ",".join(SCHEDULES) + "}",
                   help="pipeline schedule")
    g.add_argument("--virtual-stages", type=int, help="model chunks per pipeline rank")
    g.add_argument("--recompute", metavar="{" + ",".join(RECOMPUTE) + "}",
                   help="recomputation of every block")
    g.add_argument("--zero", type=int, metavar="{0,1,2,3}", help="ZeRO stage")
    g.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction,
                   help="norms and pointwise ops on sequence shards (with tp)")
    g.add_argument("--loss-parallel", action=argparse.BooleanOptionalAction,
                   help="the loss on logits split along the vocabulary over tp (with tp)")
    g.add_argument("--split-weights", action=argparse.BooleanOptionalAction,
                   help="every weight matrix of the repeated blocks split over tp, as "
                   "Megatron-LM's tensor parallelism (with tp)")
    g.add_argument("--offload", action=argparse.BooleanOptionalAction,
                   help="parameters, gradients and optimizer state in host memory (with "
                   "--zero 3)")
    g.add_argument("--compile", action=argparse.BooleanOptionalAction,
                   help="each repeated block compiled with torch.compile (plans without a "
                   "pipeline; left out: on the GPUs where it was measured faster)")


class _DefaultsNoted:
    """An argument group whose ``add_argument`` appends ``(default: ...)`` to the help:
    the text for the option's field in ``defaults``, else the solver's choice."""

    def __init__(self, group: argparse._ActionsContainer, defaults: dict[str, str]) -> None:
        self.group, self.defaults = group, defaults

    def add_argument(self, *names: str, **kwargs) -> argparse.Action:
        """``group.add_argument`` with the default named in the help."""
        field = kwargs.get("dest") or names[0].lstrip("-").replace("-", "_")
        text = self.defaults.get(field, "the solver's choice")
        kwargs["help"] = f"{kwargs.get('help', '')} (default: {text})".lstrip()
        return self.group.add_argument(*names, **kwargs)


def spec_from_args(args: argparse.Namespace) -> Spec:
    """The :class:`autopar.Spec` named by the options of :func:`add_spec_args`."""
    from dataclasses import fields

    from autopar.spec import Spec

    return Spec(**{f.name: getattr(args, f.name) for f in fields(Spec)})


def spec_argv(spec: Spec) -> list[str]:
    """The options of :func:`add_spec_args` that give ``spec`` back (its fields left
    None are left out): ``Spec(tp=2, sequence_parallel=False)`` -> ``["--tp", "2",
    "--no-sequence-parallel"]``."""
    from dataclasses import fields

    out: list[str] = []
    for f in fields(spec):
        value, name = getattr(spec, f.name), "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            out.append(name if value else "--no-" + name[2:])
        elif value is not None:
            out += [name, str(value)]
    return out


def parse_bytes(text: str) -> float:
    """``"40GB"`` -> 4e10, ``"80GiB"`` -> 80·2^30, a plain number is bytes."""
    m = re.fullmatch(r"\s*([0-9]+\.?[0-9]*|\.[0-9]+)\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ConfigError(f"memory size {text!r} is not like '40GB', '80GiB' or a byte count")
    value, unit = float(m.group(1)), (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return value * scale


def _option_value(parse: Callable[[str], float]) -> Callable[[str], float]:
    """``parse`` for an argparse ``type=``: its ConfigError becomes argparse's own error
    line (``argument --memory-budget: memory size '40XB' is not like ...``)."""

    def parsed(text: str) -> float:
        try:
            return parse(text)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parsed.__name__ = parse.__name__
    return parsed


def add_memory_budget_arg(p: argparse._ActionsContainer) -> None:
    """``--memory-budget``: bytes per device the plan may use, as ``40GB``."""
    p.add_argument("--memory-budget", type=_option_value(parse_bytes),
                   help="per device, e.g. 40GB (default: the GPU's memory less the "
                        "profile's reserve)")
