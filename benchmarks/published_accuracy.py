"""Published accuracy: ``autopar.estimate`` beside the step times of published runs.

Each row of ``published_runs.json`` (architecture, cluster, parallel configuration and
the measured figure, with its source) is built from autopar's own model classes on
``meta``, mapped onto a ``Spec`` and priced in a fresh process; the published figure is
converted to seconds per step (:func:`published_step_s`) and the error is
predicted / published - 1 (float8 runs priced with precision ``fp8``). Rows that cannot
be priced (an unsupported layout, a
batch not stated) are listed with the reason. Mappings and formulas: the docstrings of
:func:`spec_of`, :func:`build_model` and :func:`flops_per_token`.

::

    python benchmarks/published_accuracy.py [--json OUT] [--only ID] [--source NAME]
        [--jobs N] [--md OUT.md]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RUNS = Path(__file__).with_name("published_runs.json")
RESULTS = Path(__file__).with_name("results")
UNBOUNDED_BYTES = 1e15  # a memory budget no plan reaches: prices a run as it ran
EXAMPLE_SEQUENCES = 2  # example batch of two sequences, as benchmarks/plan_quality.py


def load(path: Path = RUNS) -> dict[str, Any]:
    """The whole calibration set: ``{"sources": {...}, "rows": [...]}``."""
    return json.loads(path.read_text())


def _layer_flops_fwd(a: dict[str, Any], causal: bool, moe_layer: bool) -> float:
    """Forward FLOPs of one block for one token (multiply-add = 2 FLOPs)."""
    h, n, s = a["hidden"], a["heads"], a["seq_len"]
    g = a["kv_heads"] or n
    d = a.get("head_dim") or h // n
    proj = 4 * h * d * n * (1 + g / n)  # Q, O: 2·h·n·d each; K, V: 2·h·g·d each
    core = 4 * s * n * d * (0.5 if causal else 1.0)  # QK^T and AV over s keys
    m = a.get("moe")
    if moe_layer:
        mlp = 6 * h * m["expert_ffn"] * (m["top_k"] + m["shared_experts"])  # SwiGLU
    else:
        mlp = (6 if a["family"] != "gpt" else 4) * h * (a["ffn_hidden"] or 4 * h)
    return proj + core + mlp


def flops_per_token(a: dict[str, Any], causal: bool) -> float:
    """Training FLOPs per token as Megatron-LM counts them (``num_floating_point_operations``
    in megatron/training/training.py): 3 x the forward count (backward = 2 x forward),
    no recomputation, projections of width heads x head_dim, SwiGLU MLPs of 3 matrices
    (GPT: 2 of 4h), routed plus shared experts, the logits 2·h·V. ``causal``: core
    attention counted over half the keys (Megatron-Core from 2025); False is the older
    full-attention count of Megatron-LM r0.8 and NeMo 24.x (checked in the script's
    output on rows that give two figures)."""
    m = a.get("moe")
    dense = m["dense_layers"] if m else a["layers"]
    per_layer = sum(_layer_flops_fwd(a, causal, moe_layer=i >= dense)
                    for i in range(a["layers"]))
    return 3 * (per_layer + 2 * a["hidden"] * a["vocab"])


def published_step_s(row: dict[str, Any], sources: dict[str, Any]) -> float | None:
    """The row's published figure as seconds per step; None when it cannot be converted.

    s/step is taken as is; tokens/s per GPU gives global_batch x seq / (rate x GPUs);
    TFLOP/s per GPU gives the step's FLOPs (:func:`flops_per_token` with the source's
    ``flops_formula``) / (rate x GPUs); MFU is TFLOP/s over the source's peak."""
    m, p, a, gpus = row["measured"], row["parallel"], row["architecture"], row["hardware"]["gpus"]
    unit, v = m["unit"], m["value"]
    if unit == "s/step":
        return float(v)
    gb = p["global_batch"]
    if gb is None or v is None:
        return None
    tokens = gb * a["seq_len"]
    if unit == "tokens/s/GPU":
        return tokens / (v * gpus)
    src = sources[row["source"]]
    if unit == "MFU":
        v, unit = v * src["peak_tflops"], "TFLOP/s/GPU"
    formula = src.get("flops_formula")
    if unit != "TFLOP/s/GPU" or formula is None or a["vocab"] is None and not _vocab(row):
        return None
    arch = {**a, "vocab": a["vocab"] or _vocab(row)}
    return tokens * flops_per_token(arch, formula == "megatron_causal") / (v * 1e12 * gpus)


