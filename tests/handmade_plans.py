"""Plans written by hand for the runtime tests: the Megatron-LM layout of the zoo's
transformers, with optional sequence parallelism, vocabulary parallelism and ZeRO-3.

Styles are assigned by module name, the way one writes a torchtitan TP plan:

* q/k/v/fc1 and wq/wk/wv/w1/w3 are ``colwise`` with output ``S(-1)`` (heads or hidden
  features split), proj/fc2 and wo/w2 ``rowwise`` with output ``R``; an attention
  whose head count ``tp`` does not divide keeps all its projections ``replicate``;
* the token embedding is ``rowwise`` (vocabulary-parallel) and the output head
  ``colwise`` with a replicated output, or both ``replicate``; a position embedding
  is ``replicate``;
* norms are ``replicate``, or ``sequence_parallel`` on ``S(1)`` activations, where
  activations between blocks are split along the sequence: the embeddings hand on
  ``S(1)`` (``S(0)`` for the position table, whose dim 0 is the sequence), colwise
  modules read ``S(1)`` and compute on ``R``, rowwise modules hand on ``S(1)``; an
  attention module gathers its input to ``R`` once (its q/k/v then read ``R``), as
  it reads the sequence length from its input.

Every parameter gets its placements in ``plan.params``: on ``tp`` from the style's
table below, on ``dp`` ``S(0)`` under ZeRO-3 and ``R`` otherwise. ``recompute`` (one
mode for every block, or block path -> mode) fills ``plan.recompute``, ``offload``
``plan.offload``.
"""

from __future__ import annotations

from torch import nn

from autopar.plans import ModulePlan, PipelinePlan, Plan, StagePlan

COLWISE = {"q", "k", "v", "fc1", "wq", "wk", "wv", "w1", "w3"}
ROWWISE = {"proj", "fc2", "wo", "w2"}
TOKEN_EMBEDDINGS = {"tok_emb"}
HEADS = {"head", "output"}
NORMS = (nn.LayerNorm, nn.RMSNorm)

# (module class, style) -> tp placement of the parameters the style splits
SPLIT = {
    ("Linear", "colwise"): {"weight": "S(0)", "bias": "S(0)"},
    ("Linear", "rowwise"): {"weight": "S(1)", "bias": "R"},
    ("Embedding", "colwise"): {"weight": "S(1)"},
    ("Embedding", "rowwise"): {"weight": "S(0)"},
}


def _heads_split(parent: nn.Module, tp: int) -> bool:
    """Whether every projection of an attention module splits into whole heads over tp."""
    head_dim = getattr(parent, "head_dim", None)
    if not isinstance(head_dim, int):
        return True
    return all(m.out_features // head_dim % tp == 0 for name, m in parent.named_children()
               if isinstance(m, nn.Linear) and name in COLWISE)


def module_plan(path: str, module: nn.Module, parent: nn.Module | None, *, tp: int,
                sp: bool, vocab_parallel: bool, loss_parallel: bool = False) -> ModulePlan:
    """The hand-written ModulePlan of one module that owns parameters (the head's
    logits left split along the vocabulary under ``loss_parallel``)."""
    name = path.rpartition(".")[2]
    seq = "S(1)" if sp else "R"
    kind = type(module).__name__
    if isinstance(module, NORMS):
        return ModulePlan(path, kind, "sequence_parallel", seq, seq, seq) if sp else \
            ModulePlan(path, kind)
    if name in TOKEN_EMBEDDINGS:
        return ModulePlan(path, kind, "rowwise" if vocab_parallel else "replicate", "R", "R", seq)
    if isinstance(module, nn.Embedding):  # position table: (seq, dim), its dim 0 is the sequence
        return ModulePlan(path, kind, "replicate", "R", "R", "S(0)" if sp else "R")
    if name in HEADS:
        return ModulePlan(path, kind, "colwise" if vocab_parallel else "replicate", seq, "R",
                          "S(-1)" if loss_parallel else "R")
    split = tp > 1 and parent is not None and _heads_split(parent, tp)
    if name in COLWISE:  # an attention gathers the sequence itself (see attention_plan)
        src = "R" if isinstance(getattr(parent, "head_dim", None), int) else seq
        return ModulePlan(path, kind, "colwise" if split else "replicate", src, "R",
                          "S(-1)" if split else "R")
    if name in ROWWISE:
        return ModulePlan(path, kind, "rowwise", "S(-1)", "S(-1)", seq) if split else \
            ModulePlan(path, kind, "replicate", "R", "R", seq)
    return ModulePlan(path, kind)


def attention_plan(path: str, module: nn.Module) -> ModulePlan:
    """Under sequence parallelism, an attention module (one with ``head_dim``) reads
    the sequence length from its input, so it gathers its input to ``R`` itself."""
    return ModulePlan(path, type(module).__name__, "replicate", "S(1)", "R", "S(1)")


def block_paths(model: nn.Module) -> list[str]:
    """Paths of the repeated layers: the children of every ModuleList."""
    return [f"{path}.{i}" for path, m in model.named_modules() if isinstance(m, nn.ModuleList)
            for i in range(len(m))]


