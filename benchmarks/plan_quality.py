"""Plan quality: the planner's plan beside a hand-tuned configuration, same cost model.

Each row is a configuration that experts chose by hand for a large training run, kept
as data in ``reference_configs.json`` beside this file (the published fields, with each
group's source): Megatron-LM's GPT runs (Narayanan et al., SC'21, Table 1),
Megatron-LM with sequence parallelism and selective recomputation (Korthikanti et al.
2022, each model with full recomputation and with SP + selective recomputation),
torchtitan's Llama 3.1 runs (H100, December 2024) and Megatron-Core's mixture-of-experts
benchmarking configurations (H100: Mixtral 8x7B and 8x22B, DeepSeek-V3). For each row,
in a fresh process:

* the reference: ``autopar.estimate`` with the row's ``Spec`` (its degrees, micro-batch,
  schedule, recomputation, ZeRO stage and sequence parallelism; the intra-op layout
  within those degrees is still the solver's best);
* the plan: ``autopar.plan`` on the same cluster, global batch, precision and optimizer,
  with its whole search space but ``torch.compile`` (the reference is scored eager, so
  the plan is too);
* ratio = reference step time / plan step time (above 1: the plan is faster).

::

    python benchmarks/plan_quality.py [--json rows.json] [--only megatron-1.7b]

How the published configurations map onto a ``Spec`` (one function per source:
``_megatron``, ``_korthikanti``, ``_titan``):

* Megatron-LM (A100 80GB, fp16, Adam): dp = GPUs / (TP x PP), ZeRO-0, no sequence
  parallelism, full recomputation of every block, the listed micro-batch; v = 1 is
  ``1f1b``, v > 1 ``interleaved_1f1b`` with v model chunks per device.
* Korthikanti et al. (same hardware): TP 8, no data parallelism, ``interleaved_1f1b``
  with 3 chunks per device for 175B and 530B (plain ``1f1b`` for 1T); one row with full
  recomputation and no sequence parallelism, one with SP + selective recomputation.
  The 22B model is not in the zoo; it is built here from ``GPTConfig`` with its listed
  shape (64 heads, hidden 6144, 48 layers; vocabulary 51,200, sequence 2,048).
* torchtitan (H100 SXM, bf16, AdamW): FSDP2 is ZeRO-3 over dp = the FSDP degree; TP
  runs with sequence parallelism (torchtitan's default). torchtitan's *local batch* is
  the samples per data-parallel rank per step, so the global batch is local batch x
  FSDP degree. Without a pipeline it is one micro-batch (micro-batch size = local
  batch). With PP, torchtitan at that date (commit 9dec370, 2024-12-26) cut the local
  batch into as many micro-batches as the PP degree (``pipeline_parallel_microbatches``
  defaulted to it until torchtitan PR #781, 2025-01-07), so 405B runs 8 micro-batches
  of 4 under both schedules; its interleaved 1F1B put 2 stages on each rank. The
  ``h100-sxm`` profile is the 80 GB SXM part; torchtitan's runs had 96 GB H100s.
* Megatron-Core MoE (H100, bf16, AdamW): dp = GPUs / (TP x PP) with the experts split
  over EP of those ranks (``Spec(ep=)``); the distributed optimizer is ZeRO-1; VPP > 1
  is ``interleaved_1f1b`` with VPP chunks. The runs configure no recomputation, which
  autopar's pipeline planner does not fit in 80 GB for Mixtral 8x7B (74 GB predicted
  at the stage split, and no split found under the budget), so the recomputation is
  the solver's choice within each configuration (``rc solver``).
  The zoo's DeepSeek-V3 writes its latent attention as grouped-query attention, and
  both routers drop tokens past a capacity factor of 1.25, where Megatron-Core's run
  dropless: the rows compare layouts, not those models' exact costs.

The planning time reported is the wall time of ``autopar.plan`` (capture included).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from published_accuracy import estimate_any_memory
from search_time import run_cases

REFERENCE_CONFIGS = Path(__file__).with_name("reference_configs.json")
GPT_22B = "gpt-22b"  # Korthikanti's 22B: not in the zoo, built by build_model


@dataclass(frozen=True)
class Row:
    """One hand-tuned configuration: the model, the cluster and the reference Spec."""

    name: str
    source: str
    model: str
    gpu: str
    gpus: int
    global_batch: int
    tp: int
    pp: int
    microbatch_size: int
    recompute: str | None  # None: the solver's choice within the row's configuration
    zero: int = 0
    sequence_parallel: bool = False
    virtual_stages: int = 1
    precision: str = "fp16"
    optimizer: str = "adam"
    gpus_per_node: int = 8
    ep: int = 1
    model_args: tuple[int, int, int] | None = None  # (layers, dim, heads) of a model
    # built here from GPTConfig; None: a zoo model

    @classmethod
    def from_dict(cls, d: dict) -> "Row":
        """The row written by ``asdict`` (and through JSON, which makes tuples lists)."""
        args = d.get("model_args")
        return cls(**{**d, "model_args": tuple(args) if args is not None else None})

    @property
    def dp(self) -> int:
        """Data-parallel degree: the devices left over by TP x PP."""
        return self.gpus // (self.tp * self.pp)

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per data-parallel rank per step."""
        return self.global_batch // (self.dp * self.microbatch_size)

    @property
    def schedule(self) -> str | None:
        """The pipeline schedule (None without a pipeline)."""
        if self.pp == 1:
            return None
        return "1f1b" if self.virtual_stages == 1 else "interleaved_1f1b"

    def describe(self) -> str:
        """The reference configuration in one short line."""
        return _describe(self.dp, self.tp, self.pp, self.microbatch_size,
                         self.num_microbatches, self.zero, self.schedule,
                         self.virtual_stages, self.sequence_parallel, self.recompute, self.ep)


