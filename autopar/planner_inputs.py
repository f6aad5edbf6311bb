"""The planner's checks of what it is given, each failing with one message that says
what is wrong and what to try: the memory budget, the search options, the global
batch, the heads a forced tp must divide, the experts an ep must divide, the
context-parallel variants a sequence allows and the pipeline's depth."""

from __future__ import annotations

import math
from typing import Any

from autopar.errors import ConfigError
from autopar.spec import Spec

__all__ = ["attention_heads", "batch_of", "check_heads", "check_imbalance", "expert_folding",
           "check_pipeline_depth", "check_search_options", "cp_variants", "expert_count",
           "global_batch", "memory_budget_bytes", "positive_number"]


def memory_budget_bytes(memory_budget: float | None, hw) -> float:
    """The memory budget per device in bytes: ``memory_budget``, or the GPU's memory
    less the profile's reserve when it is None."""
    if memory_budget is None:
        return float(hw.usable_memory_bytes)
    if not positive_number(memory_budget):
        raise ConfigError(f"memory_budget={memory_budget!r}: expected a positive number of "
                          f"bytes per device, e.g. 40e9 (None: the GPU's memory less the "
                          f"profile's reserve)")
    return float(memory_budget)


def positive_number(value: Any) -> bool:
    """Whether ``value`` is a finite number above 0 (not a bool, NaN or infinity)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value) and value > 0


def check_search_options(time_limit_s: Any, loss_fn: Any) -> None:
    """``time_limit_s`` is None or a finite number of seconds, 0 or more (0: the first
    plan found); ``loss_fn`` is None or callable."""
    if time_limit_s is not None and not (positive_number(time_limit_s) or (
            type(time_limit_s) in (int, float) and time_limit_s == 0)):
        raise ConfigError(f"time_limit_s={time_limit_s!r}: expected a number of seconds, 0 or "
                          f"more (None: search until the best plan is proven)")
    if loss_fn is not None and not callable(loss_fn):
        raise ConfigError(f"loss_fn={loss_fn!r}: expected a function loss_fn(output, targets) "
                          f"returning a scalar tensor (None: cross-entropy over the output's "
                          f"last dim)")


def batch_of(example_inputs: Any) -> int:
    """The batch size of ``example_inputs``: dim 0 of its first tensor."""
    import torch

    if isinstance(example_inputs, dict):
        raise ConfigError(f"example_inputs is a dict ({', '.join(map(str, example_inputs))}): "
                          f"keyword inputs are not captured; pass the forward's inputs "
                          f"positionally, as a tuple in its order, or wrap the model in a "
                          f"module whose forward takes them positionally")
    if isinstance(example_inputs, (tuple, list)) and not example_inputs:
        raise ConfigError("example_inputs is empty; pass one global batch of the forward's "
                          "positional inputs, e.g. (token_ids,)")
    first = example_inputs[0] if isinstance(example_inputs, (tuple, list)) else example_inputs
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        got = "a 0-d tensor" if isinstance(first, torch.Tensor) else type(first).__name__
        raise ConfigError(f"example_inputs must be a tensor or a tuple of tensors whose first "
                          f"dim is the batch, but its first input is {got}; pass one global "
                          f"batch of the forward's positional inputs, e.g. (token_ids,)")
    return int(first.shape[0])


def global_batch(global_batch: int | None, example_inputs: Any) -> int:
    """``global_batch``, or the batch of ``example_inputs`` when it is None."""
    gb = global_batch if global_batch is not None else batch_of(example_inputs)
    if not isinstance(gb, int) or gb < 1:
        raise ConfigError(f"global_batch={global_batch!r}: expected a positive integer")
    return gb


def attention_heads(graph) -> int | None:
    """The greatest common divisor of every attention's head count (None: no attention)."""
    counts = [n.out.shape[-3] for n in graph.nodes
              if n.target.startswith("aten.scaled_dot_product_attention") and n.out is not None
              and len(n.out.shape) >= 3]
    return math.gcd(*counts) if counts else None


def check_heads(graph, tp: int) -> None:
    """A forced tensor-parallel degree must divide every attention's head count."""
    if tp <= 1:
        return
    for n in graph.nodes:
        if n.target.startswith("aten.scaled_dot_product_attention") and n.out is not None \
                and len(n.out.shape) >= 3:
            heads = n.out.shape[-3]
            if heads % tp:
                raise ConfigError(
                    f"tensor-parallel degree tp={tp} does not divide the {heads} attention heads "
                    f"of module '{n.module_path}'; choose tp among "
                    f"{[d for d in range(1, heads + 1) if heads % d == 0]}")


