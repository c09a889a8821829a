#!/usr/bin/env bash
# The GPU measurements the open issues ask for. Each part fits one 10-minute device call; given
# several parts, part i runs on GPU i (CUDA_VISIBLE_DEVICES=i), all at once, so a 4-GPU machine
# runs four parts in the wall time of the longest.
# Run from the repo root on a GPU machine that has jax/flax/optax/orbax/torch/transformers:
#   bash scripts/h200_checks.sh kernel          # pytest -m gpu for the Pallas kernel + kernel bench
#   bash scripts/h200_checks.sh kernel-tests kernel-smollm2   # the tests, the SmolLM2-shaped bench
#   bash scripts/h200_checks.sh mosaic          # the Mosaic GPU kernels: the kernel bench against
#                                               # Triton (sliding 8k, full 64k), then GPU tests
#   bash scripts/h200_checks.sh mosaic-all      # 8k bench, default-step, GPU tests (~8 min)
#   bash scripts/h200_checks.sh default-step    # the 27b-8k step, the default vs Triton throughout
#   bash scripts/h200_checks.sh kernel-table    # the kernels against cuDNN and flex (sliding 8k)
#   bash scripts/h200_checks.sh parity          # Qwen3.6-27B shapes, bf16, Pallas vs compiled flex
#   bash scripts/h200_checks.sh memory          # predicted vs measured peak, 27B 8k/64k, budget 131k
#   bash scripts/h200_checks.sh bench           # full step JAX vs both PyTorch rows, 27b-8k
#   bash scripts/h200_checks.sh bench-breakdown # the JAX step's parts + JAX with per-layer remat
#   bash scripts/h200_checks.sh bench-smol      # the SmolLM2 recipe's step at 512/256/128 anchors
#   bash scripts/h200_checks.sh bench-8b bench-32k bench-64k   # the other bench cases
#   bash scripts/h200_checks.sh hybrid-27b      # hybrid GPU tests, a 27B-shaped hybrid target + the
#                                               # 27B drafter's step on one GPU (issue #14)
#   bash scripts/h200_checks.sh target-attention   # packed rows: flex block mask vs dense SDPA
#   bash scripts/h200_checks.sh generation      # regeneration's decoder: GPU tests + tokens/s
#   bash scripts/h200_checks.sh spec-decode     # evaluation's static-cache decoder: GPU tests + step time
#   bash scripts/h200_checks.sh layouts-1gpu    # issue #13's one-GPU figures: target bound + shared
#   bash scripts/h200_checks.sh learn-parity-recipe   # after a recipe pipeline, on its files
#   bash scripts/h200_checks.sh cublas          # 27b-8k JAX step + 8192^3 matmul, cuBLAS vs Triton GEMM
#   bash scripts/h200_checks.sh kernel parity memory bench     # four GPUs, four parts at once
#   BENCH_DEVICES=1,2,3 bash scripts/h200_checks.sh bench-all  # all bench cases over three GPUs
# Logs and JSON go to $OUT (the device tool's output folder) or ./gpu-results.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
LIMIT=${LIMIT:-570}    # seconds for a whole part
[ $# -ge 1 ] || { echo "which parts: kernel kernel-tests kernel-bench kernel-smollm2 mosaic mosaic-all default-step kernel-table parity memory bench bench-all" \
                      "bench-8k bench-remat bench-8b bench-32k bench-64k cublas"; exit 2; }

