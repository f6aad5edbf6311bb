"""Host time per training step on the CPU: Python and dispatch, the device's work negligible.

For the zoo's small models (``tiny-gpt``, ``tiny-llama``: 2 layers, hidden 32, 16
tokens) each plan of :data:`CASES` — data parallelism, tensor parallelism with sequence
parallelism, a two-stage pipeline — is laid out with ``apply_plan`` on 2 gloo ranks and
timed. The dp and pp plans are scored with ``autopar.estimate``; the tp plan is the
Megatron-LM layout written by hand in ``tests/handmade_plans.py`` (q/k/v/fc1 colwise,
proj/fc2 rowwise, norms on sequence shards), which torchtitan's TP plan also applies: at
these sizes the planner's own tp=2 plan splits the batch over tp, not the weights. Each
step is timed as ``ParallelModel.step`` (forward and backward) then ``SGD.step`` and
``zero_grad``, median over the timed steps after warm-up. At these sizes a step's
arithmetic takes a few microseconds per op and its collectives move a few kilobytes, so
the step is the host's time: the Python of the model, the runtime's hooks and
DTensor's dispatch. The figure is the CPU time of the rank's main thread
(``time.thread_time``: the thread that runs Python and dispatch, not gloo's), which
the other load of a shared machine leaves alone; the wall clock is recorded beside it
(``wall_s``), and exceeds it by the waits in collectives and for a core. The
profiler's count of the aten ops one step dispatches (``aten_ops``) tells how much of it
is dispatch.

    python benchmarks/host_time.py --json benchmarks/results/host_time_cpu.json \
        --md benchmarks/results/host_time_cpu.md [--label before] [--steps 30]

All cases run in one fresh 2-rank group (``autopar.launch.run_distributed``, one
thread per rank), laid out side by side; ``--repeat`` rounds of ``--steps`` steps of
each case in turn, and each case's figure is the median of its rounds' medians (on the
shared 2-core machine a round's median moves by tens of percent with the other load).
``--label`` names the figures in the files (e.g. "before"/"after" a runtime change),
which are merged with what the files already hold under other labels.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

# the repository root, for the hand-written Megatron-LM plan of tests/handmade_plans.py
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GLOBAL_BATCH = 4
"""Samples per step: two per data-parallel rank under dp=2, four micro-batches of one
through the two-stage pipeline."""


@dataclass(frozen=True)
class Case:
    """One plan of one zoo model, as ``autopar.Spec`` keywords."""

    model: str
    name: str
    spec: tuple[tuple[str, Any], ...]


CASES = tuple(
    Case(model, name, spec)
    for model in ("tiny-gpt", "tiny-llama")
    for name, spec in (
        ("dp2", (("dp", 2),)),
        ("tp2+sp", (("tp", 2), ("sequence_parallel", True))),
        ("pp2", (("pp", 2), ("microbatch_size", 1), ("schedule", "1f1b"))),
    ))


def _build(case: Case) -> Callable[[], float]:
    """Lay ``case`` out on this rank (a started group); return one training step."""
    import autopar
    from autopar.examples import zoo
    from autopar.runtime import apply_plan
    from tests.handmade_plans import megatron_plan

    torch.manual_seed(0)
    model, (x,) = zoo.get(case.model, batch_size=GLOBAL_BATCH, device="cpu")
    spec = dict(case.spec)
    if "tp" in spec:
        plan = megatron_plan(model, global_batch=GLOBAL_BATCH, **spec)
    else:
        meta, inputs = zoo.get(case.model, batch_size=GLOBAL_BATCH)
        plan = autopar.estimate(meta, inputs, autopar.Spec(**spec),
                                cluster=autopar.Cluster("cpu", 1, 2), global_batch=GLOBAL_BATCH)
    vocab = model.tok_emb.num_embeddings
    pm = apply_plan(model, plan, example_inputs=(x,))
    opt = torch.optim.SGD(pm.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, tuple(x.shape), generator=g)
    y = torch.randint(0, vocab, tuple(x.shape), generator=g)

    def step() -> float:
        loss = pm.step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)
    return step


def _aten_ops(step: Callable[[], float]) -> int:
    """How many aten ops one call of ``step`` dispatches (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


def time_cases(cases: list[Case], steps: int, warmup: int, repeat: int) -> list[dict[str, Any]]:
    """On each rank of a started 2-rank group: lay every case out, then time
    ``repeat`` rounds of ``steps`` steps of each case in turn (so that the load of a
    shared machine falls on every case alike); per case, the median of each round."""
    import torch.distributed as dist

    built = [_build(c) for c in cases]
    for step in built:
        for _ in range(warmup):
            step()
    rounds: list[list[float]] = [[] for _ in cases]
    walls: list[list[float]] = [[] for _ in cases]
    for _ in range(repeat):
        for i, step in enumerate(built):
            cpu, wall = [], []
            for _ in range(steps):
                dist.barrier()
                t0, c0 = time.perf_counter(), time.thread_time()
                step()
                cpu.append(time.thread_time() - c0)
                wall.append(time.perf_counter() - t0)
            rounds[i].append(statistics.median(cpu))
            walls[i].append(statistics.median(wall))
    return [{"median_s": statistics.median(r), "runs_s": r, "wall_s": statistics.median(w),
             "wall_runs_s": w, "aten_ops": _aten_ops(step), "loss": step()}
            for r, w, step in zip(rounds, walls, built)]


def run_all(cases: list[Case], steps: int, warmup: int, repeat: int) -> list[dict[str, Any]]:
    """Every case on one 2-rank gloo group (one thread per rank); per case, the slower
    rank's figures."""
    from autopar.launch import run_distributed

    ranks = run_distributed(2, time_cases, cases, steps, warmup, repeat, timeout_s=1800)
    rows = []
    for i, case in enumerate(cases):
        slow = max((r[i] for r in ranks), key=lambda r: r["median_s"])
        rows.append({"model": case.model, "plan": case.name, "spec": dict(case.spec), **slow})
        print(f"{case.model:11s} {case.name:7s} {slow['median_s'] * 1e3:8.2f} ms/step "
              f"(wall {slow['wall_s'] * 1e3:.1f}) "
              f"(rounds {', '.join(f'{t * 1e3:.1f}' for t in slow['runs_s'])})  "
              f"{slow['aten_ops']:5d} aten ops", flush=True)
    return rows


def markdown(doc: dict[str, Any]) -> str:
    """The results as a markdown table, one column per label."""
    labels = list(doc["labels"])
    lines = ["# Host time per training step on the CPU", "",
             "CPU time of the main thread of a rank (the slower of 2 gloo ranks, one "
             "thread each) over `ParallelModel.step` + `SGD.step` + `zero_grad`, tiny "
             "models (the device's work negligible): the median over the timed steps, "
             "the median of the rounds; `wall`: the wall clock alike; `ops`: aten ops "
             "one step dispatches (torch.profiler). Written by `benchmarks/host_time.py`.",
             ""]
    for label in labels:
        info = doc["labels"][label]
        lines.append(f"- **{label}**: {info['date']}, torch {info['torch']}, commit "
                     f"{info['commit']}, `{info['command']}`")
    lines += ["", "| model | plan | " + " | ".join(f"{lb} ms | {lb} wall ms | {lb} ops"
                                                 for lb in labels)
              + " |", "|---|---|" + "---:|---:|---:|" * len(labels)]
    first = doc["labels"][labels[0]]["rows"]
    for i, row in enumerate(first):
        cells = []
        for label in labels:
            r = doc["labels"][label]["rows"][i]
            cells += [f"{r['median_s'] * 1e3:.2f}", f"{r['wall_s'] * 1e3:.2f}",
                      str(r["aten_ops"])]
        lines.append(f"| {row['model']} | {row['plan']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _commit() -> str:
    import subprocess
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=os.path.dirname(os.path.abspath(__file__)),
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> int:
    """The command line (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write (merge) the results here")
    ap.add_argument("--md", help="write the markdown table here")
    ap.add_argument("--label", default="current", help="name of these figures")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per case")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    ap.add_argument("--repeat", type=int, default=3, help="runs of the whole set")
    ap.add_argument("--only", help="run only cases whose model or plan contains this")
    args = ap.parse_args()
    cases = [c for c in CASES if not args.only or args.only in (c.model, c.name)]
    rows = run_all(cases, args.steps, args.warmup, max(1, args.repeat))
    doc: dict[str, Any] = {"labels": {}}
    if args.json and os.path.exists(args.json):
        with open(args.json) as f:
            doc = json.load(f)
    doc["labels"][args.label] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__, "commit": _commit(),
        "command": "python " + " ".join(sys.argv), "cases": [asdict(c) for c in cases],
        "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=list)
    if args.md:
        with open(args.md, "w") as f:
            f.write(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