def _megatron(c: dict, source: str) -> tuple[Row, ...]:
    """One SC'21 configuration: its row."""
    return (Row(f"megatron-{c['parameters'].lower()}", source, c["model"], "a100-80g",
                c["gpus"], c["global_batch"], c["tensor_parallel"], c["pipeline_parallel"],
                c["micro_batch"], "full", virtual_stages=c["interleaving_chunks"]),)


def _korthikanti(c: dict, source: str) -> tuple[Row, ...]:
    """One Korthikanti et al. configuration: its full-recomputation row and its SP +
    selective-recomputation row."""
    name = f"korthikanti-{c['parameters'].lower()}"
    shape = (c["layers"], c["hidden_size"], c["attention_heads"])
    common = dict(source=source, model=c["model"], gpu="a100-80g", gpus=c["gpus"],
                  global_batch=c["global_batch"], tp=c["tensor_parallel"],
                  pp=c["pipeline_parallel"], microbatch_size=c["micro_batch"],
                  virtual_stages=c["interleaving_chunks"],
                  model_args=shape if c["model"] == GPT_22B else None)
    return (Row(f"{name}-full", recompute="full", **common),
            Row(f"{name}-sp-selective", recompute="selective", sequence_parallel=True,
                **common))


def _titan(c: dict, source: str) -> tuple[Row, ...]:
    """One torchtitan run: its row (global batch = local batch x FSDP degree)."""
    tp, pp, local = c["tensor_parallel"], c["pipeline_parallel"], c["local_batch"]
    mb = local // pp if pp > 1 else local  # PP: as many micro-batches as stages
    return (Row(c["name"], source, c["model"], "h100-sxm", c["gpus"], local * c["fsdp"],
                tp, pp, mb, c["activation_checkpointing"], zero=3,
                sequence_parallel=tp > 1, virtual_stages=c["stages_per_rank"] or 1,
                precision="bf16", optimizer="adamw"),)


