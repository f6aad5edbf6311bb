"""autopar's lowering against torchtitan's, same model, same configuration, same run.

One model, torchtitan's own Llama 3 (``torchtitan.models.llama3``), is trained twice per
configuration from the same initial weights and batch: laid out by torchtitan's
``parallelize_llama`` under its ``JobConfig`` (FSDP2 over every rank, activation
checkpointing ``selective`` with its per-op policy or ``full``, per-block
``torch.compile`` on or off; its loss as its trainer computes it: the token sum over
the global token count), and laid out by autopar (``autopar.estimate`` of the same
configuration, ``apply_plan(..., compile=...)``, its own train step). Per side it
records tokens/s per GPU over the steps after warm-up, the peak of
``torch.cuda.max_memory_allocated`` and the first 20 losses. Models (``--model``):

- ``llama3-8b-slice``: Llama 3 8B with ``--layers`` of its 32 blocks (default 8), the
  whole embedding and head, sequence 8,192, bf16, fused AdamW;
- ``llama-1.3b``: the same architecture at GPT-1.3B's size (2,048 wide, 24 blocks, 16
  heads), sequence 2,048;
- ``tiny``: 2 blocks, 64 wide, for checking the wiring on a CPU.

On a GPU, under torchrun (one process per GPU)::

    torchrun --nproc-per-node 1 benchmarks/vs_torchtitan.py --model llama3-8b-slice \\
        --out benchmarks/results/vs_torchtitan_h100.json

On a CPU it spawns ``--ranks`` gloo processes itself, fp32, compile off::

    python benchmarks/vs_torchtitan.py --cpu --out benchmarks/results/vs_torchtitan_cpu.json

Needs torchtitan 0.2.2 (not a dependency of autopar): ``pip install torchtitan==0.2.2``,
or on a machine without a package registry ``bash benchmarks/vendor_torchtitan.sh``
here, the folder it writes carried there, and ``PYTHONPATH=.torchtitan_vendor``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib.util
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

MODELS: dict[str, dict[str, Any]] = {
    "llama3-8b-slice": dict(dim=4096, n_heads=32, n_kv_heads=8, vocab_size=128256,
                            multiple_of=1024, ffn_dim_multiplier=1.3, seq=8192, batch=1),
    "llama-1.3b": dict(dim=2048, n_layers=24, n_heads=16, n_kv_heads=16, vocab_size=128256,
                       multiple_of=256, ffn_dim_multiplier=None, seq=2048, batch=4),
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
                 multiple_of=32, ffn_dim_multiplier=None, seq=32, batch=2),
}
"""Each model's torchtitan ``TransformerModelArgs`` and its sequence and local batch
(samples per rank); Llama 3 8B's are Meta's release config as torchtitan ships it."""


class _StandIn(types.ModuleType):
    """An empty module whose every attribute is an empty class (see :func:`stand_ins`)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {"__init__": lambda self, *a, **k: None})


def stand_ins() -> list[str]:
    """Register empty modules for what torchtitan's package imports for its data loaders
    and metrics but this comparison never runs (Hugging Face ``datasets``, TensorBoard),
    where they are not installed (an offline GPU machine with the vendored torchtitan of
    ``vendor_torchtitan.sh``); the names registered."""
    done = []
    for needed, names in (("datasets", ("datasets", "datasets.distributed")),
                          ("tensorboard", ("torch.utils.tensorboard",))):
        if needed not in sys.modules and importlib.util.find_spec(needed) is None:
            for name in names:
                sys.modules[name] = _StandIn(name)
                done.append(name)
    return done


def titan_model(name: str, layers: int | None) -> tuple[torch.nn.Module, int, int]:
    """(torchtitan's Llama of ``MODELS[name]`` with ``layers`` blocks where given,
    initialized with torchtitan's ``init_weights`` under seed 0 on the CPU, sequence,
    local batch)."""
    from torchtitan.models.llama3 import Transformer
    from torchtitan.models.llama3.model.args import TransformerModelArgs

    spec = dict(MODELS[name])
    seq, batch = spec.pop("seq"), spec.pop("batch")
    if layers is not None:
        spec["n_layers"] = layers
    spec.setdefault("n_layers", 8)
    args = TransformerModelArgs(**spec, max_seq_len=seq)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model, seq, batch


