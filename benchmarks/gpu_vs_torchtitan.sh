#!/usr/bin/env bash
# autopar against torchtitan on one GPU (benchmarks/vs_torchtitan.py): the Llama 3 8B
# slice and the 1.3B Llama, selective and full recomputation, compile off and on. Writes
# vs_torchtitan_<model>.json into $OUT (default benchmarks/results). Needs torchtitan
# 0.2.2 installed, or .torchtitan_vendor/ from benchmarks/vendor_torchtitan.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/results}
export PYTHONPATH=".torchtitan_vendor${PYTHONPATH:+:$PYTHONPATH}"
pip install --no-deps --quiet -e . >/dev/null 2>&1 || true
for model in llama3-8b-slice llama-1.3b; do
    timeout 280 torchrun --nproc-per-node 1 benchmarks/vs_torchtitan.py --model "$model" \
        --steps 20 --out "$out/vs_torchtitan_$model.json" || echo "$model: failed ($?)"
done