def check_imbalance(value: Any) -> None:
    """``expert_imbalance`` must be a number of at least 1."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 1:
        raise ConfigError(f"expert_imbalance={value!r}: expected a number of at least 1 (the "
                          f"busiest expert-parallel rank's tokens over the mean; 1 = even)")


def expert_folding(an, expert_tp: int | None) -> bool | None:
    """Whether the candidates fold the experts over tp (the ``fold`` of
    :func:`~autopar.solvers.search_space.candidates`): never without expert modules or
    with one that is not routed (fed tokens, expert indices and weights: the only kind
    whose ops run on whichever tokens reach a rank), always with ``expert_tp=1``, else
    (None) as the solver finds best. ``expert_tp=1`` on a model that cannot fold them
    raises ConfigError."""
    kinds = {path: em.kind for path, em in an.experts.items()}
    other = sorted(p for p, k in kinds.items() if k != "routed")
    if expert_tp == 1 and (other or not kinds):
        what = (f"'{other[0]}' runs its experts as a {kinds[other[0]]} module" if other else
                "the model has no expert modules")
        raise ConfigError(f"expert_tp=1 folds routed experts (a module fed tokens, expert "
                          f"indices and weights) over dp x tp, but {what}; leave expert_tp "
                          f"out")
    if other or not kinds or (expert_tp is not None and expert_tp > 1):
        return False
    return True if expert_tp == 1 else None


def expert_count(an, ep: int | None) -> int:
    """How many experts every expert module of the analysed graph has in common (their
    gcd; 0 without any), checked against an ``ep`` asked for."""
    counts = [em.experts for em in an.experts.values()]
    common = math.gcd(*counts) if counts else 0
    if ep is not None and ep > 1:
        if not counts:
            from autopar.strategies.experts import expert_lists, refused_gathered

            lists = expert_lists(an.graph)
            if lists:
                path, n = next(iter(sorted(lists.items())))
                raise ConfigError(
                    f"ep={ep}: the experts of '{path}' are a list of {n} modules, each run "
                    f"on its own in the forward; expert parallelism splits experts stacked "
                    f"in one module (one weight of shape (experts, ...) per projection, as "
                    f"transformers 5's MoE layers and autopar.examples.moe hold them). "
                    f"Stack them, or leave ep out: data, tensor and pipeline parallelism "
                    f"still split these layers")
            refused = refused_gathered(an.graph, an.rules, an.batch_label, an.output_ops,
                                       an.batch_dim)
            if refused:
                path, why = next(iter(sorted(refused.items())))
                raise ConfigError(
                    f"ep={ep}: '{path}' runs every expert on every token, a gate combining "
                    f"them, but {why}; expert parallelism cannot split it so. Change that, "
                    f"or leave ep out: data, tensor and pipeline parallelism still split it")
            raise ConfigError(f"ep={ep}: the model has no expert modules (a module whose "
                              f"parameters stack one weight per expert, run per expert); "
                              f"leave ep out for a dense model")
        if common % ep:
            raise ConfigError(f"ep={ep} does not divide the {common} experts of the model's "
                              f"mixture-of-experts layers; choose an ep that divides {common}")
    return common


def cp_variants(an, spec: Spec) -> tuple[str, ...]:
    """The context-parallel variants the search may try on the analysed graph: those
    of :data:`~autopar.cost_models.context_parallel.SEARCHED_VARIANTS`, every one when
    ``cp_variant`` asks for the ring, or none where the sequence cannot be split
    (ConfigError naming where, when ``cp`` > 1 was asked for, or a sequence 2·cp does
    not divide)."""
    from autopar.cost_models.context_parallel import SEARCHED_VARIANTS, VARIANTS

    seq = an.sequence
    asked = spec.cp is not None and spec.cp > 1
    if seq is None or not seq.splittable:
        if asked:
            raise ConfigError(f"cp={spec.cp}: {seq.refusal if seq else 'no sequence'}")
        return ()
    if asked and (spec.pp or 1) > 1 and seq.masked:
        raise ConfigError(f"cp={spec.cp} with pp={spec.pp}: the model's attention reads a "
                          f"mask its code builds from positions (a Hugging Face model's, "
                          f"traced), which a pipeline stage would compute from each rank's "
                          f"share of the sequence; leave pp or cp out")
    if asked and seq.length % (2 * spec.cp):
        raise ConfigError(f"cp={spec.cp} cuts each sequence into {2 * spec.cp} head-tail "
                          f"chunks (equal causal work per rank), which do not divide "
                          f"{seq.length} tokens; choose a cp that divides {seq.length // 2}")
    return VARIANTS if spec.cp_variant == "ring" else SEARCHED_VARIANTS


def check_pipeline_depth(pp: int | None, num_blocks: int) -> None:
    """Pipelining needs a pipeline unit per stage: the repeated blocks and what comes
    before and after them."""
    if pp is not None and pp > 1 and pp > num_blocks + 2:
        raise ConfigError(f"pp={pp} needs at least {pp} pipeline units but the model has "
                          f"{num_blocks} repeated blocks (+ what comes before and after "
                          f"them); choose pp <= {num_blocks + 2}")
