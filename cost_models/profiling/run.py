"""``autopar profile``: measure this machine's GPU (or CPU) and write a profile JSON.

    autopar profile [--quick] [--out FILE] [--resume] [--time-limit-s S]
    torchrun --nproc-per-node 8 -m autopar.cost_models.profiling.run --out p.json
                                                           # adds collectives + α-β fits

:func:`run_profile` measures the points of :mod:`.grid` into tables (``launch``,
``gemm``, ``attention``: :mod:`.compute_bound`; ``memory_bound``: :mod:`.memory_bound`;
``collectives`` under torchrun: :mod:`.collectives`, fitted by :mod:`.fit`) and host
seconds (``host_overhead_s``: :mod:`.host_dispatch`, :mod:`.host_wrappers`), appends
every row to ``FILE.partial.jsonl`` as it is measured (``--resume`` skips those) and
writes the profile (:func:`assemble`, :func:`dump`). The format: docs/profiling.md.
Nothing here imports pulp or the planner.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, TextIO

import torch

from autopar.cost_models.hardware import CPU_PROFILE_NOTE
from autopar.cost_models.profiling.collectives import init_from_env, measure_collectives
from autopar.cost_models.profiling.fit import FIT_FORMULA, fit_table
from autopar.cost_models.profiling.grid import Grid, cpu_grid, gpu_grid
from autopar.cost_models.profiling.host_wrappers import measure_host
from autopar.cost_models.profiling.options import build_parser
from autopar.cost_models.profiling.timing import Task, Timer, compact_json, provenance
from autopar.errors import AutoparError, ConfigError, PlanFormatError

FORMAT = "autopar-profile/1"
"""Version tag of the profile JSON written here."""

TABLES = ("launch", "gemm", "attention", "memory_bound", "collectives")
"""Table names, in the order they appear in the JSON."""


class Progress:
    """A plain-text progress line on ``stream``: rewritten in place on a terminal,
    otherwise printed every ~5% and whenever the table changes."""

    def __init__(self, total: int, stream: TextIO = sys.stderr) -> None:
        self.total, self.stream, self.t0 = max(total, 1), stream, time.perf_counter()
        self.tty = stream.isatty()
        self.every = max(1, total // 20)
        self.last_table = ""

    def show(self, i: int, task: Task) -> None:
        """Report that task ``i`` (0-based) of the total is starting."""
        if not (self.tty or i % self.every == 0 or task.table != self.last_table):
            return
        self.last_table = task.table
        el = time.perf_counter() - self.t0
        left = el / i * (self.total - i) if i else 0.0
        line = (f"profile [{i + 1:4d}/{self.total}] {100 * i // self.total:3d}%  "
                f"{task.table} {task.key}  {el:5.0f}s elapsed, ~{left:4.0f}s left")
        self.stream.write(("\r" + line[:110].ljust(110)) if self.tty else line + "\n")
        self.stream.flush()

    def done(self, measured: int) -> None:
        """Final line."""
        el = time.perf_counter() - self.t0
        self.stream.write(("\n" if self.tty else "") +
                          f"profile: {measured} points measured in {el:.0f}s\n")


def partial_path(out: Path) -> Path:
    """Where the rows of an unfinished run of ``out`` are appended."""
    return out.with_name(out.name + ".partial.jsonl")


def load_partial(path: Path, device_name: str) -> list[dict[str, Any]]:
    """Rows of an earlier run of the same device, from its partial file. A last line cut
    short (the run was killed while writing it) is dropped; any other line that is not
    JSON makes the file unusable (PlanFormatError)."""
    rows: list[dict[str, Any]] = []
    with path.open() as f:
        texts = [line for line in f if line.strip()]
    lines: list[Any] = []
    for k, text in enumerate(texts):
        try:
            lines.append(json.loads(text))
        except ValueError:
            if k == len(texts) - 1 and k > 0:
                break
            raise PlanFormatError(f"{path} is not a partial profile: line {k + 1} is not "
                                  f"JSON; delete it or run without --resume") from None
    if not lines or not isinstance(lines[0], dict) or \
            not isinstance(lines[0].get("provenance"), dict):
        raise PlanFormatError(f"{path} is not a partial profile; delete it or run without "
                              f"--resume")
    earlier = lines[0]["provenance"].get("device_name")
    if earlier != device_name:
        raise PlanFormatError(f"{path} was measured on {earlier!r}, this is {device_name!r}; "
                              f"delete it or run without --resume")
    rows.extend(line for line in lines[1:] if isinstance(line, dict) and "table" in line)
    return rows


def _append(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def summarize_tables(tables: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Headline numbers: best GEMM rate per dtype, best attention rates, the copy
    bandwidth at the largest size, and the launch overheads."""
    s: dict[str, Any] = {"gemm_peak_flop_per_s": {}, "attention_peak_flop_per_s": {}}
    for r in tables.get("gemm", []):
        best = s["gemm_peak_flop_per_s"].get(r["dtype"])
        if "flop_per_s" in r and (best is None or r["flop_per_s"] > best["flop_per_s"]):
            s["gemm_peak_flop_per_s"][r["dtype"]] = {
                "flop_per_s": r["flop_per_s"], "shape": [r["m"], r["n"], r["k"]]}
    for r in tables.get("attention", []):
        best = s["attention_peak_flop_per_s"].get(r["pass"])
        if "flop_per_s" in r and (best is None or r["flop_per_s"] > best["flop_per_s"]):
            s["attention_peak_flop_per_s"][r["pass"]] = {
                "flop_per_s": r["flop_per_s"], "key": r["key"]}
    copies = [r for r in tables.get("memory_bound", []) if r["op"] == "copy" and "seconds" in r]
    if copies:
        big = max(copies, key=lambda r: (r["bytes"], r["bytes_per_s"]))
        s["copy_bytes_per_s"] = {"bytes_per_s": big["bytes_per_s"], "bytes": big["bytes"],
                                 "dtype": big["dtype"], "counting": "read + write"}
    s["launch_s"] = {r["what"]: r["seconds"] for r in tables.get("launch", []) if "seconds" in r}
    return s