def _mcore_moe(c: dict, source: str) -> tuple[Row, ...]:
    """One Megatron-Core MoE benchmarking configuration: its row (EP inside DP, as
    Megatron-Core places it; the distributed optimizer is ZeRO-1)."""
    return (Row(c["name"], source, c["model"], "h100-sxm", c["gpus"], c["global_batch"],
                c["tensor_parallel"], c["pipeline_parallel"], c["micro_batch"], None,
                zero=1, sequence_parallel=c["tensor_parallel"] > 1,
                virtual_stages=c["virtual_pipeline"], precision="bf16", optimizer="adamw",
                ep=c["expert_parallel"]),)


_MAPPINGS = {"megatron": _megatron, "korthikanti": _korthikanti, "torchtitan": _titan,
             "megatron_moe": _mcore_moe}


def rows(path: Path = REFERENCE_CONFIGS) -> tuple[Row, ...]:
    """Every configuration of ``reference_configs.json``, in its order, as rows."""
    sources = json.loads(path.read_text())["sources"]
    return tuple(row for key, group in sources.items()
                 for c in group["configurations"]
                 for row in _MAPPINGS[key](c, group["label"]))


def _describe(dp: int, tp: int, pp: int, mb: int, m: int, zero: int, schedule: str | None,
              v: int, sp: bool, recompute: str | None, ep: int = 1, cp: int = 1) -> str:
    pipe = f"pp{pp} {schedule}" + (f" v{v}" if v > 1 else "") + " " if pp > 1 else ""
    return (f"{pipe}dp{dp}{f' ep{ep}' if ep > 1 else ''}{f' cp{cp}' if cp > 1 else ''} "
            f"tp{tp}{' sp' if sp else ''} mb{mb}x{m} zero{zero} rc {recompute or 'solver'}")


def describe_plan(plan) -> str:
    """A plan's configuration in the same short form as :meth:`Row.describe`; the
    recomputation lists each mode with its number of blocks when they differ."""
    modes = [plan.recompute.get(b, "none") for b in plan.blocks]
    kinds = sorted(set(modes))
    rc = kinds[0] if len(kinds) == 1 else "/".join(f"{k}:{modes.count(k)}" for k in kinds)
    pipe = plan.pipeline
    return _describe(plan.data_parallel, plan.degree("tp"), plan.degree("pp"),
                     plan.microbatch_size, plan.num_microbatches, plan.zero,
                     pipe.schedule if pipe else None, pipe.virtual_stages if pipe else 1,
                     plan.sequence_parallel, rc or "none", plan.expert_ranks, plan.degree("cp"))


def build_model(row: Row):
    """The row's model on ``meta`` and its example inputs (a batch of two sequences)."""
    import torch

    from autopar.examples import zoo
    from autopar.examples.gpt import GPT, GPTConfig

    if row.model_args is None:
        return zoo.get(row.model, batch_size=2, seq_len=None)
    layers, dim, heads = row.model_args
    cfg = GPTConfig(vocab_size=51200, max_seq_len=2048, dim=dim, n_layers=layers,
                    n_heads=heads)
    with torch.device("meta"):
        return GPT(cfg), (torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len)),)


def spec_of(row: Row):
    """The row's hand-written configuration as an ``autopar.Spec``."""
    import autopar

    return autopar.Spec(dp=row.dp, tp=row.tp, pp=row.pp, ep=row.ep,
                        microbatch_size=row.microbatch_size, schedule=row.schedule,
                        virtual_stages=row.virtual_stages, recompute=row.recompute,
                        zero=row.zero, sequence_parallel=row.sequence_parallel)


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"


