"""Mixture-of-experts blocks at full size on one GPU against the cost model: the
router and the expert GEMMs of one expert-parallel rank.

A rank of an expert-parallel run with ``ep`` ranks holds ``E / ep`` experts and, with
routing spread evenly, receives ``T * k`` (token, choice) rows for them: as many per
expert as a block of ``E / ep`` experts with the same top-k is fed by ``T`` tokens of
its own. So a case is Hugging Face's sparse block (``transformers`` 5.x, dropless,
experts stacked in one module) built with ``E / ep`` experts, no communication:

- ``mixtral-8x7b/ep{1,2,4}``: Mixtral 8x7B's block (h 4096, FFN 14336, 8 experts,
  top-2; Mistral AI's release config) with 8, 4 and 2 experts;
- ``deepseek-v3/ep{8,16}``: DeepSeek-V3's fine-grained experts (h 7168, expert FFN
  2048, 256 routed experts, top-8, one shared expert of FFN 2048; the DeepSeek-V3
  release config, DeepSeek-AI 2024) as Qwen2-MoE's block (softmax router, shared
  expert with a sigmoid gate) with 32 and 16 experts.

Each case runs under autopar's runtime on one device (bf16 autocast over fp32
parameters), timed as ``gpu_layers.py`` times a layer; the router (gate linear, softmax,
top-k) is also timed alone (forward + backward, CUDA events). The same block is priced
by the planner, per term and for the router's own ops::

    python benchmarks/gpu_moe.py --out results/h100_moe.json        # on a GPU
    python benchmarks/gpu_moe.py --reprice results/h100_moe.json    # on a CPU
    python benchmarks/gpu_moe.py --tiny --out /tmp/moe.json         # CPU check
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

# run as a script, this file's folder is on sys.path
from layer_cases import mse_loss


@dataclass(frozen=True)
class MoECase:
    """One expert-parallel rank's share of a MoE block (module docstring)."""

    name: str
    family: str  # "mixtral" or "qwen2moe"
    hidden: int
    ffn: int
    experts: int  # held by the rank: E / ep
    top_k: int
    shared_ffn: int = 0
    batch: int = 1
    seq: int = 4096


