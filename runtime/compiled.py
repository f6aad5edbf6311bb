"""torch.compile of a lowered model, block by block.

As torchtitan's ``apply_compile`` does, each of the plan's repeated blocks
(``plan.blocks``, the units recomputation and FSDP2 wrap) is compiled in place with
:meth:`torch.nn.Module.compile` after tensor parallelism and activation checkpointing and
before ``fully_shard``, so the compiled region is one block's forward and backward and
FSDP2's hooks stay outside it. Every block of a transformer has the same code, so dynamo
traces one and reuses it (a recompilation only where shapes differ).
"""

from __future__ import annotations

import logging

from torch import nn

from autopar.errors import ConfigError
from autopar.plans import Plan
from autopar.runtime.applied import LOGGER


def compile_blocks(model: nn.Module, plan: Plan) -> list[str]:
    """Compile each of ``plan.blocks`` that ``model`` contains, in place; return their
    paths. Raises ConfigError when the plan names no block the model has (compiling
    the whole model would put FSDP2's root hooks inside the compiled region)."""
    done = []
    for path in plan.blocks:
        try:
            block = model.get_submodule(path)
        except AttributeError:
            continue  # a pipeline stage holds only some of the blocks
        block.compile()
        done.append(path)
    if not done:
        raise ConfigError("compile=True compiles the plan's repeated blocks (plan.blocks), "
                          "and this plan has none in the model; leave compile off, or "
                          "compile the model's own submodules yourself before parallelize")
    logging.getLogger(LOGGER).info("compiled %d block(s) with torch.compile: %s", len(done),
             done[0] if len(done) == 1 else f"{done[0]} ... {done[-1]}")
    return done
