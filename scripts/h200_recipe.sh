#!/usr/bin/env bash
# The drafter-quality measurements on the lent H200s (two GPUs: nvidia-h200-x2), in device calls
# of at most 10 minutes. The SmolLM2 GGUF (98 MB) exceeds one call's 64 MiB, so it travels in two
# halves: .gpu_a/gguf.part0 (call "checks") and .gpu_b/gguf.part1 (call "recipe"); /tmp/dflash
# keeps the first half while the machine stays warm between the two calls. Wheels missing there
# (gguf, tensorboardX) travel in .whl. Prepare them here with:
#   split -b 49181216 <the GGUF> /tmp/gguf_part_ && cp /tmp/gguf_part_aa .gpu_a/gguf.part0 &&
#   cp /tmp/gguf_part_ab .gpu_b/gguf.part1
#   python scripts/first_turns.py sharegpt /tmp/f.jsonl && gzip -9c /tmp/f.jsonl > .gpu_a/sharegpt_first_turns.jsonl.gz
#   (+ .gpu_a/smollm2_cfg: the GGUF target's config.json and tokenizer files, save_pretrained)
# Parts:
#   checks   GPU tests of the decoder (CUDA graph == eager, == HF generate), the decode benchmark
#            on a random target of SmolLM2's shapes, and the recipe's train step timed on that
#            random target (GPU 1), at once
#   recipe   regeneration of the training answers (half per GPU), then the recipe trained on GPU 0
#            and a variant (EXTRA_B: config overrides) on GPU 1, each stopping in time to evaluate
#   resume   both runs continue from their checkpoints (same commands) for TRAIN_MINUTES more
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
D=/tmp/dflash
mkdir -p "$OUT" "$D"
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false HF_HUB_OFFLINE=1
run() { echo "=== [$(date +%T)] $*"; "$@"; }
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
COMMON=(--config configs/smollm2-h200.yaml "target.path=$D/smollm2" "target.gguf_file=$GGUF"
        "data.path=$D/sharegpt_first_turns.jsonl" "data.cache_dir=$D/cache")

case "${1:-}" in
  checks)
    cp .gpu_a/gguf.part0 "$D/gguf.part0"
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
    # A random-weight target with SmolLM2's config and tokenizer (speed does not depend on weights).
    python3 - <<'EOF'
import torch
from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM
cfg = AutoConfig.from_pretrained(".gpu_a/smollm2_cfg")
torch.manual_seed(0)
LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained("/tmp/dflash/random_smollm2")
AutoTokenizer.from_pretrained(".gpu_a/smollm2_cfg").save_pretrained("/tmp/dflash/random_smollm2")
EOF
    gunzip -c .gpu_a/sharegpt_first_turns.jsonl.gz > "$D/sharegpt_first_turns.jsonl"
    (CUDA_VISIBLE_DEVICES=0 run timeout 200 python3 -m pytest tests/bridge/test_generation_gpu.py -m gpu -q -rf -p no:cacheprovider
     CUDA_VISIBLE_DEVICES=0 run timeout 240 python3 scripts/bench_generation.py --rows 64,256,512 --json "$OUT/bench_generation.json") > "$OUT/gpu0.log" 2>&1 &
    # The recipe's step on ShareGPT answers (no regeneration) with the random target: ms/step.
    (CUDA_VISIBLE_DEVICES=1 run timeout 60 python3 -m jax_drafter.train --config configs/smollm2-h200.yaml \
        "target.path=$D/random_smollm2" "data.path=no_such_file.jsonl" --quiet 2>&1 | tail -1
     CUDA_VISIBLE_DEVICES=1 run timeout 420 python3 -m jax_drafter.train --config configs/smollm2-h200.yaml \
        "target.path=$D/random_smollm2" "data.path=$D/sharegpt_first_turns.jsonl" data.regenerate=false \
        "data.cache_dir=$D/cache-random" data.max_conversations=4000 train.steps=300 train.eval_prompts=4 \
        train.eval_max_new_tokens=32 train.log_every=25 "train.output_dir=$D/runs/random" --quiet --no-export) > "$OUT/gpu1.log" 2>&1 &
    wait
    tail -n 30 "$OUT/gpu0.log"; grep -E "step .*/300|tau|error|Error|done in" "$OUT/gpu1.log" | tail -n 20 ;;
  recipe|resume)
    if [ "$1" = recipe ]; then
      [ -f "$D/gguf.part0" ] && [ -f "$D/sharegpt_first_turns.jsonl" ] || {
        echo "no $D/gguf.part0: the machine went cold; run 'checks' first"; exit 3; }
      mkdir -p "$D/smollm2" "$D/cache"
      cat "$D/gguf.part0" .gpu_b/gguf.part1 > "$D/smollm2/$GGUF"
      sha256sum "$D/smollm2/$GGUF" | cut -c1-16   # b179c9523d0e6a0f
      for i in 0 1; do
        CUDA_VISIBLE_DEVICES=$i run timeout 240 python3 -m jax_drafter.regenerate "${COMMON[@]}" \
            --shard $i/2 --out "$D/regen$i.jsonl" --json "$OUT/regen$i.json" --quiet > "$OUT/regen$i.log" 2>&1 &
      done
      wait
      tail -n 3 "$OUT"/regen*.log
      cat "$D/regen0.jsonl" "$D/regen1.jsonl" > "$D/cache/regenerated.jsonl"
      # Brought back (a cold machine would otherwise have to regenerate): gzip, in 15 MB pieces.
      gzip -c "$D/cache/regenerated.jsonl" | split -b 15000000 - "$OUT/regenerated.jsonl.gz."
    fi
    LEFT=$(( ${LIMIT:-585} - ($(date +%s) - T0) ))
    # Train until EVAL_S (+ start-up) before the call's end; each run evaluates where it stops.
    MIN=$(python3 -c "print(max(1.0, ($LEFT - ${EVAL_S:-150} - 100) / 60))")
    echo "training for $MIN minutes per run"
    CUDA_VISIBLE_DEVICES=0 run timeout $((LEFT - 5)) python3 -m jax_drafter.train "${COMMON[@]}" \
        "train.output_dir=$D/runs/recipe" ${EXTRA:-} --max-minutes "$MIN" --quiet > "$OUT/train.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=1 run timeout $((LEFT - 5)) python3 -m jax_drafter.train "${COMMON[@]}" \
        "train.output_dir=$D/runs/recipe-b" ${EXTRA:-} ${EXTRA_B:-} --max-minutes "$MIN" --quiet > "$OUT/train-b.log" 2>&1 &
    wait
    cp "$D/runs/recipe/metrics.jsonl" "$OUT/metrics.jsonl"; cp "$D/runs/recipe-b/metrics.jsonl" "$OUT/metrics-b.jsonl"
    for f in train train-b; do echo "--- $f"; grep -E "step [0-9]+/|tau |lossless|near-tie|error|Error|time budget" "$OUT/$f.log" | tail -n 12; done ;;
  *) echo "usage: $0 checks|recipe|resume"; exit 2 ;;
esac
echo "part took $(( $(date +%s) - T0 )) s"