def measure(row: Row) -> dict:
    """Score the reference and plan the row in this process; the step times, their
    ratio, both configurations and the wall time of each call (an error in either is
    reported in ``reference_error`` / ``plan_error`` instead of its numbers). A
    reference that does not fit the profile's memory is priced without a memory limit
    and flagged (``reference_over_budget``: the error saying by how much), so its ratio
    compares against a configuration the plan was not allowed."""
    import autopar

    model, inputs = build_model(row)
    cluster = autopar.Cluster(row.gpu, row.gpus // row.gpus_per_node, row.gpus_per_node)
    kw = dict(cluster=cluster, global_batch=row.global_batch, precision=row.precision,
              optimizer=row.optimizer)
    out: dict = {"reference": row.describe()}
    t0 = time.perf_counter()
    try:
        ref, over = estimate_any_memory(model, inputs, spec_of(row), **kw)
        if over is not None:
            out["reference_over_budget"] = _error(over)
        out.update(reference_step_s=ref.step_time_s, reference_mfu=ref.mfu,
                   reference_memory_gib=ref.memory.get("total", 0.0) / 2**30)
    except Exception as e:  # noqa: BLE001 — reported in the row
        out["reference_error"] = _error(e)
    out["estimate_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    try:
        plan = autopar.plan(model, inputs, compile=False, **kw)  # eager, as scored
        out.update(plan=describe_plan(plan), plan_step_s=plan.step_time_s, plan_mfu=plan.mfu,
                   plan_memory_gib=plan.memory.get("total", 0.0) / 2**30,
                   candidates=plan.solver.get("candidates"))
    except Exception as e:  # noqa: BLE001
        out["plan_error"] = _error(e)
    out["plan_s"] = time.perf_counter() - t0
    if "reference_step_s" in out and "plan_step_s" in out:
        out["ratio"] = out["reference_step_s"] / out["plan_step_s"]
    return out


def _num(r: dict, key: str, width: int, fmt: str) -> str:
    return f"{r[key]:{width}{fmt}}" if key in r else f"{'-':>{width}}"


def _line(r: dict) -> str:
    """One table row; a failed call's error follows the two configurations."""
    errors = "; ".join(f"{k}: {r[k]}" for k in ("reference_error", "plan_error", "error")
                       if k in r)
    over = "*" if "reference_over_budget" in r else " "
    return (f"{r['name']:<32} {r['gpus']:>5} {_num(r, 'reference_step_s', 9, '.3f')}{over}"
            f"{_num(r, 'plan_step_s', 9, '.3f')} {_num(r, 'ratio', 6, '.3f')} "
            f"{_num(r, 'plan_s', 6, '.1f')}  {r.get('reference', '?')}  ->  "
            f"{r.get('plan', '?')}" + (f"\n    FAILED {errors}" if errors else ""))


def summary(results: list[dict]) -> str:
    """How many rows the plan wins, ties and loses, and the mean ratio, over the rows
    whose reference fits in memory (``*``: priced without a memory limit, not compared)."""
    ratios = [r["ratio"] for r in results if "ratio" in r and "reference_over_budget" not in r]
    if not ratios:
        return "no row scored both configurations"
    slower = sum(q < 1 - 1e-9 for q in ratios)
    faster = sum(q > 1 + 1e-9 for q in ratios)
    return (f"{len(ratios)} rows compared: plan faster in {faster}, equal in "
            f"{len(ratios) - faster - slower}, slower in {slower}; ratio min "
            f"{min(ratios):.3f}, geometric mean {statistics.geometric_mean(ratios):.3f}, "
            f"max {max(ratios):.3f}; {len(results) - len(ratios)} rows not compared")


def main() -> int:
    """Run every row in a fresh interpreter, print the table and the summary."""
    header = (f"{'row':<32} {'GPUs':>5} {'ref s':>9} {'plan s':>9} {'ratio':>6} "
              f"{'plan t':>6}  reference -> plan")
    results = run_cases(__doc__, __file__, rows(),
                        child=lambda d: measure(Row.from_dict(d)),
                        matches=lambda row, only: only in (row.name, row.model),
                        line=_line, header=header)
    if results:
        print(summary(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
