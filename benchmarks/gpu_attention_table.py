"""The attention table's long-sequence points (``grid.LONG_ATTENTION``: one sequence of
16K-128K tokens, Llama 3 8B's 32 heads with 8 and with 32 key/value heads, forward and
backward) measured as ``autopar profile`` measures its grid, and merged into a
measured profile without re-measuring the rest.

    python benchmarks/gpu_attention_table.py --out h100_attention_table.json   # GPU
    python benchmarks/gpu_attention_table.py --merge h100_attention_table.json \\
        --into cost_models/profiles/measured/h100-sxm.profile.json         # no GPU

``--merge`` adds the rows the profile lacks (by key) to its attention table and notes
their provenance under ``provenance.merged``; rows it already has are left alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def measure(out: Path) -> int:
    """Run the long attention points alone (no GEMMs, memory-bound ops, host figures)."""
    from autopar.cost_models.profiling.grid import LONG_ATTENTION, Grid
    from autopar.cost_models.profiling.run import run_profile

    grid = Grid(gemm=(), attention=tuple(LONG_ATTENTION), pointwise=(), rows=(),
                embedding=(), cross_entropy=(), comm_sizes=(), launch=False, host=False)
    return 0 if run_profile(out, grid=grid) is not None else 1


def merge(rows_file: Path, into: Path) -> int:
    """Add ``rows_file``'s attention rows that ``into`` lacks; say how many."""
    new = json.loads(rows_file.read_text())
    doc = json.loads(into.read_text())
    table = doc["tables"]["attention"]
    have = {r["key"] for r in table}
    added = [r for r in new["tables"]["attention"] if r["key"] not in have and "error" not in r]
    if not added:
        print(f"{into} has every attention row of {rows_file}")
        return 0
    table.extend(added)
    prov = new["provenance"]
    doc["provenance"].setdefault("merged", []).append(
        {"rows": [r["key"] for r in added], "from": rows_file.name,
         "date": prov.get("date"), "torch": prov.get("torch"),
         "device_name": prov.get("device_name"), "written_by": "benchmarks/gpu_attention_table.py"})
    from autopar.cost_models.profiling.run import dump

    dump(doc, into)
    print(f"added {len(added)} attention rows to {into}")
    return 0


def main() -> int:
    """Measure (``--out``) or merge (``--merge`` / ``--into``)."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--merge", type=Path)
    ap.add_argument("--into", type=Path)
    args = ap.parse_args()
    if args.merge:
        if not args.into:
            ap.error("--merge needs --into")
        return merge(args.merge, args.into)
    if not args.out:
        ap.error("--out or --merge is required")
    return measure(args.out)


if __name__ == "__main__":
    sys.exit(main())
