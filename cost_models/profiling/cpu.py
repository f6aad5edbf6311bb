"""Measure this CPU machine and write the shipped ``cpu`` hardware profile.

    python -m autopar.cost_models.profiling.cpu --out cost_models/profiles/cpu.json

A plan on a CPU runs as N gloo processes of one thread each, so every rate is measured
that way: N = 1, 2 and 4 one-thread processes started together (:func:`_worker`), each
timing its own work while the others time theirs. Per N (``per_process["N"]``,
:meth:`autopar.cost_models.hardware.HardwareProfile.for_processes`): the fp32 GEMM
rate, a copy's bandwidth, a tiny op's eager time, the host seconds of the parallel
wrappers (:mod:`.host_wrappers`), and for N > 1 the share of an all-reduce that GEMMs
hide (:func:`comm_overlap`) and gloo's collectives with their α-β fits
(:func:`collective_fits`, :mod:`.fit`), each the median of ``--repeats`` rounds
(:func:`measure_repeated`). What each figure counts: docs/profiling.md; why it is
measured so: benchmarks/results/README.md, "Profiling".
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.cost_models.profiling.collectives import collective_call
from autopar.cost_models.profiling.fit import fit_alpha_beta, ring_link
from autopar.cost_models.profiling.host_wrappers import (DTENSOR_OP_KEYS, HOST_KEYS,
                                                         REDISTRIBUTE_KEYS, host_overhead,
                                                         redistribute_overhead)
from autopar.cost_models.profiling.timing import cpu_name, median_of, median_time

SIZES = [2**k for k in (12, 16, 18, 20, 22)]
"""Bytes of the collective buffers (the full tensor: reduced, gathered or scattered)."""

PROCESS_COUNTS = (1, 2, 4)
"""Processes per machine measured: one alone, one per core, two per core."""

KINDS = ("all_reduce", "all_gather", "reduce_scatter")
"""Collectives fitted per process count (those the lowered plans issue)."""

REPS = 7
"""Timed repetitions per measurement (median kept)."""

COLLECTIVE_LOOPS = 8
"""GEMM + collective pairs per timed repetition: time slices of oversubscribed cores
(milliseconds) average out over several."""


def gemm_flops(sync: Callable[[], None]) -> float:
    """fp32 torch.mm rate (FLOP/s): per size the median over repetitions of enough
    products to make about 2 GFLOP, the best size kept."""
    best = 0.0
    for n in (256, 512, 1024):
        a, b = torch.randn(n, n), torch.randn(n, n)
        k = max(1, round(2e9 / (2 * n**3)))

        def run() -> None:
            for _ in range(k):
                torch.mm(a, b)
        best = max(best, k * 2 * n**3 / median_time(run, sync))
    return best


def copy_bandwidth(sync: Callable[[], None]) -> float:
    """Bytes read + written per second by a 64 MiB copy (median of repetitions)."""
    src = torch.empty(16 * 2**20)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / median_time(lambda: dst.copy_(src), sync)


def op_overhead() -> float:
    """Median seconds of one tiny elementwise op recorded by autograd (dispatch, kernel
    and graph node), as eager training runs every small op."""
    x = torch.ones(8, requires_grad=True)
    t = []
    for _ in range(3000):
        s = time.perf_counter()
        torch.add(x, x)
        t.append(time.perf_counter() - s)
    return statistics.median(t)


def collective_fits(world: int, sync: Callable[[], None]) -> dict[str, dict[str, Any]]:
    """Per kind: the seconds of each size in SIZES, timed between GEMMs with the GEMM
    time subtracted (module docstring), and their α-β fit (:func:`.fit.ring_link`)."""
    a = torch.randn(512, 512)

    def compute() -> None:
        torch.mm(a, a)
    base = median_time(compute, sync, 5, COLLECTIVE_LOOPS)
    out = {}
    for kind in KINDS:
        times = []
        for size in SIZES:
            coll = collective_call(kind, size, dist.get_rank(), world, torch.device("cpu"))

            def step() -> None:
                compute()
                coll()
            times.append(max(0.0, median_time(step, sync, 5, COLLECTIVE_LOOPS) - base))
        link = ring_link(fit_alpha_beta([float(s) for s in SIZES], times), kind, world)
        out[kind] = {"seconds": times, "bandwidth": link.bandwidth, "latency": link.latency}
    return out


OVERLAP_BYTES = 2**22
"""Buffer of the all-reduce whose overlap with GEMMs is measured (4 MiB: a block's
gradients in the small models plans run on a CPU)."""


def comm_overlap(sync: Callable[[], None]) -> float:
    """The share of an all-reduce that hides behind GEMMs issued after it: with c the
    all-reduce alone, g GEMMs of about the same time alone and t the all-reduce issued
    asynchronously, then the GEMMs, then waited for, (g + c − t) / min(g, c), clipped
    to [0, 1]. 1: the collective costs nothing beside compute; 0: it adds its whole
    time, as when gloo's threads and the compute share the same cores."""
    full = torch.ones(OVERLAP_BYTES // 4)
    a = torch.randn(512, 512)
    c = median_time(lambda: dist.all_reduce(full), sync, REPS, COLLECTIVE_LOOPS)
    one = median_time(lambda: torch.mm(a, a), sync, REPS, COLLECTIVE_LOOPS)
    k = max(1, round(c / max(one, 1e-9)))

    def gemms() -> None:
        for _ in range(k):
            torch.mm(a, a)

    def both() -> None:
        work = dist.all_reduce(full, async_op=True)
        gemms()
        work.wait()
    g = median_time(gemms, sync, REPS, COLLECTIVE_LOOPS)
    t = median_time(both, sync, REPS, COLLECTIVE_LOOPS)
    return min(1.0, max(0.0, (g + c - t) / max(min(g, c), 1e-12)))


def _worker(rank: int, world: int, port: int, q: Any) -> None:
    """One of ``world`` one-thread processes: measure everything, report to the parent."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    sync = dist.barrier
    res: dict[str, Any] = {"gemm_flops": gemm_flops(sync), "copy_bandwidth": copy_bandwidth(sync)}
    sync()
    res["op_overhead_s"] = op_overhead()
    res["host_overhead_s"] = host_overhead("cpu", sync)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        res["host_overhead_s"].update(redistribute_overhead(
            init_device_mesh("cpu", (world,)), sync))
        res["collectives"] = collective_fits(world, sync)
        res["comm_overlap"] = comm_overlap(sync)
    q.put((rank, res))
    dist.destroy_process_group()


def measure_processes(world: int) -> dict[str, Any]:
    """Rates of ``world`` concurrent one-thread processes: the median over ranks of
    each compute rate; rank 0's collective fits (every rank waits for the same ones)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=900) for _ in procs)
    for p in procs:
        p.join()
    out: dict[str, Any] = {k: statistics.median(got[r][k] for r in got)
                           for k in ("gemm_flops", "copy_bandwidth", "op_overhead_s")}
    keys = HOST_KEYS + DTENSOR_OP_KEYS + (REDISTRIBUTE_KEYS if world > 1 else ())
    out["host_overhead_s"] = {k: statistics.median(got[r]["host_overhead_s"][k] for r in got)
                                 for k in keys}
    if world > 1:
        out["collectives"] = got[0]["collectives"]
        out["comm_overlap"] = statistics.median(got[r]["comm_overlap"] for r in got)
    return out


def measure_repeated(counts: tuple[int, ...], repeats: int) -> dict[int, dict[str, Any]]:
    """:func:`measure_processes` for each process count, ``repeats`` rounds over the
    counts in turn (so that a slow spell of the machine touches every count), and the
    median of each figure over the rounds."""
    rounds = [{w: measure_processes(w) for w in counts} for _ in range(repeats)]
    return {w: median_of([r[w] for r in rounds]) for w in counts}


def _n(value: Any, source: str) -> dict[str, Any]:
    return {"value": value, "source": source}


_HOST_WHAT = {"linear": "a tensor-parallel Linear on DTensor", "norm": "a sequence-parallel "
              "norm on DTensor", "fsdp_param": "FSDP2 (per parameter of a unit)",
              "dtensor_op": "DTensor (per pointwise op run on it)"}
"""What each figure of :data:`HOST_KEYS` and :data:`DTENSOR_OP_KEYS` times, by its
name less ``_fwd`` / ``_bwd``."""


def per_process_entry(world: int, m: dict[str, Any], how: str) -> dict[str, Any]:
    """The ``per_process["world"]`` block of the profile from one measurement."""
    where = f"{how}, {world} concurrent one-thread process{'es' if world > 1 else ''}"
    entry: dict[str, Any] = {
        "matmul_flops": _n(m["gemm_flops"], f"{where}: median fp32 torch.mm rate, best of "
                                            "n=256, 512, 1024"),
        "memory_bandwidth": _n(m["copy_bandwidth"], f"{where}: 64 MiB copy, bytes read + written"),
        "kernel_overhead_s": _n(m["op_overhead_s"], f"{where}: median eager time of a tiny "
                                                    "torch.add recorded by autograd"),
    }
    entry["host_overhead_s"] = {
        k: _n(v, f"{where}: host seconds {_HOST_WHAT[k.rsplit('_', 1)[0]]} adds per "
                 f"{'forward' if k.endswith('fwd') else 'backward'} on a one-process mesh "
                 "(cost_models/profiling/host_wrappers.py), median over ranks")
        for k, v in m["host_overhead_s"].items() if k not in REDISTRIBUTE_KEYS}
    for k in REDISTRIBUTE_KEYS:
        if k in m["host_overhead_s"]:
            entry["host_overhead_s"][k] = _n(
                m["host_overhead_s"][k],
                f"{where}: seconds DTensor adds to a redistribution that runs an "
                f"{k.removeprefix('redistribute_').replace('_', '-')} (a 64 KiB activation "
                f"on the {world}-process mesh, less the plain gloo collective; "
                "cost_models/profiling/host_wrappers.py), median over ranks")
    if world > 1:
        for kind, fit in m["collectives"].items():
            entry[kind] = {
                "bandwidth": _n(fit["bandwidth"], f"{where}: gloo {kind} over loopback between "
                                                  "GEMMs, GEMM time subtracted, α-β fit"),
                "latency": _n(fit["latency"], "same fit"), "seconds": fit["seconds"]}
        entry["comm_overlap"] = _n(m["comm_overlap"], f"{where}: share of a 4 MiB gloo "
                                   "all-reduce hidden behind GEMMs issued after it (median "
                                   "over ranks)")
    return entry


def main() -> None:
    """Measure and write the profile."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="cost_models/profiles/cpu.json")
    ap.add_argument("--repeats", type=int, default=3,
                    help="rounds of the per-process measurements; each figure is the median "
                         "(default 3: one round's figures move by up to 20%%)")
    args = ap.parse_args()
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, not {args.repeats}")
    how = "measured by `python -m autopar.cost_models.profiling.cpu`"
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    alone = lambda: None  # noqa: E731 - no peers to wait for
    flops, bw, over = gemm_flops(alone), copy_bandwidth(alone), op_overhead()
    per = measure_repeated(PROCESS_COUNTS, args.repeats)
    link = per[4]["collectives"]["all_reduce"]
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    n = _n
    prof = {
        "name": "cpu", "device_name": cpu_name(),
        "provenance": {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
                       "threads": threads, "cpus": os.cpu_count()},
        "memory_bytes": n(mem, "physical memory (sysconf) of the measured machine"),
        "memory_reserve_bytes": n(mem // 2, "half kept for the OS, Python and other processes"),
        "matmul_flops": {"fp32": n(flops, f"{how}: median fp32 torch.mm rate with {threads} "
                                          "threads, best of n=256, 512, 1024"),
                         "bf16": n(flops, "no bf16 matrix units assumed: equal to fp32"),
                         "fp16": n(flops, "as bf16")},
        "vector_flops": {"fp32": n(flops / 8, "first principles: elementwise ops are "
                                              "bandwidth-bound; 1/8 of the GEMM rate bounds them"),
                         "bf16": n(flops / 8, "as fp32"), "fp16": n(flops / 8, "as fp32")},
        "matmul_efficiency": {"fp32": n(1.0, "the peak above is itself a measured rate"),
                              "bf16": n(1.0, "as fp32"), "fp16": n(1.0, "as fp32")},
        "memory_bandwidth": n(bw, f"{how}: 64 MiB copy with {threads} threads, bytes read + "
                                  "written"),
        "memory_efficiency": n(1.0, "the bandwidth above is itself a measured rate"),
        "kernel_overhead_s": n(over, f"{how}: median eager time of a tiny torch.add "
                                     "recorded by autograd"),
        "gpus_per_node": n(4, "4 processes on one machine"),
        "intra_node": {"bandwidth": n(link["bandwidth"], f"{how}: gloo all-reduce over "
                                      "loopback, 4 processes between GEMMs, α-β fit"),
                       "latency": n(link["latency"], "same fit")},
        "inter_node": {"bandwidth": n(link["bandwidth"], "one machine: equal to intra_node"),
                       "latency": n(link["latency"], "one machine: equal to intra_node")},
        "host_link": {"bandwidth": n(bw / 2, "host memory is device memory: the copy rate"),
                      "latency": n(0.0, "no transfer needed")},
        "per_process": {str(w): per_process_entry(w, m, f"{how} (median of {args.repeats} "
                                                     "rounds)") for w, m in per.items()},
    }
    with open(args.out, "w") as f:
        json.dump(prof, f, indent=1)
        f.write("\n")
    print(json.dumps({"gemm_flops": flops, "copy_bw": bw, "overhead_s": over,
                      "per_process": per}, indent=1))


if __name__ == "__main__":
    main()
