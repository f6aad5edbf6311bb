#!/usr/bin/env bash
# The cost-model measurements of one lent GPU, in one command (about 7 minutes), from
# the repository root of the GPU machine. Prepare on a machine with pip access first:
#
#   pip wheel --no-deps --no-build-isolation -w .gpu/whl .
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .gpu/whl pulp==3.3.2
#   python benchmarks/gpu_layers.py --write-plans .gpu/plans     # the layer cases' plans
#
# (.gpu/ is ignored by git; carry it to the GPU machine). Writes into $OUT:
#   gpu.txt                         nvidia-smi's name, power limit, clocks, memory
#   <gpu>.profile.json              `autopar profile`: the full grid on an H200 (no
#                                   measured profile yet), the quick grid and the host
#                                   figures on an H100 (its full grid is committed)
#   <gpu>_layers.json               benchmarks/gpu_layers.py
#   <gpu>_llama8b_slice.json        benchmarks/gpu_runtime_step.py, 8 layers of Llama 3 8B
#   log                             everything printed
#
# ``bash benchmarks/gpu_session.sh steady`` measures instead, on one machine in one call
# (about 5 minutes), what the cost model's accuracy at steady state needs: the full
# profile grid with its host figures (<gpu>.profile.json), the layer cases after 1 s of
# back-to-back steps each, as a long training run holds the device
# (<gpu>_layers_steady.json), and two cases of the 8-layer slice
# (<gpu>_llama8b_slice_steady.json). The operand layouts and values of a GEMM are
# separate one-off runs: ``benchmarks/gpu_gemm_duty.py --layouts`` / ``--operands``.
#
# ``bash benchmarks/gpu_session.sh moe`` (about 6 minutes; also carry .gpu/hostbound.txt,
# the host-bound layer cases' names, comma-separated): the MoE blocks
# (<gpu>_moe.json, benchmarks/gpu_moe.py), the quick profile's host figures
# (<gpu>.quick.profile.json), attention at long sequences (<gpu>_attention_long.json)
# and the host-bound layer cases again (<gpu>_layers_hostbound.json).
set -u
MODE=${1:-all}
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
exec > >(tee "$OUT/log") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,memory.total,driver_version \
    --format=csv | tee "$OUT/gpu.txt"
gpu=$(python3 -c "import torch; print('h200' if 'H200' in torch.cuda.get_device_name() else 'h100-sxm')")
echo "profile: $gpu"
start=$SECONDS
if [ "$MODE" = steady ]; then
    (cd /tmp && timeout 220 autopar profile --out "$OUT/$gpu.profile.json")
    echo "profile took $((SECONDS - start)) s"; start=$SECONDS
    (cd benchmarks && timeout 170 python3 gpu_layers.py --plans ../.gpu/plans --sustain 1 \
        --out "$OUT/${gpu}_layers_steady.json" --time-limit 150)
    echo "layers took $((SECONDS - start)) s"; start=$SECONDS
    (cd benchmarks && timeout 60 python3 gpu_runtime_step.py --models llama8b \
        --slice-layers 8 --cases plan,selective --fused \
        --out "$OUT/${gpu}_llama8b_slice_steady.json")
    echo "slice took $((SECONDS - start)) s"
    exit 0
fi
if [ "$MODE" = moe ]; then
    (cd benchmarks && timeout 150 python3 gpu_moe.py --sustain 1 --out "$OUT/${gpu}_moe.json")
    echo "moe took $((SECONDS - start)) s"; start=$SECONDS
    (cd /tmp && timeout 90 autopar profile --quick --out "$OUT/$gpu.quick.profile.json")
    echo "quick profile took $((SECONDS - start)) s"; start=$SECONDS
    (cd benchmarks && timeout 100 python3 gpu_attention_long.py \
        --out "$OUT/${gpu}_attention_long.json")
    echo "attention took $((SECONDS - start)) s"; start=$SECONDS
    (cd benchmarks && timeout 110 python3 gpu_layers.py --plans ../.gpu/plans --sustain 1 \
        --cases "$(cat ../.gpu/hostbound.txt)" --out "$OUT/${gpu}_layers_hostbound.json" \
        --time-limit 95)
    echo "layers took $((SECONDS - start)) s"
    rm -f "$OUT"/*.partial.jsonl
    exit 0
fi
if [ "$gpu" = h200 ]; then
    timeout 200 autopar profile --out "$OUT/$gpu.profile.json" --time-limit-s 120
else
    timeout 120 autopar profile --quick --out "$OUT/$gpu.profile.json"
fi
echo "profile took $((SECONDS - start)) s"; start=$SECONDS
(cd benchmarks && timeout 240 python3 gpu_layers.py --plans ../.gpu/plans \
    --out "$OUT/${gpu}_layers.json" --time-limit 190)
echo "layers took $((SECONDS - start)) s"; start=$SECONDS
(cd benchmarks && timeout 150 python3 gpu_runtime_step.py --models llama8b --slice-layers 8 \
    --cases plan,none,selective,full --fused --profile none,selective \
    --out "$OUT/${gpu}_llama8b_slice.json")
echo "slice took $((SECONDS - start)) s"
rm -f "$OUT"/*.partial.jsonl
