"""The generated training program on one GPU: plan, ``autopar codegen``, run it.

    python benchmarks/gpu_codegen_step.py --out codegen_steps.json [--steps 12] [--tiny]

Plans the 1.32B GPT of ``gpu_runtime_step.py`` (batch 4 x 2048, bf16, AdamW) for one
``h100-sxm`` device, writes the standalone program with ``autopar codegen`` and runs it
under ``torchrun --nproc-per-node 1``, parsing the per-step times it prints (a step ends
with a device synchronize). The program is run as generated (AdamW ``fused`` on a GPU)
and once more with ``foreach=True`` instead, to show what the optimizer implementation
costs. Medians are
over the steps after the first two. ``--tiny`` runs a tiny GPT (a check of the script,
on any machine). This file is also the model factory the program imports (``build``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

STEP = re.compile(r"step (\d+) loss (\S+) time ([\d.]+) ms \(predicted ([\d.]+) ms\)")


def build() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    """The model and one global batch (``GPT_TINY=1`` in the environment: a tiny GPT)."""
    from autopar.examples.gpt import GPT, GPTConfig

    if os.environ.get("GPT_TINY"):
        cfg, seq = GPTConfig(vocab_size=256, max_seq_len=64, dim=64, n_layers=2, n_heads=4), 64
    else:
        cfg = GPTConfig(vocab_size=50304, max_seq_len=2048, dim=2048, n_layers=24, n_heads=16)
        seq = 2048
    return GPT(cfg), (torch.randint(0, cfg.vocab_size, (4, seq)),)


def run_program(program: Path, steps: int) -> dict[str, Any]:
    """Run ``program`` on one process; its per-step times, losses and prediction."""
    out = subprocess.run(["torchrun", "--nproc-per-node", "1", str(program), "--steps",
                          str(steps)], capture_output=True, text=True, check=False)
    rows = [m.groups() for m in STEP.finditer(out.stdout)]
    if out.returncode or not rows:
        raise SystemExit(f"{program} failed:\n{out.stderr[-3000:]}")
    times = [float(t) / 1e3 for _, _, t, _ in rows]
    return {"step_s": statistics.median(times[2:] or times), "steps_s": times,
            "losses": [float(loss) for _, loss, _, _ in rows],
            "predicted_s": float(rows[0][3]) / 1e3}


def main() -> int:
    """Plan, generate, run both variants, write the JSON."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--work", default="/tmp/autopar_codegen")
    args = ap.parse_args()
    if args.tiny:
        os.environ["GPT_TINY"] = "1"
    import autopar
    from autopar.runtime.codegen import emit_program

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        model, inputs = build()
    gpu = "cpu" if args.tiny and not torch.cuda.is_available() else "h100-sxm"
    plan = autopar.plan(model, inputs, cluster=autopar.Cluster(gpu, 1, 1), global_batch=4,
                        precision="bf16", optimizer="adamw")
    here = Path(__file__).resolve()
    program = work / "train.py"
    program.write_text(emit_program(plan, f"{here}:build", model_file=str(here),
                                    program_name=program.name))
    foreach = work / "train_foreach.py"
    text = program.read_text()
    call = 'fused=device_type == "cuda")'
    if call not in text:
        raise SystemExit(f"the generated program no longer builds AdamW with {call}")
    foreach.write_text(text.replace(call, "foreach=True)"))
    doc = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "plan": plan.summary().splitlines()[:8], "predicted_step_s": plan.step_time_s,
           "as_generated": run_program(program, args.steps),
           "foreach_adamw": run_program(foreach, args.steps)}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    for k in ("as_generated", "foreach_adamw"):
        print(f"{k}: {doc[k]['step_s'] * 1e3:.1f} ms (predicted {plan.step_time_s * 1e3:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