def assemble(prov: dict[str, Any], rows: list[dict[str, Any]], order: list[str]) -> dict:
    """The profile document from measured rows (ordered as ``order``'s keys)."""
    rank = {k: i for i, k in enumerate(order)}
    tables: dict[str, list[dict[str, Any]]] = {t: [] for t in TABLES}
    for r in sorted(rows, key=lambda r: rank.get(r["table"] + "/" + r["key"], len(rank))):
        tables.setdefault(r["table"], []).append({k: v for k, v in r.items() if k != "table"})
    errors = [{"table": t, "key": r["key"], "error": r["error"]}
              for t, rs in tables.items() for r in rs if "error" in r]
    fits: dict[str, Any] = {"collectives": fit_table(tables["collectives"]),
                            "collectives_formula": FIT_FORMULA}
    if not tables["collectives"]:
        fits["collectives_note"] = ("not measured: one process; run under torchrun with "
                                    "more than one process (NCCL needs one GPU per rank)")
    return {"format": FORMAT, "provenance": prov, "summary": summarize_tables(tables),
            "fits": fits,
            "tables": tables, "errors": errors}


def dump(doc: dict[str, Any], path: Path) -> None:
    """Write the profile with one table row per line (reviewable diffs)."""
    parts = []
    for key, value in doc.items():
        if key != "tables":
            parts.append(f" {json.dumps(key)}: {compact_json(value, indent=1)}")
            continue
        tabs = []
        for name, rows in value.items():
            body = ",\n".join("   " + json.dumps(r) for r in rows)
            tabs.append(f"  {json.dumps(name)}: [\n{body}\n  ]" if rows
                        else f"  {json.dumps(name)}: []")
        parts.append(' "tables": {\n' + ",\n".join(tabs) + "\n }")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("{\n" + ",\n".join(parts) + "\n}\n")
    os.replace(tmp, path)


