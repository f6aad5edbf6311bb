#!/usr/bin/env bash
# Unpack torchtitan 0.2.2 and the packages its Llama, config and parallelize_llama
# import into .torchtitan_vendor/ (git-ignored, about 11 MB), for a GPU machine that
# cannot reach a package registry: carry the folder there and run
#   PYTHONPATH=.torchtitan_vendor torchrun --nproc-per-node 1 benchmarks/vs_torchtitan.py ...
# (benchmarks/vs_torchtitan.py stands in for the data loaders' datasets and tensorboard,
# which the comparison does not use; triton comes with CUDA builds of torch).
set -euo pipefail
cd "$(dirname "$0")/.."
out=.torchtitan_vendor
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python -m pip download --quiet --no-deps --dest "$tmp" torchtitan==0.2.2 tyro==1.0.17 \
    torchdata==0.11.0 einops==0.8.2 tomli==2.5.0 docstring_parser==0.18.0 \
    typeguard==4.6.1 rich==15.0.0 markdown-it-py mdurl pygments shtab
rm -rf "$out"
mkdir -p "$out"
for w in "$tmp"/*.whl; do
    python -m zipfile -e "$w" "$out"
done
rm -rf "$out"/*.dist-info/RECORD
du -sh "$out"
