"""Measure this CPU machine and write the ``cpu`` hardware profile.

    python -m autopar.cost_models.measure_cpu --out cost_models/profiles/cpu.json

Measures fp32 GEMM throughput (torch.mm), memory bandwidth (a large copy, counting
bytes read and written), per-op overhead (a tiny add), and gloo all-reduce over
loopback with 2 and 4 processes, fitted to α-β. The only module of cost_models that
uses torch.distributed; nothing imports it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.cost_models.comm import fit_alpha_beta

SIZES = [2**k for k in (10, 14, 17, 20, 22)]  # bytes of the all-reduce buffer


def _best(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def gemm_flops() -> float:
    """Best fp32 torch.mm rate over a few square sizes (FLOP/s)."""
    best = 0.0
    for n in (512, 1024, 2048):
        a, b = torch.randn(n, n), torch.randn(n, n)
        best = max(best, 2 * n**3 / _best(lambda: torch.mm(a, b)))
    return best


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 256 MiB copy."""
    src = torch.empty(64 * 2**20)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _best(lambda: dst.copy_(src))


def op_overhead() -> float:
    """Median seconds of a tiny elementwise op (dispatch + kernel)."""
    x = torch.ones(8)
    t = []
    for _ in range(2000):
        s = time.perf_counter()
        torch.add(x, x)
        t.append(time.perf_counter() - s)
    return statistics.median(t)


def _worker(rank: int, world: int, port: int, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    res = []
    for size in SIZES:
        buf = torch.ones(size // 4)
        dist.all_reduce(buf)
        times = []
        for _ in range(7):
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(buf)
            times.append(time.perf_counter() - t)
        res.append(statistics.median(times))
    if rank == 0:
        q.put(res)
    dist.destroy_process_group()


def allreduce_times(world: int) -> list[float]:
    """Median all-reduce seconds for each size in SIZES on ``world`` gloo processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    res = q.get(timeout=300)
    for p in procs:
        p.join()
    return res


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    """Measure and write the profile."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="cost_models/profiles/cpu.json")
    args = ap.parse_args()
    how = "measured by `python -m autopar.cost_models.measure_cpu`"
    flops, bw, over = gemm_flops(), copy_bandwidth(), op_overhead()
    fits = {w: fit_alpha_beta([float(s) for s in SIZES], allreduce_times(w), "all_reduce", w)
            for w in (2, 4)}
    link = fits[4]
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    n = lambda v, src: {"value": v, "source": src}  # noqa: E731
    prof = {
        "name": "cpu", "device_name": _cpu_name(),
        "provenance": {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
                       "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                       "allreduce_fit_2": {"bandwidth": fits[2].bandwidth, "latency": fits[2].latency},
                       "allreduce_fit_4": {"bandwidth": link.bandwidth, "latency": link.latency}},
        "memory_bytes": n(mem, "physical memory (sysconf) of the measured machine"),
        "memory_reserve_bytes": n(mem // 2, "half kept for the OS, Python and other processes"),
        "matmul_flops": {"fp32": n(flops, f"{how}: best fp32 torch.mm rate, n=512..2048"),
                         "bf16": n(flops, "no bf16 matrix units assumed: equal to fp32"),
                         "fp16": n(flops, "as bf16")},
        "vector_flops": {"fp32": n(flops / 8, "first principles: elementwise ops are "
                                              "bandwidth-bound; 1/8 of the GEMM rate bounds them"),
                         "bf16": n(flops / 8, "as fp32"), "fp16": n(flops / 8, "as fp32")},
        "matmul_efficiency": {"fp32": n(1.0, "the peak above is itself a measured rate"),
                              "bf16": n(1.0, "as fp32"), "fp16": n(1.0, "as fp32")},
        "memory_bandwidth": n(bw, f"{how}: 256 MiB copy, bytes read + written"),
        "memory_efficiency": n(1.0, "the bandwidth above is itself a measured rate"),
        "kernel_overhead_s": n(over, f"{how}: median time of a tiny torch.add"),
        "gpus_per_node": n(4, "4 processes on one machine"),
        "intra_node": {"bandwidth": n(link.bandwidth, f"{how}: gloo all-reduce over loopback, "
                                                      "4 processes, α-β least-squares fit"),
                       "latency": n(link.latency, "same fit")},
        "inter_node": {"bandwidth": n(link.bandwidth, "one machine: equal to intra_node"),
                       "latency": n(link.latency, "one machine: equal to intra_node")},
        "host_link": {"bandwidth": n(bw / 2, "host memory is device memory: the copy rate"),
                      "latency": n(0.0, "no transfer needed")},
    }
    with open(args.out, "w") as f:
        json.dump(prof, f, indent=1)
    print(json.dumps({"gemm_flops": flops, "copy_bw": bw, "overhead_s": over,
                      "allreduce": {w: vars(l) for w, l in fits.items()}}, indent=1))


if __name__ == "__main__":
    main()