def run_profile(out: Path, *, quick: bool = False, resume: bool = False,
                grid: Grid | None = None, device: torch.device | None = None,
                time_limit: float | None = None, stream: TextIO = sys.stderr) -> dict | None:
    """Measure ``grid`` (default: the GPU or CPU grid for ``quick``) on ``device``
    (default: CUDA if present), collectives too under torchrun, and write ``out``.
    Returns the profile on rank 0 when finished; None on other ranks or when
    ``time_limit`` seconds ran out first (the partial file then stays for --resume)."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dist_info = init_from_env(device.type)
    rank, world = dist_info or (0, 1)
    if device.type == "cuda" and dist_info is not None:
        device = torch.device("cuda", torch.cuda.current_device())
    if grid is None:
        grid = gpu_grid(quick) if device.type == "cuda" else cpu_grid(quick)
    prov = provenance(device, mode="quick" if quick else "full", world_size=world)
    if device.type == "cpu":
        prov["purpose"] = CPU_PROFILE_NOTE
    part = partial_path(out)
    rows: list[dict[str, Any]] = []
    if rank == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        if resume and part.exists():
            rows = load_partial(part, prov["device_name"])
            stream.write(f"profile: resuming, {len(rows)} points already in {part}\n")
        else:
            part.write_text(json.dumps({"provenance": prov}) + "\n")
    emit: Callable[[dict[str, Any]], None] = lambda r: _append(part, {"table": "collectives", **r})
    comm_order: list[str] = []
    if dist_info is not None:
        rows = _collectives(grid, device, rows, emit)
        comm_order = [f"collectives/{r['key']}" for r in rows if r["table"] == "collectives"]
        if rank != 0:
            return None
    tasks = grid.tasks(device)
    t0 = time.perf_counter()
    host = f", then host overheads ({grid.host_rounds} x 5 phases)" if grid.host else ""
    stream.write(f"profile: {prov['device_name']} ({device.type}), "
                 f"{'quick' if quick else 'full'} grid of {len(tasks)} points{host}; "
                 f"writing {out}\n")
    done = {(r["table"], r["key"]) for r in rows}
    timer = Timer(device, budget_s=grid.budget_s)
    todo = [t for t in tasks if (t.table, t.key) not in done]
    if not _measure(todo, timer, rows, part, time_limit, stream):
        return None
    doc = assemble(prov, rows, comm_order + [f"{t.table}/{t.key}" for t in tasks])
    if grid.host:
        def say(phase: str) -> None:
            stream.write(f"profile: host overheads: {phase}, "
                         f"{time.perf_counter() - t0:.0f}s elapsed\n")
            stream.flush()
        doc["host_overhead_s"] = measure_host(device, grid.host_rounds, say=say)
    dump(doc, out)
    part.unlink(missing_ok=True)
    return doc


def _measure(todo: list[Task], timer: Timer, rows: list[dict[str, Any]], part: Path,
             time_limit: float | None, stream: TextIO) -> bool:
    """Run ``todo``, appending each row to ``rows`` and the partial file; False when
    the time limit stopped it early. On CUDA everything runs on one side stream so that
    forward, backward and CUDA-graph capture share it (:meth:`Timer.graph_time`)."""
    progress = Progress(len(todo), stream)
    t_start = time.perf_counter()
    cuda = timer.cuda
    with torch.cuda.stream(torch.cuda.Stream(timer.device)) if cuda else nullcontext():
        for i, task in enumerate(todo):
            if time_limit is not None and time.perf_counter() - t_start > time_limit:
                stream.write(f"profile: time limit reached, {len(todo) - i} points left; "
                             f"rerun with --resume to finish ({part})\n")
                return False
            progress.show(i, task)
            record = {"table": task.table, "key": task.key, **task.params}
            torch.manual_seed(i)
            try:
                record.update(task.run(timer))
            except Exception as e:  # noqa: BLE001 — one failed point must not end the run
                record["error"] = f"{type(e).__name__}: {e}"[:300]
            if cuda:
                torch.cuda.empty_cache()
            rows.append(record)
            _append(part, record)
    progress.done(len(todo))
    return True


def _collectives(grid: Grid, device: torch.device, rows: list[dict[str, Any]],
                 emit: Callable[[dict[str, Any]], None]) -> list[dict[str, Any]]:
    """Measure the collectives on every rank (rank 0's done keys broadcast first),
    then leave the process group."""
    import torch.distributed as dist

    skip = [sorted(r["key"] for r in rows if r["table"] == "collectives")]
    dist.broadcast_object_list(skip, src=0)
    new = measure_collectives(list(grid.comm_sizes), device, skip=frozenset(skip[0]),
                              emit=emit)
    dist.destroy_process_group()
    return rows + [{"table": "collectives", **r} for r in new]


def check_options(args: argparse.Namespace) -> None:
    """ConfigError for options that cannot run: ``--device cuda`` without a CUDA
    device, a time limit that is not a positive number of seconds."""
    import math

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: this machine has no CUDA device that torch can use "
                          "(torch.cuda.is_available() is False); profile its CPU with "
                          "--device cpu, or run on the GPU to be measured")
    limit = args.time_limit_s
    if limit is not None and not (math.isfinite(limit) and limit > 0):
        raise ConfigError(f"--time-limit-s {limit}: expected a positive number of seconds")


def main(args: argparse.Namespace | None = None) -> int:
    """Run the profiler from parsed arguments (or sys.argv); 0 when finished, 3 when the
    time limit left points to measure. ConfigError or PlanFormatError for options or
    a ``--resume`` file that cannot be used (printed as one line when run as a
    script)."""
    if args is None:
        args = build_parser(description=__doc__).parse_args()
    check_options(args)
    device = torch.device(args.device) if args.device else None
    doc = run_profile(Path(args.out), quick=args.quick, resume=args.resume, device=device,
                      time_limit=args.time_limit_s)
    if doc is None:
        return 0 if int(os.environ.get("RANK", "0")) != 0 else 3
    print(f"profile written to {os.path.abspath(args.out)}")
    for line in summary_lines(doc):
        print("  " + line)
    if doc["errors"]:
        print(f"{len(doc['errors'])} points failed; see 'errors' in {args.out}")
    if doc["provenance"].get("device_type") == "cpu":
        print(f"note: {CPU_PROFILE_NOTE}")
    print(f"plan with it: autopar plan MODEL --gpu {args.out} [--nodes N --gpus-per-node M]")
    return 0


def summary_lines(doc: dict[str, Any]) -> list[str]:
    """The headline figures of a profile (:func:`summarize_tables`), one a line, for a
    reader: the device, the best GEMM and attention rates, the copy bandwidth and the
    launch overheads."""
    prov, s = doc.get("provenance", {}), doc.get("summary", {})
    lines = [f"device {prov.get('device_name', '?')} ({prov.get('device_type', '?')}), "
             f"{prov.get('mode', '?')} grid, torch {prov.get('torch', '?')}"]
    gemm = s.get("gemm_peak_flop_per_s") or {}
    if gemm:
        lines.append("best GEMM " + ", ".join(
            f"{dt} {r['flop_per_s'] / 1e9:,.1f} GFLOP/s at {'x'.join(map(str, r['shape']))}"
            for dt, r in gemm.items()))
    att = s.get("attention_peak_flop_per_s") or {}
    if att:
        lines.append("best attention " + ", ".join(
            f"{k} {r['flop_per_s'] / 1e9:,.1f} GFLOP/s" for k, r in att.items()))
    copy = s.get("copy_bytes_per_s")
    if copy:
        lines.append(f"copy {copy['bytes_per_s'] / 1e9:,.2f} GB/s read + write "
                     f"({copy['bytes']:,.0f} bytes)")
    launch = s.get("launch_s") or {}
    if launch:
        lines.append("launch " + ", ".join(f"{k} {v * 1e6:.2f} us" for k, v in launch.items()))
    if doc.get("host_overhead_s"):
        lines.append(f"host overheads: {len(doc['host_overhead_s'])} figures")
    return lines


if __name__ == "__main__":
    try:
        sys.exit(main())
    except AutoparError as err:
        print(f"autopar profile: error: {err}", file=sys.stderr)
        sys.exit(2)
