#!/usr/bin/env bash
# The GPU recipe (configs/smollm2-h200.yaml) on one lent H200, in device calls of at most 10
# minutes. The SmolLM2 GGUF (98 MB) exceeds one call's 64 MiB, so it travels in two halves:
# .gpu_a/gguf.part0 (call "stage") and .gpu_b/gguf.part1 (call "recipe"); /tmp/dflash keeps the
# first half, the caches and the run while the machine stays warm between calls (~30 s idle).
# The greedy answers regenerated on 2026-11-30 travel in .gpu_c (regeneration is keyed, so they
# are reused, not generated again). Wheels missing there (gguf, tensorboardX) travel in .whl.
# Prepare the folders here with:
#   split -b 49181216 <the GGUF> /tmp/gguf_part_ && cp /tmp/gguf_part_aa .gpu_a/gguf.part0 &&
#   cp /tmp/gguf_part_ab .gpu_b/gguf.part1
#   python scripts/first_turns.py sharegpt /tmp/f.jsonl && gzip -9c /tmp/f.jsonl > .gpu_a/sharegpt_first_turns.jsonl.gz
#   (+ .gpu_a/smollm2_cfg: the GGUF target's config.json and tokenizer files, save_pretrained)
# Parts (run back to back):
#   stage    copies the first half of the GGUF and the data to /tmp/dflash
#   recipe   joins the GGUF, regenerates what is not cached yet (the sampled answers of
#            data.regenerate_samples), then trains for what is left of the call (no evaluation)
#   resume   continues the run from its checkpoint and evaluates held-out tau where it stops
# Environment: EXTRA (config overrides for the run), LIMIT (the call's seconds, default 585),
# EVAL_S (seconds kept for the evaluation in "resume", default 260: 32 prompts took ~200 s on 2026-12-01).
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
RUN=$D/runs/recipe
COMMON=(--config configs/smollm2-h200.yaml "target.path=$D/smollm2" "target.gguf_file=$GGUF"
        "data.path=$D/sharegpt_first_turns.jsonl" "data.cache_dir=$D/cache" "train.output_dir=$RUN")
left() { echo $(( ${LIMIT:-585} - ($(date +%s) - T0) )); }

case "${1:-}" in
  stage)
    cp .gpu_a/gguf.part0 "$D/gguf.part0"
    gunzip -c .gpu_a/sharegpt_first_turns.jsonl.gz > "$D/sharegpt_first_turns.jsonl"
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv ;;
  recipe)
    [ -f "$D/gguf.part0" ] && [ -f "$D/sharegpt_first_turns.jsonl" ] || {
      echo "no $D/gguf.part0: the machine went cold; run 'stage' first"; exit 3; }
    mkdir -p "$D/smollm2" "$D/cache"
    cat "$D/gguf.part0" .gpu_b/gguf.part1 > "$D/smollm2/$GGUF"
    sha256sum "$D/smollm2/$GGUF" | cut -c1-16   # b179c9523d0e6a0f
    [ -f "$D/cache/regenerated.jsonl" ] || [ ! -f .gpu_c/regenerated.jsonl.gz ] || gunzip -c .gpu_c/regenerated.jsonl.gz > "$D/cache/regenerated.jsonl"
    wc -l "$D/cache/regenerated.jsonl"
    run timeout 300 python3 -m jax_drafter.regenerate "${COMMON[@]}" ${EXTRA:-} \
        --json "$OUT/regen.json" --quiet > "$OUT/regen.log" 2>&1
    tail -n 4 "$OUT/regen.log"
    # Brought back so that a cold machine need not regenerate: gzip, in 15 MB pieces.
    gzip -c "$D/cache/regenerated.jsonl" | split -b 15000000 - "$OUT/regenerated.jsonl.gz."
    MIN=$(python3 -c "print(max(0.5, ($(left) - 75) / 60))")
    echo "training for $MIN minutes"
    run timeout $(( $(left) - 5 )) python3 -m jax_drafter.train "${COMMON[@]}" train.eval_prompts=0 \
        ${EXTRA:-} --max-minutes "$MIN" --quiet --no-export > "$OUT/train.log" 2>&1 ;;
  resume)
    [ -d "$RUN/checkpoints" ] || { echo "no $RUN/checkpoints: the machine went cold"; exit 3; }
    MIN=$(python3 -c "print(max(0.5, ($(left) - ${EVAL_S:-260} - 60) / 60))")
    echo "training for $MIN minutes, then the held-out evaluation"
    run timeout $(( $(left) - 5 )) python3 -m jax_drafter.train "${COMMON[@]}" ${EXTRA:-} \
        --max-minutes "$MIN" --quiet > "$OUT/train-resume.log" 2>&1
    ls "$RUN" "$RUN/best" 2>/dev/null ;;
  *) echo "usage: $0 stage|recipe|resume"; exit 2 ;;
esac
if [ -f "$RUN/metrics.jsonl" ]; then
  cp "$RUN/metrics.jsonl" "$OUT/metrics.jsonl"
  grep -h -E "step [0-9]+/|validation|tau |lossless|near-tie|rror|time budget|resumed" "$OUT"/train*.log | tail -n 14
fi
echo "part took $(( $(date +%s) - T0 )) s"
