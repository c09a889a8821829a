#!/usr/bin/env bash
# The GPU measurements the open issues ask for, one part per call (each fits a 10-minute call).
# Run from the repo root on a GPU machine that has jax/flax/optax/orbax/torch/transformers:
#   bash scripts/h200_checks.sh kernel   # pytest -m gpu for the Pallas kernel + the kernel bench
#   bash scripts/h200_checks.sh parity   # Qwen3.6-27B shapes, bf16, Pallas vs compiled flex
#   bash scripts/h200_checks.sh memory   # predicted vs measured peak, 27B 8k/64k, budget at 131k
#   bash scripts/h200_checks.sh bench    # full step JAX vs PyTorch: 27b-8k and 8b-3k
#   bash scripts/h200_checks.sh bench-long   # the same for 27b-32k and 27b-64k
# Logs and JSON go to $OUT (the device tool's output folder) or ./gpu-results.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
run() { echo "=== $*"; "$@" 2>&1 | tee -a "$OUT/$part.log"; }
part=${1:?"which part: kernel | parity | memory | bench | bench-long"}
case "$part" in
  kernel)
    run timeout 300 python3 -m pytest tests/pallas_kernels -m gpu -q -rf -p no:cacheprovider
    run timeout 280 python3 -m pallas_kernels.dflash_attention.bench ;;
  parity)
    run timeout 580 python3 -m jax_drafter.parity --config qwen3.6-27b --device gpu \
        --dtype bfloat16 --jax-attention triton --torch-attention flex --steps 3 \
        --json "$OUT/parity.json" ;;
  memory)
    for sn in "8192 1024" "65536 2048"; do
      set -- $sn
      run timeout 150 python3 -m jax_drafter.memory --config qwen3.6-27b --seq-len "$1" \
          --anchors "$2" --run --no-scaling
    done
    run timeout 280 python3 -m jax_drafter.memory --config qwen3.6-27b --seq-len 131072 \
        --anchors 4096 --budget 96GiB --run --no-scaling ;;
  bench)
    run timeout 590 python3 -m jax_drafter.bench --case 27b-8k --case 8b-3k --timeout 280 \
        --json "$OUT/bench.json" ;;
  bench-long)
    run timeout 590 python3 -m jax_drafter.bench --case 27b-32k --case 27b-64k --timeout 280 \
        --json "$OUT/bench-long.json" ;;
  *) echo "unknown part $part"; exit 2 ;;
esac