def _vocab(row: dict[str, Any]) -> int | None:
    return row["architecture"]["vocab"] or row["scoring_assumptions"].get("vocab")


def why_not_scored(row: dict[str, Any], sources: dict[str, Any]) -> str | None:
    """The reason autopar cannot price this row, or None when it can."""
    p = {**row["parallel"], "ep": row["parallel"]["ep"] or 1}
    if p["global_batch"] is None or p["tp"] is None or p["dp"] is None:
        return "the source does not state the global batch in sequences or the TP degree"
    if row["architecture"]["vocab"] is None and not _vocab(row):
        return "vocabulary not stated"
    if p["cp"] > 1 and p["ep"] > 1:
        return "context and expert parallelism together are not supported by autopar's Spec"
    a = row["architecture"]
    if a["family"] != "gpt" and (a["hidden"] // a["heads"]) % 2:
        return (f"autopar's Llama/MoE attention needs an even head width hidden/heads for "
                f"its rotary embedding: {a['hidden']}/{a['heads']} = {a['hidden'] // a['heads']}")
    if folds_experts(row):
        from autopar.sharding import folded_ep_axis

        if folded_ep_axis(p["ep"], p["tp"], p["dp"]) is None:
            return (f"EP {p['ep']} folded over TP {p['tp']} x DP {p['dp']} (expert TP 1) is not "
                    f"a multiple of TP drawing a divisor of DP above 1, as autopar's folding is")
        if row["scoring_assumptions"].get("model") not in HF_MODELS:
            return (f"EP {p['ep']} folds over TP x DP (expert TP 1), which autopar does for "
                    f"routed experts only; autopar's MoE example routes through stacked "
                    f"experts: name a routed model in scoring_assumptions.model")
    if published_step_s(row, sources) is None:
        return "the published figure cannot be converted to seconds per step"
    return None


def folds_experts(row: dict[str, Any]) -> bool:
    """Whether the run folds its experts over TP x DP (Megatron-Core's expert tensor
    parallelism 1 beside TP > 1): where the row's assumptions say so (``expert_tp``: 1,
    from its source), or where EP does not divide DP (EP x ETP x EDP = TP x DP then
    leaves ETP 1)."""
    p = row["parallel"]
    ep, tp = p["ep"] or 1, p["tp"] or 1
    stated = row["scoring_assumptions"].get("expert_tp") == 1
    return ep > 1 and tp > 1 and (stated or bool(p["dp"] % ep))


def build_model(row: dict[str, Any]):
    """The row's model on ``meta`` with autopar's classes and an example batch of two
    sequences: ``gpt`` -> GPT (learned positions, GeLU MLP of 4h, tied embeddings),
    ``llama`` -> Llama, ``moe`` -> MoETransformer (SwiGLU experts, softmax router, at the
    row's ``capacity_factor``, else 1: the MoE runs are Megatron-Core's, dropless unless
    ``moe_expert_capacity_factor`` is set, which none sets, so each expert computes its
    routed tokens and no padded slots). Their head width is hidden / heads whatever the
    source's. A row whose ``scoring_assumptions.model`` names a ``transformers`` class
    is built as that class (:data:`HF_MODELS`)."""
    import torch

    from autopar.examples.gpt import GPT, GPTConfig
    from autopar.examples.llama import Llama, LlamaConfig
    from autopar.examples.moe import MoEConfig, MoETransformer

    a = row["architecture"]
    if row["scoring_assumptions"].get("model") in HF_MODELS:
        return _hf_model(row, row["scoring_assumptions"]["model"])
    vocab, seq = _vocab(row), a["seq_len"]
    common = dict(vocab_size=vocab, max_seq_len=seq, dim=a["hidden"], n_layers=a["layers"],
                  n_heads=a["heads"])
    with torch.device("meta"):
        inputs = (torch.randint(0, vocab, (EXAMPLE_SEQUENCES, seq)),)
        if a["family"] == "gpt":
            model = GPT(GPTConfig(**common))
        elif a["family"] == "llama":
            model = Llama(LlamaConfig(**common, n_kv_heads=a["kv_heads"],
                                      ffn_dim=a["ffn_hidden"], rope_theta=500000.0))
        else:
            m = a["moe"]
            model = MoETransformer(MoEConfig(
                **common, n_kv_heads=a["kv_heads"] or a["heads"], ffn_dim=a["ffn_hidden"],
                n_experts=m["experts"], top_k=m["top_k"], expert_ffn_dim=m["expert_ffn"],
                n_shared_experts=m["shared_experts"], n_dense_layers=m["dense_layers"],
                capacity_factor=m.get("capacity_factor") or 1.0))
    return model, inputs


def _moe_config(row: dict[str, Any]) -> dict[str, Any]:
    """What every ``transformers`` MoE config below takes from the row's fields."""
    a = row["architecture"]
    return dict(vocab_size=_vocab(row), hidden_size=a["hidden"],
                intermediate_size=a["ffn_hidden"], moe_intermediate_size=a["moe"]["expert_ffn"],
                num_hidden_layers=a["layers"], num_attention_heads=a["heads"],
                num_experts_per_tok=a["moe"]["top_k"], max_position_embeddings=a["seq_len"])


def _qwen3_moe(row: dict[str, Any]) -> dict[str, Any]:
    """``Qwen3MoeConfig``'s arguments: dropless top-k routing to experts stacked in one
    module fed tokens, indices and weights, the row's head width, q/k norms."""
    a = row["architecture"]
    return dict(_moe_config(row), num_key_value_heads=a["kv_heads"], head_dim=a["head_dim"],
                num_experts=a["moe"]["experts"], norm_topk_prob=True)


def _deepseek_v3(row: dict[str, Any]) -> dict[str, Any]:
    """``DeepseekV3Config``'s arguments: multi-head latent attention at DeepSeek-V3's
    ranks (the config's defaults), dense first blocks, routed experts with shared ones."""
    m = row["architecture"]["moe"]
    return dict(_moe_config(row), num_key_value_heads=row["architecture"]["heads"],
                n_routed_experts=m["experts"], n_shared_experts=m["shared_experts"],
                first_k_dense_replace=m["dense_layers"])


HF_MODELS = {"Qwen3MoeForCausalLM": ("Qwen3MoeConfig", _qwen3_moe),
             "DeepseekV3ForCausalLM": ("DeepseekV3Config", _deepseek_v3)}
"""``scoring_assumptions.model`` -> its ``transformers`` config class and the function
of the row that gives the config's arguments."""


def _hf_model(row: dict[str, Any], name: str):
    """The row's model as its authors wrote it: the ``transformers`` class ``name`` of
    :data:`HF_MODELS` built from the row's fields on ``meta``, with an example batch of
    two sequences. Needs ``transformers``."""
    import torch
    import transformers

    config, arguments = HF_MODELS[name]
    cfg = getattr(transformers, config)(**arguments(row))
    shape = (EXAMPLE_SEQUENCES, row["architecture"]["seq_len"])
    with torch.device("meta"):
        return getattr(transformers, name)(cfg), (torch.randint(0, _vocab(row), shape),)


_RECOMPUTE = {"full": "full", "none": "none"}


def spec_of(row: dict[str, Any]):
    """The row's configuration as an ``autopar.Spec``: its dp/tp/pp/cp/ep and
    micro-batch; pp > 1 runs ``1f1b``, or ``interleaved_1f1b`` with vp > 1 chunks, or the
    schedule the row's assumptions name (its chunks then the solver's choice);
    Megatron's selective recomputation (any modules) is ``selective``, none stated is the
    solver's choice; tp splits every weight matrix of the blocks, as the runs' tensor
    parallelism does (``split_weights``: without it the solver may spend tp on the batch
    and price another layout than the run's), unless the row's assumptions say the run
    keeps some whole (``split_weights: false``); FSDP is ZeRO-3, the distributed optimizer
    ZeRO-1, and a field the source leaves null takes the row's ``scoring_assumptions``
    (ZeRO, SP, micro-batch; with cp, the variant closest to how the run reached the
    other ranks' keys) or the estimate's default (micro-batch:
    :func:`autopar.spec.default_microbatch`); experts folded over TP x DP
    (:func:`folds_experts`) are ``expert_tp=1``."""
    import autopar

    p, assume = row["parallel"], row["scoring_assumptions"]
    rc = p["recompute"] if p["recompute"] is not None else assume.get("recompute")
    recompute = None if rc is None else _RECOMPUTE.get(rc, "selective")
    zero = p["zero"] if p["zero"] is not None else assume.get("zero")
    if isinstance(zero, str):
        zero = 3 if p.get("fsdp") else 1
    sp = p["sequence_parallel"]
    if sp is None:
        sp = bool(assume.get("sequence_parallel")) and p["tp"] > 1
    vp = p["vp"] or 1
    pp = p["pp"]
    schedule = "interleaved_1f1b" if vp > 1 else assume.get("schedule", "1f1b")
    return autopar.Spec(dp=p["dp"], tp=p["tp"], pp=pp, cp=p["cp"], ep=p["ep"] or 1,
                        microbatch_size=p["micro_batch"] or assume.get("micro_batch"),
                        schedule=None if pp == 1 else schedule,
                        virtual_stages=vp if pp > 1 and vp > 1 else None,
                        recompute=recompute, zero=zero or 0,
                        sequence_parallel=bool(sp) if p["tp"] > 1 else None,
                        split_weights=assume.get("split_weights", True) or None
                        if p["tp"] > 1 else None,
                        cp_variant=assume.get("cp_variant") if (p["cp"] or 1) > 1 else None,
                        expert_tp=1 if folds_experts(row) else None)


def precision_of(row: dict[str, Any]) -> str:
    """autopar's precision for the row: ``fp8`` where the run used float8 (bf16 with
    float8 Linear products), ``fp16`` where stated, else ``bf16``."""
    p = row["parallel"]
    return "fp8" if p["fp8"] else "fp16" if p["precision"] == "fp16" else "bf16"


def profile_of(row: dict[str, Any]) -> str:
    """The cluster profile: the row's assumption, else by GPU model (A100 -> a100-80g,
    H200 -> h200, H100 at 500 W -> h100-sxm-500w, other H100 -> h100-sxm)."""
    h = row["hardware"]
    if "gpu_profile" in row["scoring_assumptions"]:
        return row["scoring_assumptions"]["gpu_profile"]
    if "A100" in h["gpu"]:
        return "a100-80g"
    if "H200" in h["gpu"]:
        return "h200"
    return "h100-sxm-500w" if h["power_limit_w"] == 500 else "h100-sxm"


def device_bound(profile: str) -> str:
    """The path of a profile that is ``profile`` without its host figures
    (``host_overhead_s``), written once to the temporary folder. Those figures are the
    host time autopar's own eager runtime spends per op and per DTensor dispatch
    (measured on one GPU); no published run used that runtime (Megatron-LM, NeMo and
    Megatron-Bridge issue fused Transformer Engine modules, torchtitan's runs are
    compiled), so each row is priced with its devices as the bound. Priced with them,
    a row's layout follows autopar's host costs, not the run's: Megatron-Bridge's Llama 3
    70B (tp4 pp8 v5, micro-batch 1) keeps attention's weights replicated to avoid
    DTensor's host time, and NeMo's Llama 3 70B is priced +166% instead of +49%."""
    path = Path(tempfile.gettempdir()) / f"autopar-published-{profile}-device-bound.json"
    if not path.is_file():
        text = json.dumps({"base": profile, "name": f"{profile} (device-bound)",
                           "host_overhead_s": None})
        part = path.with_suffix(f".{os.getpid()}.part")
        part.write_text(text)
        part.replace(path)
    return str(path)


LINK_PROBE = 0.8
"""Share of a link's bandwidth :func:`measure` re-prices a row at to find the seconds of
exposed communication on that link (``terms=True``): with exposed time ``E`` at the
nominal bandwidth, the step at ``η`` of it is ``step + E·(1/η - 1)``."""


def estimate_any_memory(model, inputs, spec, **kw):
    """``autopar.estimate(model, inputs, spec, **kw)`` and None; where no plan fits the
    memory budget, the same priced without a memory limit (:data:`UNBOUNDED_BYTES`) and
    the ``NoFeasiblePlanError`` saying by how much."""
    import autopar
    from autopar.errors import NoFeasiblePlanError

    try:
        return autopar.estimate(model, inputs, spec, **kw), None
    except NoFeasiblePlanError as e:
        return autopar.estimate(model, inputs, spec, memory_budget=UNBOUNDED_BYTES, **kw), e


def _estimate(row: dict[str, Any], built: tuple, out: dict[str, Any], **links: float):
    """The row's configuration priced on its cluster for its model and inputs ``built``
    (:func:`build_model`), ``links`` the Cluster's bandwidth overrides (GB/s), without a
    memory limit; ``out["fits"]`` says whether autopar's memory model puts it within the
    profile's memory.

    The run fit in its GPUs' memory: that is a fact of the row. autopar's memory model
    is of its own runtime (torch saves the gathered input of a sequence-parallel matmul
    where Megatron-LM saves its shard, and bf16 inputs of float8 matmuls where
    Transformer Engine saves fp8), so a bound would push the solver to layouts the run
    did not use: NeMo's Llama 3 70B got row-split q/k/v at 18.7 s in place of the run's
    column split at 14.8 s, and the Llama 3 paper's interleaved 405B run one virtual
    stage at 11.8 s in place of four at 6.6 s. What a source leaves unstated
    (recomputation, virtual stages) is the solver's fastest choice."""
    import autopar
    from autopar.cost_models.hardware import load_profile
    from autopar.cost_models.memory import memory_budget

    gpu = profile_of(row)
    cluster = autopar.Cluster(gpu, row["hardware"]["gpus"] // 8, 8, **links,
                              profile=device_bound(gpu))
    plan = autopar.estimate(*built, spec_of(row), cluster=cluster,
                            global_batch=row["parallel"]["global_batch"],
                            precision=precision_of(row), optimizer="adamw",
                            memory_budget=UNBOUNDED_BYTES)
    budget = memory_budget(load_profile(gpu), None)
    if plan.memory_per_device_bytes > budget:
        out.update(fits=False, memory_error=(
            f"{plan.memory_per_device_bytes / 1e9:.1f} GB per device predicted against "
            f"{budget / 1e9:.1f} GB usable"))
    return plan


def measure(row: dict[str, Any], terms: bool = False) -> dict[str, Any]:
    """Price one row in this process: predicted step time, MFU, memory per GPU, whether
    autopar's memory model puts it within the profile's memory (:func:`_estimate`: priced
    without a memory limit either way), and the step's terms (``breakdown``). With ``terms``, also the seconds of exposed
    communication on each link level (``exposed_link_s``: ``intra_node``,
    ``inter_node``), from the row re-priced with that link at :data:`LINK_PROBE` of its
    bandwidth, for :mod:`calibrate`."""
    from autopar.cost_models.hardware import load_profile

    t0 = time.perf_counter()
    out: dict[str, Any] = {"spec": repr(spec_of(row)), "fits": True}
    try:
        built = build_model(row)
        plan = _estimate(row, built, out)
        out.update(predicted_step_s=plan.step_time_s, predicted_mfu=plan.mfu,
                   predicted_memory_gib=plan.memory_per_device_bytes / 2**30,
                   breakdown=plan.breakdown)
        if terms:
            hw = load_profile(profile_of(row))
            out["exposed_link_s"] = {
                name: (_estimate(row, built, out,
                                 **{f"{name}_bandwidth": link.bandwidth / 1e9 * LINK_PROBE})
                       .step_time_s - plan.step_time_s) / (1 / LINK_PROBE - 1)
                for name, link in (("intra_node", hw.intra_node), ("inter_node", hw.inter_node))}
    except Exception as e:  # noqa: BLE001 — reported in the row
        out["error"] = f"{type(e).__name__}: {e}"
    out["estimate_s"] = time.perf_counter() - t0
    return out


def _child(row_id: str, path: str, terms: bool = False) -> dict[str, Any]:
    """Run :func:`measure` on one row in a fresh interpreter."""
    done = subprocess.run([sys.executable, __file__, "--child", row_id, "--runs", path,
                           *(["--terms"] if terms else [])],
                          capture_output=True, text=True, check=False)
    if done.returncode:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        return {"error": lines[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def score(rows: list[dict[str, Any]], sources: dict[str, Any], jobs: int, path: Path,
          price=None, terms: bool = False) -> list[dict[str, Any]]:
    """Every row's result: published and predicted step time, error, or the reason it is
    not scored. ``price(row) -> dict`` defaults to a fresh process per row
    (:func:`measure`, with ``terms``)."""
    price = price or (lambda r: _child(r["id"], str(path), terms))
    todo = [r for r in rows if why_not_scored(r, sources) is None]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        priced = dict(zip([r["id"] for r in todo], pool.map(price, todo)))
    out = []
    for r in rows:
        res = {"id": r["id"], "source": r["source"], "gpus": r["hardware"]["gpus"],
               "published_step_s": published_step_s(r, sources),
               "published": f"{r['measured']['value']} {r['measured']['unit']}"}
        reason = why_not_scored(r, sources)
        if reason:
            res["not_scored"] = reason
        else:
            res.update(priced[r["id"]])
            if "error" in res:
                res["not_scored"] = res["error"]
            else:
                res["error_rel"] = res["predicted_step_s"] / res["published_step_s"] - 1
        out.append(res)
    return out


def per_source(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per source (and ``all``): rows, rows scored, median and max |error|."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault(r["source"], []).append(r)
    groups["all"] = results
    table = {}
    for name, rs in groups.items():
        errs = [abs(r["error_rel"]) for r in rs if "error_rel" in r]
        table[name] = {"rows": len(rs), "scored": len(errs),
                       "median_abs_error": statistics.median(errs) if errs else None,
                       "max_abs_error": max(errs) if errs else None}
    return table


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def markdown(results: list[dict[str, Any]], meta: dict[str, str]) -> str:
    """The results as a markdown report: header, per-source table, per-row table."""
    lines = ["# Published runs: autopar.estimate against published step times", "",
             *(f"- {k}: {v}" for k, v in meta.items()), "",
             "| source | rows | scored | median abs error | max abs error |",
             "|---|---:|---:|---:|---:|"]
    for name, s in per_source(results).items():
        lines.append(f"| {name} | {s['rows']} | {s['scored']} | {_pct(s['median_abs_error'])} "
                     f"| {_pct(s['max_abs_error'])} |")
    lines += ["", "Error = predicted / published - 1. Every row is priced without a memory "
              "limit (the run fit); `*`: over the profile's memory by autopar's model (of its "
              "own runtime).", "",
              "| row | GPUs | published | published s/step | predicted s/step | error | "
              "pred. memory GiB | note |", "|---|---:|---|---:|---:|---:|---:|---|"]
    for r in results:
        pub = "-" if r["published_step_s"] is None else f"{r['published_step_s']:.3f}"
        if "error_rel" in r:
            lines.append(f"| {r['id']} | {r['gpus']} | {r['published']} | {pub} | "
                         f"{r['predicted_step_s']:.3f} | {100 * r['error_rel']:+.0f}% | "
                         f"{r['predicted_memory_gib']:.0f}{'' if r['fits'] else '*'} | |")
        else:
            lines.append(f"| {r['id']} | {r['gpus']} | {r['published']} | {pub} | - | - | - | "
                         f"not scored: {r['not_scored']} |")
    return "\n".join(lines) + "\n"


def _line(r: dict[str, Any]) -> str:
    pub = "-" if r["published_step_s"] is None else f"{r['published_step_s']:9.3f}"
    if "error_rel" in r:
        return (f"{r['id']:<34} {r['gpus']:>6} {pub:>9} {r['predicted_step_s']:9.3f} "
                f"{100 * r['error_rel']:+6.0f}%{'' if r['fits'] else ' (over memory)'}")
    return f"{r['id']:<34} {r['gpus']:>6} {pub:>9} {'-':>9}   not scored: {r['not_scored']}"


def main() -> int:
    """Score the selected rows, print them and the per-source errors, write the files."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the per-row results and summary here")
    ap.add_argument("--md", help="write the markdown report here")
    ap.add_argument("--only", help="score only the row with this id")
    ap.add_argument("--source", help="score only the rows of this source")
    ap.add_argument("--jobs", type=int, default=1, help="rows priced at once (processes)")
    ap.add_argument("--terms", action="store_true",
                    help="also price each row with slower links (3 estimates a row), "
                         "for benchmarks/calibrate.py")
    ap.add_argument("--runs", default=str(RUNS), help=argparse.SUPPRESS)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    data = load(Path(args.runs))
    rows = data["rows"]
    if args.child:
        print(json.dumps(measure(next(r for r in rows if r["id"] == args.child), args.terms)))
        return 0
    rows = [r for r in rows if (not args.only or r["id"] == args.only)
            and (not args.source or r["source"] == args.source)]
    t0 = time.perf_counter()
    results = score(rows, data["sources"], args.jobs, Path(args.runs), terms=args.terms)
    print(f"{'row':<34} {'GPUs':>6} {'pub s':>9} {'pred s':>9}  error")
    for r in results:
        print(_line(r))
    summary = per_source(results)
    for name, s in summary.items():
        print(f"{name:<24} rows {s['rows']:>3} scored {s['scored']:>3} median |err| "
              f"{_pct(s['median_abs_error']):>5} max |err| {_pct(s['max_abs_error']):>5}")
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
    meta = {"date": datetime.date.today().isoformat(), "commit": commit,
            "torch": torch.__version__, "wall_s": f"{time.perf_counter() - t0:.0f}",
            "command": "python " + " ".join(sys.argv)}
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "summary": summary,
                                               "rows": results}, indent=1))
    if args.md:
        Path(args.md).write_text(markdown(results, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