def default_cases() -> list[MoECase]:
    """The measured grid (module docstring)."""
    mix = [MoECase(f"mixtral-8x7b/ep{ep}", "mixtral", 4096, 14336, 8 // ep, 2)
           for ep in (1, 2, 4)]
    ds = [MoECase(f"deepseek-v3/ep{ep}", "qwen2moe", 7168, 2048, 256 // ep, 8, 2048)
          for ep in (8, 16)]
    return mix + ds


def tiny_cases() -> list[MoECase]:
    """Two small cases for checking the script on a CPU."""
    return [MoECase("tiny-mixtral", "mixtral", 64, 128, 4, 2, batch=2, seq=32),
            MoECase("tiny-qwen2moe", "qwen2moe", 64, 32, 8, 4, 32, batch=2, seq=32)]


class Block(nn.Module):
    """Hugging Face's sparse MoE block of ``case``, hidden states in and out."""

    def __init__(self, case: MoECase) -> None:
        super().__init__()
        if case.family == "mixtral":
            from transformers import MixtralConfig
            from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

            cfg = MixtralConfig(hidden_size=case.hidden, intermediate_size=case.ffn,
                                num_local_experts=case.experts,
                                num_experts_per_tok=case.top_k)
            cfg._experts_implementation = "grouped_mm"  # as the full models run
            self.moe = MixtralSparseMoeBlock(cfg)
        else:
            from transformers import Qwen2MoeConfig
            from transformers.models.qwen2_moe.modeling_qwen2_moe import (
                Qwen2MoeSparseMoeBlock)

            cfg = Qwen2MoeConfig(hidden_size=case.hidden, moe_intermediate_size=case.ffn,
                                 shared_expert_intermediate_size=case.shared_ffn,
                                 num_experts=case.experts, num_experts_per_tok=case.top_k,
                                 norm_topk_prob=True)
            cfg._experts_implementation = "grouped_mm"
            self.moe = Qwen2MoeSparseMoeBlock(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self.moe(x)


def build(case: MoECase, device: str = "meta") -> tuple[Block, torch.Tensor, torch.Tensor]:
    """The case's block (weights normal, std 0.02, as the configs' initializer) and an
    example (input, target) on ``device``."""
    with torch.device(device):
        model = Block(case)
        if device != "meta":
            torch.manual_seed(0)
            for p in model.parameters():
                nn.init.normal_(p, std=0.02)
        x = torch.randn(case.batch, case.seq, case.hidden)
        y = torch.randn(case.batch, case.seq, case.hidden)
    return model, x, y


def predict(case: MoECase, gpu: str) -> Any:
    """The case's one-device plan (``autopar.estimate``, bf16 on a GPU)."""
    import autopar

    model, x, y = build(case)
    precision = "fp32" if gpu == "cpu" else "bf16"
    return autopar.estimate(model, (x,), autopar.Spec(dp=1), cluster=autopar.Cluster(gpu, 1, 1),
                            global_batch=case.batch, precision=precision, loss_fn=mse_loss,
                            example_targets=y)


def predicted_parts(case: MoECase, gpu: str) -> dict[str, dict[str, float]]:
    """Forward+backward seconds the planner prices per part of the block (``router``:
    the gate's ops; ``experts``: the routed experts' ops; ``other``: the rest, the shared
    expert included) and per term (``gemm`` for matrix products, ``memory`` else, FSDP2's
    parameter copies included); the router's ``host`` is the host seconds of its ops,
    for the router timed alone, where each op takes the longer of its host and device
    times (``autopar.cost_models.compute``)."""
    import autopar
    from autopar.cost_models.host import kind_host_time, op_kind
    from layer_accuracy import node_prices

    model, x, y = build(case)
    hw = autopar.Cluster(gpu, 1, 1).hardware()
    precision = "fp32" if gpu == "cpu" else "bf16"
    out = {p: {"gemm": 0.0, "memory": 0.0} for p in ("router", "experts", "other")}
    alone = 0.0
    for n, cost, mult in node_prices(model, x, y, case.batch, hw, precision=precision):
        path = n.module_path or ""
        part = ("router" if ".gate" in path and "shared_expert_gate" not in path
                else "experts" if ".experts" in path else "other")
        term = "gemm" if op_kind(n.target, n.flops, n.bytes) in ("matmul", "attention") \
            else "memory"
        out[part][term] += cost.compute_s * mult
        out[part]["memory"] += cost.param_copy_s * mult
        if part == "router":
            fwd, bwd = kind_host_time(hw, n.target, n.flops, n.bytes, n.requires_grad)
            alone += max(cost.compute_s, fwd + bwd)
    out["router"]["alone"] = alone
    return out


def time_router(block: Block, x: torch.Tensor, reps: int = 20) -> float:
    """Median seconds of the router's forward + backward alone (bf16 autocast, CUDA
    events; ``perf_counter`` without CUDA)."""
    h = x.view(-1, x.shape[-1]).detach().requires_grad_(True)
    cuda = x.is_cuda
    times = []
    for i in range(reps + 3):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t = time.perf_counter()
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=cuda):
            _, w, _ = block.moe.gate(h)
        w.float().sum().backward()
        if cuda:
            end.record()
            torch.cuda.synchronize()
            dt = start.elapsed_time(end) * 1e-3
        else:
            dt = time.perf_counter() - t
        if i >= 3:
            times.append(dt)
    return statistics.median(times)


def run_case(case: MoECase, gpu: str, steps: int, sustain_s: float) -> dict[str, Any]:
    """Plan, lay out, time and profile one case (module docstring)."""
    from gpu_layers import time_steps
    from autopar.runtime import apply_plan

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    plan = predict(case, gpu)
    model, x, y = build(case, dev)
    router_s = time_router(model, x)
    model.zero_grad(set_to_none=True)
    pm = apply_plan(model, plan, loss_fn=mse_loss)
    timed = time_steps(pm, x, y, steps, sustain_s)
    return {"case": asdict(case), "name": case.name, "profile": gpu,
            "predicted_fwd_bwd_s": plan.breakdown.get("compute_s", 0.0)
            + plan.breakdown.get("exposed_host_s", 0.0),
            "predicted_breakdown": plan.breakdown, "measured_router_s": router_s, **timed}


def reprice(path: Path, profile: str | None) -> dict[str, Any]:
    """Price the measured cases of ``path`` again and print measured against predicted:
    the whole block, its matrix products and the rest, and the router alone."""
    from layer_accuracy import ape, measured_terms

    doc = json.loads(path.read_text())
    rows = [r for r in doc["rows"] if "error" not in r]
    out = []
    for r in rows:
        case = MoECase(**r["case"])
        prof = profile or r["profile"]
        plan = predict(case, prof)
        parts = predicted_parts(case, prof)
        pred = plan.breakdown.get("compute_s", 0.0) + plan.breakdown.get("exposed_host_s", 0.0)
        mt = measured_terms(r) if r.get("kernels") else dict.fromkeys(
            ("gemm", "attention", "memory", "host"), 0.0)
        pg = sum(p["gemm"] for p in parts.values())
        pm = sum(p["memory"] for p in parts.values())
        router = parts["router"]["alone"]
        rec = {"case": case.name, "measured_s": r["measured_fwd_bwd_s"], "predicted_s": pred,
               "error_pct": (pred / r["measured_fwd_bwd_s"] - 1) * 100,
               "gemm_measured_s": mt["gemm"], "gemm_predicted_s": pg,
               "other_measured_s": mt["memory"] + mt["attention"], "other_predicted_s": pm,
               "host_wait_measured_s": mt["host"],
               "router_measured_s": r["measured_router_s"], "router_predicted_s": router,
               "parts_predicted_s": parts}
        rec["ape"] = ape(pred, r["measured_fwd_bwd_s"])
        out.append(rec)
        print(f"{case.name:22s} {rec['measured_s'] * 1e3:8.2f} ms pred {pred * 1e3:8.2f} "
              f"({rec['error_pct']:+6.1f}%)  gemm {mt['gemm'] * 1e3:7.2f}/{pg * 1e3:7.2f}  "
              f"other {rec['other_measured_s'] * 1e3:6.2f}/{pm * 1e3:6.2f}  host "
              f"{mt['host'] * 1e3:5.2f}  router {r['measured_router_s'] * 1e3:5.2f}/"
              f"{router * 1e3:5.2f}", flush=True)
    mape = statistics.fmean(r["ape"] for r in out) if out else None
    print(f"MAPE over {len(out)} cases: {mape}")
    return {"data": path.name, "mape_pct": mape, "cases": out}


def main() -> int:
    """Measure (``--out``) or reprice committed data (``--reprice``)."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="JSON of the measurements")
    ap.add_argument("--reprice", type=Path, help="measurements to price again (no GPU)")
    ap.add_argument("--profile", help="hardware profile for --reprice (default: the data's)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--sustain", type=float, default=0.0, metavar="S")
    ap.add_argument("--tiny", action="store_true", help="two tiny cases, to check the script")
    args = ap.parse_args()
    if args.reprice:
        res = reprice(args.reprice, args.profile)
        if args.out:
            args.out.write_text(json.dumps(res, indent=1) + "\n")
        return 0
    if not args.out:
        ap.error("--out is required unless --reprice")
    from gpu_layers import guarded_row, profile_name
    from gpu_runtime_step import start_one_rank_group
    from autopar.cost_models.profiling.timing import provenance

    cuda = start_one_rank_group()
    gpu = profile_name(cuda)
    doc: dict[str, Any] = {"provenance": provenance(torch.device("cuda" if cuda else "cpu")),
                           "steps": args.steps, "sustain_s": args.sustain, "rows": []}
    for case in tiny_cases() if args.tiny else default_cases():
        doc["rows"].append(guarded_row(
            case.name, asdict(case), lambda: run_case(case, gpu, args.steps, args.sustain),
            lambda r: f"measured {r['measured_fwd_bwd_s'] * 1e3:8.2f} ms  predicted "
                      f"{r['predicted_fwd_bwd_s'] * 1e3:8.2f} ms  router "
                      f"{r['measured_router_s'] * 1e3:6.2f} ms"))
        args.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
