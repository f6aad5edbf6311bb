"""Which ops the runtime can run on local tensors under tensor parallelism, for pricing.

The runtime runs a module on local tensors, DTensor only at its edges, when every
parameter under it belongs to a colwise or a rowwise Linear
(:func:`autopar.runtime.tensor_parallel.local_regions`): an attention or a feed-forward
network under the Megatron-LM layout. Which Linears are colwise and rowwise is the
solver's choice, so the pricer knows only the modules that *can* be regions
(:func:`region_candidates`): the outermost modules, not the root, whose parameters all
belong to two or more Linears, none tied to a parameter outside, no expert module
inside. Each op under one is priced as it runs there
(:meth:`autopar.cost_models.strategy_price.StrategyPricer.dtensor_host`).
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.graph import Graph


@dataclass(frozen=True)
class Region:
    """A module that can run on local tensors: its ``path``, how many ops of the graph
    it holds and how many Linears."""

    path: str
    ops: int
    linears: int


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".")


def region_candidates(g: Graph, expert_paths: frozenset[str] = frozenset()) -> dict[str, Region]:
    """Each op under a module that can be a local-tensor region -> that region (module
    docstring); ``expert_paths``: the paths of the graph's expert modules."""
    types = {n.module_path: n.module_type for n in g.nodes if n.kind == "op"}
    linears = {p for p, t in types.items() if t == "Linear"}
    params = [(info.module_path, bool(info.aliases)) for info in g.params.values()
              if not info.buffer]
    ancestors = sorted({".".join(p.split(".")[:i]) for p in linears
                        for i in range(1, p.count(".") + 1)}, key=lambda a: a.count("."))
    chosen: list[Region] = []
    for a in ancestors:
        if any(_under(a, r.path) for r in chosen):
            continue
        inside = [(owner, tied) for owner, tied in params if _under(owner, a)]
        owners = {o for o, _ in inside}
        if len(owners) < 2 or any(t for _, t in inside) or not owners <= linears or \
                any(_under(e, a) for e in expert_paths):
            continue
        ops = sum(1 for n in g.nodes if n.kind == "op" and _under(n.module_path, a))
        chosen.append(Region(a, ops, len(owners)))
    out: dict[str, Region] = {}
    for n in g.nodes:
        if n.kind == "op":
            for r in chosen:
                if _under(n.module_path, r.path):
                    out[n.name] = r
                    break
    return out
