"""The emitted program's import block: exactly the imports of the names its code uses
(:func:`import_block`), from one table of what provides each name."""

from __future__ import annotations

import io
import tokenize
from types import MappingProxyType

__all__ = ["import_block"]

_IMPORTS = MappingProxyType({  # name used in the program -> the import that provides it
    "argparse": "import argparse", "functools": "import functools",
    "datetime": "import datetime", "json": "import json", "shutil": "import shutil",
    "importlib": "import importlib.util", "os": "import os", "time": "import time",
    "Path": "from pathlib import Path", "Any": "from typing import Any",
    "Callable": "from typing import Callable", "NamedTuple": "from typing import NamedTuple",
    "torch": "import torch", "dist": "import torch.distributed as dist",
    "dcp": "import torch.distributed.checkpoint as dcp", "F": "import torch.nn.functional as F",
    "nn": "from torch import nn", "fx": "from torch import fx", "contextlib": "import contextlib",
    "re": "import re", "operator": "import operator", "sys": "import sys",
    "warnings": "import warnings",
    "fc": "import torch.distributed._functional_collectives as fc",
    "torch_loss": "import torch.distributed.tensor.parallel.loss as torch_loss",
})
_FROM = MappingProxyType({  # name -> module, for `from module import a, b`
    "Iterator": "collections.abc", "Mapping": "collections.abc",
    "Collection": "collections.abc", "Sequence": "collections.abc",
    "get_state_dict": "torch.distributed.checkpoint.state_dict",
    "set_state_dict": "torch.distributed.checkpoint.state_dict",
    "DeviceMesh": "torch.distributed.device_mesh",
    "init_device_mesh": "torch.distributed.device_mesh",
    "CPUOffloadPolicy": "torch.distributed.fsdp", "MixedPrecisionPolicy": "torch.distributed.fsdp",
    "fully_shard": "torch.distributed.fsdp", "DTensor": "torch.distributed.tensor",
    "all_to_all_single_autograd": "torch.distributed._functional_collectives",
    "Placement": "torch.distributed.tensor", "Replicate": "torch.distributed.tensor",
    "Shard": "torch.distributed.tensor", "distribute_module": "torch.distributed.tensor",
    "Partial": "torch.distributed.tensor", "distribute_tensor": "torch.distributed.tensor",
    "register_sharding": "torch.distributed.tensor.experimental",
    "TorchDispatchMode": "torch.utils._python_dispatch",
    "TorchFunctionMode": "torch.overrides",
    "tree_flatten": "torch.utils._pytree", "tree_map": "torch.utils._pytree",
    "ColwiseParallel": "torch.distributed.tensor.parallel",
    "ParallelStyle": "torch.distributed.tensor.parallel",
    "PrepareModuleInput": "torch.distributed.tensor.parallel",
    "RowwiseParallel": "torch.distributed.tensor.parallel",
    "SequenceParallel": "torch.distributed.tensor.parallel",
    "parallelize_module": "torch.distributed.tensor.parallel",
    "PipelineStage": "torch.distributed.pipelining",
    "Schedule1F1B": "torch.distributed.pipelining",
    "ScheduleGPipe": "torch.distributed.pipelining",
    "ScheduleInterleaved1F1B": "torch.distributed.pipelining",
    "ScheduleInterleavedZeroBubble": "torch.distributed.pipelining",
    "ScheduleZBVZeroBubble": "torch.distributed.pipelining",
    "CheckpointPolicy": "torch.utils.checkpoint", "checkpoint": "torch.utils.checkpoint",
    "create_selective_checkpoint_contexts": "torch.utils.checkpoint",
    "ConstantArgument": "torch.export.graph_signature",
    "InputKind": "torch.export.graph_signature", "OutputKind": "torch.export.graph_signature",
    "TensorArgument": "torch.export.graph_signature",
})


def _names(code: str) -> set[str]:
    """The names ``code`` refers to (not attributes, strings or comments)."""
    names, prev = set(), ""
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if tok.type == tokenize.NAME and prev != ".":
            names.add(tok.string)
        if tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT):
            prev = tok.string
    return names


def import_block(code: str) -> str:
    """The import block for exactly the names ``code`` uses (stdlib, then torch)."""
    used = _names(code) & (set(_IMPORTS) | set(_FROM))
    std = sorted(_IMPORTS[n] for n in used if n in _IMPORTS and not _IMPORTS[n].startswith(
        ("import torch", "from torch")))
    plain = sorted((_IMPORTS[n] for n in used if n in _IMPORTS and _IMPORTS[n] not in std),
                   key=lambda s: (s.startswith("from"), s))
    modules: dict[str, list[str]] = {}
    for n in sorted((n for n in used if n in _FROM), key=lambda n: (not n[0].isupper(), n)):
        modules.setdefault(_FROM[n], []).append(n)
    froms = []
    for mod in sorted(modules):
        line = f"from {mod} import {', '.join(modules[mod])}"
        if len(line) > 99:
            line = f"from {mod} import (\n    " + ",\n    ".join(modules[mod]) + ",\n)"
        (froms if mod.startswith("torch") else std).append(line)
    std = sorted(std, key=lambda s: (s.startswith("from"), s))
    return "\n".join(std) + "\n\n" + "\n".join(plain + froms)