part_cmds() {
  local part=$1
  run() { echo "=== [$(date +%T)] $*"; "$@" 2>&1; }
  case "$part" in
    kernel)
      part_cmds kernel-tests
      part_cmds kernel-bench ;;
    kernel-tests)
      local xd=""
      python3 -c "import xdist" 2>/dev/null && xd="-n 6"
      run timeout 240 python3 -m pytest tests/pallas_kernels -m gpu -q -rf -p no:cacheprovider $xd ;;
    kernel-bench)   # alone on the machine: CPU load from other jobs slows the launch-bound rows
      run timeout 300 python3 -m bridge.twin.bench_attention --budget-s 200 ;;
    mosaic)         # the Mosaic GPU kernels (mosaic_gpu.py): out and gradients against the
                    # reference, then timed beside the Triton kernel after matching its outputs
      # (one H100, 2026-12-05: 8k with three tile variants took ~110 s; the GPU tests did not
      # finish in 110 s with the warp-specialised cases, hence 240 s and last)
      run timeout 100 python3 -m pallas_kernels.dflash_attention.bench --mosaic --no-baselines \
          --shapes 8192x1024 --mosaic-tiles default,wg1
      run timeout 150 python3 -m pallas_kernels.dflash_attention.bench --mosaic --no-baselines \
          --shapes 65536x2048 --layers full --mosaic-tiles default,wg1
      run timeout 240 python3 -m pytest tests/pallas_kernels/test_mosaic_gpu.py -m gpu -q -rf \
          -p no:cacheprovider ;;
    mosaic-all)     # one call: the sliding 8k bench, the 27b-8k step pair, then the GPU tests
                    # with what time is left (2026-12-06: 110 s ended the bench before its last
                    # row; two variants' four rows take ~120 s)
      run timeout 180 python3 -m pallas_kernels.dflash_attention.bench --mosaic --no-baselines \
          --shapes 8192x1024 --mosaic-tiles default,wg1
      part_cmds default-step
      run timeout 150 python3 -m pytest tests/pallas_kernels/test_mosaic_gpu.py -m gpu -q -rf -x \
          -p no:cacheprovider ;;
    default-step)   # the 27B drafter's whole step: the default (the Mosaic GPU kernels on a
                    # Hopper GPU at its head size 128) against the Triton kernels
      run timeout 150 python3 -m jax_drafter.tools.bench --case 27b-8k --side jax --timeout 130 \
          --json "$OUT/bench-step-default.json"
      run timeout 150 python3 -m jax_drafter.tools.bench --case 27b-8k --side jax --timeout 130 \
          --attention triton --json "$OUT/bench-step-triton.json" ;;
    kernel-table)   # #15's kernel table at sliding 8k: Triton, the Mosaic GPU kernels (the default
                    # on Hopper), cuDNN's dense causal ceiling, compiled flex, the XLA path
      run timeout 250 python3 -m bridge.twin.bench_attention --mosaic --shapes 8192x1024 \
          --layers sliding --budget-s 200 ;;
    kernel-smollm2) # the SmolLM2 recipe's attention (9/3 heads, head size 64, a 2048-token row
                    # with 512 anchors): the kernel against the dense XLA path it used to take,
                    # and the Mosaic GPU kernels (default and one-warpgroup tiles), which api.py's
                    # default takes from head size 64 on (MOSAIC_DEFAULT_MIN_HEAD_DIM), as this
                    # part timed on 2026-12-06
      run timeout 250 python3 -m pallas_kernels.dflash_attention.bench --heads 9/3 --head-dim 64 \
          --shapes 2048x512,8192x2048 --layers full --budget-s 150 --mosaic \
          --mosaic-tiles default,wg1 ;;
    parity)
      run timeout 560 python3 -m jax_drafter.tools.parity --config 27b-8k --device gpu \
          --dtype bfloat16 --jax-attention triton --torch-attention flex --steps 3 \
          --json "$OUT/parity.json" ;;
    memory)
      for sn in "8192 1024" "65536 2048"; do
        set -- $sn
        run timeout 150 python3 -m jax_drafter.tools.memory --config 27b-8k --seq-len "$1" \
            --anchors "$2" --run --no-scaling
      done
      run timeout 300 python3 -m jax_drafter.tools.memory --config 27b-8k --seq-len 131072 \
          --anchors 4096 --budget 96GiB --run --no-scaling ;;
    bench)          # the three rows of 27b-8k in one call: on one H200 (2026-12-02) the JAX row
                    # took ~35 s, each PyTorch row ~125-141 s of compilation before its timed steps
      run timeout 570 python3 -m jax_drafter.tools.bench --case 27b-8k --timeout 260 \
          --json "$OUT/bench.json" ;;
    bench-smol)   # the SmolLM2 GPU recipe's drafter step at 512 / 256 / 128 anchors per row, and
                  # the parts of the 512-anchor step (what fewer anchors would buy)
      run timeout 330 python3 -m jax_drafter.tools.bench --case smol-2k-a512 --case smol-2k-a256 \
          --case smol-2k-a128 --side jax --breakdown smol-2k-a512 --timeout 200 \
          --json "$OUT/bench-smol.json" ;;
    bench-breakdown)  # the JAX step's parts, and the JAX row with per-layer remat
      run timeout 300 python3 -m jax_drafter.tools.bench --case 27b-8k --side jax --breakdown 27b-8k \
          --timeout 280 --json "$OUT/bench-breakdown.json"
      run timeout 140 python3 -m jax_drafter.tools.bench --case 27b-8k --side jax --remat layer \
          --timeout 130 --json "$OUT/bench-remat.json" ;;
    bench-all)
      # Every bench case, the (case, side) runs spread over BENCH_DEVICES, one per GPU at a time.
      run timeout 560 python3 -m jax_drafter.tools.bench --devices "${BENCH_DEVICES:-0,1,2}" \
          --case 27b-8k --case 27b-64k --case 8b-3k --case 27b-32k --breakdown 27b-8k \
          --timeout 420 --json "$OUT/bench-all.json" ;;
    bench-8k)
      run timeout 400 python3 -m jax_drafter.tools.bench --devices "${BENCH_DEVICES:-0,1}" \
          --case 27b-8k --breakdown 27b-8k --timeout 380 --json "$OUT/bench-8k.json" ;;
    bench-remat)    # JAX alone: per-layer remat at 8k and 64k, and 8k with cuBLAS GEMMs only
      run timeout 150 python3 -m jax_drafter.tools.bench --case 27b-8k --side jax --remat layer --timeout 140
      run timeout 150 python3 -m jax_drafter.tools.bench --case 27b-64k --side jax --remat layer --timeout 140
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_triton_gemm=false" run timeout 150 \
          python3 -m jax_drafter.tools.bench --case 27b-8k --side jax --timeout 140 ;;
    bench-8b|bench-32k|bench-64k)
      local case=${part#bench-}; case=${case/8b/8b-3k}; case=${case/32k/27b-32k}; case=${case/64k/27b-64k}
      run timeout 560 python3 -m jax_drafter.tools.bench --case "$case" --timeout 270 \
          --json "$OUT/$part.json" ;;
    cublas)
      run timeout 60 python3 scripts/matmul_peak.py
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_triton_gemm=false" run timeout 60 python3 scripts/matmul_peak.py
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_triton_gemm=false" run timeout 200 \
          python3 -m jax_drafter.tools.bench --case 27b-8k --side jax --timeout 190 ;;
    hybrid-27b)   # issue #14: a random Qwen3.6-27B-shaped hybrid target (~54 GB) and the 27B
                  # drafter's step on one GPU; carry .gpu_fla (fla_core, flash_linear_attention,
                  # einops wheels), installed into /tmp/site first
      [ -d .gpu_fla ] && python3 -m pip install -q --no-index --no-deps --no-compile \
          --no-cache-dir --upgrade --target /tmp/site .gpu_fla/*.whl
      PYTHONPATH=/tmp/site:. run timeout 300 python3 -m pytest -m gpu -q -rs -p no:cacheprovider \
          tests/bridge/test_hybrid.py tests/bridge/test_target_memory.py
      PYTHONPATH=/tmp/site:. run timeout 500 python3 scripts/target_memory_check.py \
          --random qwen3.6-27b --shapes 1x8192,4x2048,67x122 --docs 4 \
          --then "python3 -m jax_drafter.tools.bench --case 27b-8k --side jax --timeout 240 --json $OUT/bench-beside-target.json" ;;
    spec-decode)  # evaluation's target decoder: the static-cache decoder's GPU tests (CUDA-graph
                  # verify steps == eager ones) and regeneration's, which share the graph capture
                  # (bridge.generation.capture_graph), the feature cache's pinned host tier, then
                  # one verify step's time per decoder
      run timeout 300 python3 -m pytest -m gpu -q -rf -p no:cacheprovider \
          tests/bridge/test_spec_decode_gpu.py tests/bridge/test_generation_gpu.py \
          tests/bridge/test_target_gpu.py
      run timeout 240 python3 scripts/bench_verify.py --json "$OUT/bench-verify.json" ;;
    generation)   # regeneration's decoder: its GPU tests (graph == eager, concurrent batches on
                  # their own streams, compiled), then tokens/s at the recipe's shapes, 1 and 2
                  # batches at once, eager transformers and torch.compile'd
      run timeout 240 python3 -m pytest -m gpu -q -rf -p no:cacheprovider tests/bridge/test_generation_gpu.py
      run timeout 300 python3 scripts/bench_generation.py --rows 512,1024 --prompt-len 1024 --new 192 \
          --concurrent 1,2 --compile --json "$OUT/bench-generation.json"
      # long prompts (the later turns of the every-turn data): the prefill's chunks, the peak memory
      run timeout 200 python3 scripts/bench_generation.py --rows 1024 --prompt-len 1800 --new 192 \
          --concurrent 1,2 --json "$OUT/bench-generation-long.json" ;;
    target-attention)  # target.attention: flex (block mask) against the dense-mask SDPA: the GPU
                       # test (and the feature cache's pinned host tier), then the features
                       # forward's speed and peak memory on packed rows
      run timeout 240 python3 -m pytest -m gpu -q -rs -p no:cacheprovider \
          tests/bridge/test_target_memory.py::test_flex_document_attention_on_cuda \
          tests/bridge/test_target_gpu.py
      run timeout 300 python3 scripts/target_forward_bench.py --json "$OUT/target-forward.json" ;;
    layouts-1gpu)  # issue #13 on one GPU: the target-forward bound and the shared layout
                   # (SmolLM2-1.7B shapes, random weights, 3-layer drafter, 8 x 2048, 256 anchors).
                   # A tokenizer directory in LAYOUT_TOKENIZER (default .gpu_t/tokenizer: the
                   # SmolLM2 tokenizer saved with save_pretrained) and ShareGPT rows in LAYOUT_DATA
                   # (default .gpu_t/sharegpt4200.jsonl: the packaged ShareGPT's first 4200
                   # conversations as JSONL); carry .gpu_t.
      run timeout 520 python3 scripts/layouts_bench.py --tokenizer "${LAYOUT_TOKENIZER:-.gpu_t/tokenizer}" \
          --data "${LAYOUT_DATA:-.gpu_t/sharegpt4200.jsonl}" --layouts shared --out /tmp/layouts
      cp /tmp/layouts/layouts.json /tmp/layouts/shared.log /tmp/layouts/drafter-alone.log "$OUT/" 2>/dev/null
      [ -f /tmp/layouts/shared/metrics.jsonl ] && gzip -c /tmp/layouts/shared/metrics.jsonl > "$OUT/layouts-shared-metrics.jsonl.gz" ;;
    learn-parity-recipe)  # issue #11: JAX vs the PyTorch reference drafter learning at the recipe's
                          # shapes, on what a finished h200_recipe.sh pipeline left in /tmp/dflash
                          # (GGUF, data, regenerated answers). The torch side in SDPA: with compiled
                          # flex_attention its first step took 312 s (2026-12-02).
      local D=/tmp/dflash
      PYTHONPATH=/tmp/site:. run timeout 540 python3 -m jax_drafter.tools.learn_parity \
          --config configs/smollm2-h200.yaml --device gpu --steps 100 --every 10 --eval-prompts 8 \
          --torch-attention sdpa --set target.path=$D/smollm2 \
          --set target.gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf \
          --set data.path=$D/sharegpt_user_turns.jsonl --set data.cache_dir=$D/cache \
          --set target.feature_cache_gib=0 --json "$OUT/learn-parity.json" ;;
    *) echo "unknown part $part"; return 2 ;;
  esac
}

if [ $# -eq 1 ]; then
  timeout "$LIMIT" bash -c "$(declare -f part_cmds); OUT=$OUT; part_cmds $1" 2>&1 | tee "$OUT/$1.log"
  exit 0
fi
i=0
for part in "$@"; do
  CUDA_VISIBLE_DEVICES=$i timeout "$LIMIT" \
      bash -c "$(declare -f part_cmds); OUT=$OUT; part_cmds $part" > "$OUT/$part.log" 2>&1 &
  echo "[$(date +%T)] $part on GPU $i (pid $!)"
  i=$((i + 1))
done
wait
for part in "$@"; do echo; echo "########## $part"; tail -c 4000 "$OUT/$part.log"; done
