"""Planning time, end to end (capture included), for large models on large clusters.

Each case runs ``autopar.plan`` on a ``meta``-device model from the zoo, in a fresh
process so that no capture or import is shared between cases, and reports the wall
time of the call, the plan chosen and its predicted step time::

    python benchmarks/search_time.py [--json results.json] [--only llama3-8b] [--repeat 3]

Each case runs three times (the median is reported): on the shared 2-core machine one
case's runs differ by up to 50%.

Global batches: Llama 3 as torchtitan's Llama 3.1 runs (local batch 2 on 8B, FSDP 32
x local batch 16 on 70B); the GPT models as Megatron-LM's (Narayanan et al., SC'21,
Table 1; 1536 for the 175B-class row on 1,024 GPUs, 3072 for 1T); the mixtures of
experts as Megatron-Core's MoE benchmarking runs (benchmarks/reference_configs.json:
256 for Mixtral 8x7B on 64 GPUs, 8192 for DeepSeek-V3 on 1,024).
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence


@dataclass(frozen=True)
class Case:
    """One planning problem."""

    model: str
    gpu: str
    nodes: int
    global_batch: int

    @property
    def gpus(self) -> int:
        """Devices in the cluster (8 per node)."""
        return self.nodes * 8


CASES = (
    Case("llama3-8b", "h100-sxm", 8, 128),
    Case("llama3-70b", "h100-sxm", 32, 512),
    Case("gpt3-175b", "a100-80g", 128, 1536),
    Case("gpt-1t", "a100-80g", 384, 3072),
    Case("mixtral-8x7b", "h100-sxm", 8, 256),
    Case("deepseek-v3", "h100-sxm", 128, 8192),
)


def _child(case: Case) -> dict:
    """Plan one case in this process; return the timing and the plan's headline.

    ``seconds`` is the call with torch's modules imported, as ``import torch`` is not
    timed either; ``first_call_s`` adds ``torch._dynamo``, which ``torch.export``
    imports on first use in a process (about 2.5 s on the 2-core machine)."""
    import autopar
    from autopar.examples import zoo

    t0 = time.perf_counter()
    importlib.import_module("torch._dynamo")  # torch's own lazy import, timed apart
    imports = time.perf_counter() - t0
    t0 = time.perf_counter()
    model, inputs = zoo.get(case.model, batch_size=2, seq_len=None)
    plan = autopar.plan(model, inputs, cluster=autopar.Cluster(case.gpu, case.nodes, 8),
                        global_batch=case.global_batch)
    seconds = time.perf_counter() - t0
    pipe = plan.pipeline
    return {"seconds": seconds, "first_call_s": seconds + imports, "mesh": plan.mesh,
            "zero": plan.zero,
            "microbatch_size": plan.microbatch_size,
            "schedule": pipe.schedule if pipe else None,
            "step_time_s": plan.step_time_s, "mfu": plan.mfu,
            "candidates": plan.solver.get("candidates")}


def run_child(script: str, payload: dict) -> dict:
    """Run ``script --child JSON(payload)`` in a fresh interpreter and return the JSON
    object on the last line of its output, or ``{"error": <last line of stderr>}``."""
    out = subprocess.run([sys.executable, script, "--child", json.dumps(payload)],
                         capture_output=True, text=True, check=False)
    if out.returncode:
        lines = out.stderr.strip().splitlines() or [f"exit status {out.returncode}"]
        return {"error": lines[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_cases(doc: str, script: str, cases: Sequence[Any], *,
              child: Callable[[dict], dict], matches: Callable[[Any, str], bool],
              line: Callable[[dict], str], header: str | None = None,
              repeat: int = 1) -> list[dict]:
    """The command line of a benchmark that runs each case in a fresh process.

    ``--child JSON`` runs ``child`` on one case (a dataclass as ``asdict`` writes it)
    in this process and prints its result as JSON. Otherwise every case that
    ``matches`` ``--only`` runs through :func:`run_child`, ``line`` prints its row
    (after ``header``), ``--json PATH`` writes the rows, and the rows are returned
    (none in a child). ``--repeat N`` (default ``repeat``) runs each case N times and
    keeps the run of median ``seconds``, with every run's in ``runs_s``.
    """
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--only", help="run only the cases of this name")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--repeat", type=int, default=repeat,
                    help=f"runs per case; the median is kept (default {repeat})")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return []
    if header:
        print(header, flush=True)
    rows = []
    for case in cases:
        if args.only and not matches(case, args.only):
            continue
        runs = [{**asdict(case), **run_child(script, asdict(case))}
                for _ in range(max(1, args.repeat))]
        rows.append(_median_run(runs) if len(runs) > 1 else runs[0])
        print(line(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


def _median_run(runs: list[dict]) -> dict:
    """The run of median ``seconds`` (the first failure, if any run failed), with
    every run's seconds in ``runs_s``: one machine's runs vary by tens of percent."""
    failed = [r for r in runs if "seconds" not in r]
    if failed:
        return failed[0]
    ordered = sorted(runs, key=lambda r: r["seconds"])
    return {**ordered[len(ordered) // 2], "runs_s": [r["seconds"] for r in runs]}


def _line(r: dict) -> str:
    """One case's row of the table."""
    return (f"{r['model']:<11} {r['nodes'] * 8:>5} x {r['gpu']:<9} "
            + (f"{r['seconds']:6.1f} s ({r['first_call_s']:4.1f} s first call)  mesh "
               f"{r['mesh']} zero {r['zero']} "
               f"schedule {r['schedule']} MFU {r['mfu'] * 100:.1f}%"
               if "error" not in r else f"FAILED: {r['error']}"))


def main() -> int:
    """Run every case in a fresh interpreter and print the table."""
    run_cases(__doc__, __file__, CASES, child=lambda d: _child(Case(**d)),
              matches=lambda case, only: case.model == only, line=_line, repeat=3)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