def megatron_plan(model: nn.Module, *, dp: int = 1, tp: int = 1, zero: int = 0,
                  sequence_parallel: bool = False, vocab_parallel: bool = True,
                  global_batch: int = 8, num_microbatches: int = 1,
                  precision: str = "fp32", recompute: str | dict[str, str] = "none",
                  offload: bool = False, loss_parallel: bool = False) -> Plan:
    """A hand-written plan for ``model`` on a ``{"dp": dp, "tp": tp}`` mesh;
    ``recompute`` is one mode for every block or a block path -> mode table;
    ``loss_parallel``: the loss on the head's vocabulary-split logits."""
    modules: dict[str, ModulePlan] = {}
    for path, m in model.named_modules():
        if any(True for _ in m.parameters(recurse=False)):
            parent = model.get_submodule(path.rpartition(".")[0]) if path else None
            modules[path] = module_plan(path, m, parent, tp=tp, sp=sequence_parallel,
                                        vocab_parallel=vocab_parallel,
                                        loss_parallel=loss_parallel)
        elif sequence_parallel and isinstance(getattr(m, "head_dim", None), int):
            modules[path] = attention_plan(path, m)
    params: dict[str, list[str]] = {}
    for fqn, _ in model.named_parameters(remove_duplicate=False):
        path, _, local = fqn.rpartition(".")
        mp = modules[path]
        on_tp = SPLIT.get((mp.module_type, mp.style), {}).get(local, "R")
        on_dp = "S(0)" if zero == 3 and dp > 1 else "R"
        params[fqn] = [on_dp, on_tp]
        mp.params[local] = [on_dp, on_tp]
    blocks = block_paths(model)
    return Plan(model=type(model).__name__, graph_hash="handmade", cluster={},
                mesh={"dp": dp, "tp": tp}, global_batch=global_batch,
                microbatch_size=global_batch // (dp * num_microbatches),
                num_microbatches=num_microbatches, zero=zero,
                sequence_parallel=sequence_parallel, precision=precision, optimizer="sgd",
                params=params, modules=modules, blocks=blocks,
                recompute=recompute_table(blocks, recompute), offload=offload,
                loss_parallel=loss_parallel)


def recompute_table(blocks: list[str], recompute: str | dict[str, str]) -> dict[str, str]:
    """``plan.recompute`` from one mode for every block or a table (returned as is);
    blocks without recomputation are left out."""
    if isinstance(recompute, dict):
        return dict(recompute)
    return {} if recompute == "none" else {b: recompute for b in blocks}


def unit_paths(model: nn.Module) -> tuple[list[str], list[str], list[str]]:
    """The pipeline units of a model whose top-level children run in the order they
    are registered: the children before its ModuleList of blocks, each block, the
    children after it."""
    before: list[str] = []
    blocks: list[str] = []
    after: list[str] = []
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList):
            blocks += [f"{name}.{i}" for i in range(len(child))]
        else:
            (after if blocks else before).append(name)
    return before, blocks, after


def pipeline_stages(model: nn.Module, pp: int, schedule: str,
                    virtual_stages: int) -> list[StagePlan]:
    """Stages over the model's units: the blocks split evenly (earlier stages take
    the extra ones), the units before them on the first stage, after them on the
    last; ranks as the schedule places them."""
    before, blocks, after = unit_paths(model)
    n = pp * virtual_stages
    if len(blocks) < n:
        raise ValueError(f"{len(blocks)} blocks cannot fill {n} stages")
    sizes = [len(blocks) // n + (i < len(blocks) % n) for i in range(n)]
    stages, start = [], 0
    for i, size in enumerate(sizes):
        units = (before if i == 0 else []) + blocks[start:start + size] + \
            (after if i == n - 1 else [])
        rank = (i if i < pp else n - 1 - i) if schedule == "zbv" else i % pp
        stages.append(StagePlan(index=i, rank=rank, units=units))
        start += size
    return stages


def pipeline_plan(model: nn.Module, *, pp: int, dp: int = 1, tp: int = 1,
                  schedule: str = "1f1b", virtual_stages: int | None = None,
                  num_microbatches: int | None = None, global_batch: int = 8,
                  **megatron: object) -> Plan:
    """A hand-written pipelined plan on a ``{"pp": pp, "dp": dp, "tp": tp}`` mesh:
    :func:`megatron_plan`'s layout inside each stage (``megatron`` passes zero,
    sequence_parallel, vocab_parallel, precision, recompute, offload on),
    :func:`pipeline_stages` across them. ``virtual_stages`` defaults to 2 for the interleaved schedules and
    zbv, else 1; ``num_microbatches`` to the number of stages."""
    v = virtual_stages or (2 if schedule.startswith("interleaved") or schedule == "zbv" else 1)
    n = num_microbatches or pp * v
    plan = megatron_plan(model, dp=dp, tp=tp, global_batch=global_batch, num_microbatches=n,
                         **megatron)  # type: ignore[arg-type]
    plan.mesh = {"pp": pp, "dp": dp, "tp": tp}
    plan.pipeline = PipelinePlan(schedule=schedule, virtual_stages=v,
                                 stages=pipeline_stages(model, pp, schedule, v))
    return plan