def _job_config(recompute: str, compile_on: bool, seq: int, bf16: bool) -> Any:
    from torchtitan.config import JobConfig

    job = JobConfig()
    job.activation_checkpoint.mode = recompute
    job.activation_checkpoint.selective_ac_option = "op"
    job.compile.enable = compile_on
    job.compile.components = ["model"]
    job.training.seq_len = seq
    job.training.mixed_precision_param = "bfloat16" if bf16 else "float32"
    job.training.mixed_precision_reduce = "float32"
    return job


def _timed_steps(step: Any, steps: int, sync: Any) -> tuple[list[float], list[float]]:
    """(losses, seconds per step) of ``steps`` calls of ``step``, each synchronized."""
    losses, times = [], []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    return losses, times


def run_titan(base: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, recompute: str,
              compile_on: bool, steps: int, dev: torch.device) -> dict[str, Any]:
    """Train a copy of ``base`` laid out by torchtitan (module docstring)."""
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import parallelize_llama

    world = dist.get_world_size()
    dims = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=1, etp=1,
                        world_size=world)
    import torchtitan.distributed.parallel_dims as titan_dims

    titan_dims.device_type = dev.type  # torchtitan assumes "cuda" where it finds none
    dims.build_mesh()
    model = copy.deepcopy(base).to(dev)
    bf16 = dev.type == "cuda"
    model = parallelize_llama(model, dims, _job_config(recompute, compile_on, x.shape[1], bf16))
    if dev.type == "cpu":  # gloo has no pre-multiplied sum: plain sums (factor 1.0)
        for m in model.modules():
            if hasattr(m, "set_force_sum_reduction_for_comms"):
                m.set_force_sum_reduction_for_comms(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True if bf16 else None)
    amp = torch.autocast(dev.type, dtype=torch.bfloat16) if bf16 and world == 1 \
        else _null()
    tokens = float(x.numel() * world)

    def step() -> torch.Tensor:
        with amp:
            logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum")
        (loss / tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out = (loss / x.numel()).detach()
        dist.all_reduce(out)
        return out / world
    return _measure(step, steps, dev, x.numel())


def run_autopar(base: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, recompute: str,
                compile_on: bool, steps: int, dev: torch.device) -> dict[str, Any]:
    """Train a copy of ``base`` laid out by autopar (module docstring)."""
    import autopar
    from autopar.runtime import apply_plan

    world = dist.get_world_size()
    bf16 = dev.type == "cuda"
    model = copy.deepcopy(base)
    global_x = torch.zeros((x.shape[0] * world, x.shape[1]), dtype=x.dtype, device="meta")
    plan = autopar.estimate(model, (global_x,), autopar.Spec(
        dp=world, zero=3, microbatch_size=x.shape[0], recompute=recompute,
        compile=compile_on),
        cluster=autopar.Cluster(_profile(dev), 1, world), global_batch=x.shape[0] * world,
        precision="bf16" if bf16 else "fp32")
    pm = apply_plan(model.to(dev), plan, compile=compile_on)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4, fused=True if bf16 else None)

    def step() -> torch.Tensor:
        loss = pm.step(x, y, local=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    out = _measure(step, steps, dev, x.numel())
    out["plan"] = {"mesh": plan.mesh, "zero": plan.zero, "precision": plan.precision,
                   "predicted_step_s": plan.step_time_s,
                   "predicted_peak_bytes": plan.memory.get("total")}
    return out


def _profile(dev: torch.device) -> str:
    if dev.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(dev)
    return "h200" if "H200" in name else "a100-80g" if "A100" in name else "h100-sxm"


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _measure(step: Any, steps: int, dev: torch.device, tokens: int) -> dict[str, Any]:
    cuda = dev.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    losses, times = _timed_steps(step, steps, sync)
    steady = times[3:] if len(times) > 4 else times
    return {"losses": losses[:20], "first_step_s": times[0],
            "step_s": statistics.median(steady),
            "tokens_per_s_per_gpu": tokens / statistics.median(steady),
            "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "wall_s": time.perf_counter() - t0}


def compare(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every configuration, torchtitan then autopar (module docstring), on this rank."""
    rank = dist.get_rank()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) \
        if torch.cuda.is_available() and not args.cpu else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    base, seq, batch = titan_model(args.model, args.layers)
    gen = torch.Generator().manual_seed(1 + rank)
    vocab = base.output.out_features
    x = torch.randint(0, vocab, (batch, seq), generator=gen).to(dev)
    y = torch.randint(0, vocab, (batch, seq), generator=gen).to(dev)
    rows = []
    for recompute in args.recompute:
        for compile_on in ([False] if args.cpu else [False, True]):
            row: dict[str, Any] = {"recompute": recompute, "compile": compile_on}
            for side, fn in (("torchtitan", run_titan), ("autopar", run_autopar)):
                row[side] = fn(base, x, y, recompute, compile_on, args.steps, dev)
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            t, a = row["torchtitan"], row["autopar"]
            row["tokens_per_s_ratio"] = a["tokens_per_s_per_gpu"] / t["tokens_per_s_per_gpu"]
            if t["peak_bytes"]:
                row["peak_ratio"] = a["peak_bytes"] / t["peak_bytes"]
            row["max_loss_diff"] = max(abs(p - q) for p, q in zip(t["losses"], a["losses"]))
            rows.append(row)
            if rank == 0:
                print(f"{args.model} {recompute:9s} compile={compile_on!s:5s} "
                      f"torchtitan {t['tokens_per_s_per_gpu']:9.0f} tok/s  autopar "
                      f"{a['tokens_per_s_per_gpu']:9.0f} tok/s  ratio "
                      f"{row['tokens_per_s_ratio']:.3f}  max |loss diff| "
                      f"{row['max_loss_diff']:.2e}", flush=True)
    return rows


def _worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    stand_ins()  # a spawned process starts without the parent's modules
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rows = compare(args)
        if rank == 0 and args.out:
            write(args, rows)
    finally:
        dist.destroy_process_group()


def write(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """Write ``rows`` with the machine's facts to ``args.out``."""
    from importlib.metadata import version

    cuda = torch.cuda.is_available() and not args.cpu
    out = {"date": str(datetime.date.today()), "torch": torch.__version__,
           "torchtitan": version("torchtitan"),
           "device": torch.cuda.get_device_name() if cuda else "cpu",
           "ranks": dist.get_world_size(), "model": args.model, "layers": args.layers,
           "steps": args.steps, "command": " ".join(sys.argv), "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Parse the options and run (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default=None)
    ap.add_argument("--layers", type=int, default=None, help="blocks (default: the model's)")
    ap.add_argument("--recompute", nargs="+", default=["selective", "full"],
                    choices=["selective", "full", "none"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--cpu", action="store_true", help="gloo ranks on this CPU, tiny model")
    ap.add_argument("--ranks", type=int, default=2, help="with --cpu: processes to spawn")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    stand_ins()
    try:
        import torchtitan  # noqa: F401
    except ImportError:
        print("vs_torchtitan needs torchtitan: pip install torchtitan==0.2.2 (with the torch "
              "this project pins)", file=sys.stderr)
        return 2
    args.model = args.model or ("tiny" if args.cpu else "llama3-8b-slice")
    if args.cpu:
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_worker, args=(args.ranks, port, args), nprocs=args.ranks)
        return 0
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        rows = compare(args)
        if dist.get_rank() == 0 and args.out:
            write(args, rows)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
