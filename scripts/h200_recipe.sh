#!/usr/bin/env bash
# The GPU recipe (configs/smollm2-h200.yaml) on one lent H200 as ONE pipeline (regenerate, train,
# evaluate) that outlives the device calls of at most 10 minutes: it runs in its own process
# session on the machine, and each call watches it until the call's end. The machine stays warm
# for ~30 s between calls, so the next call must follow at once; /tmp/dflash keeps everything.
#
# The SmolLM2 GGUF (98 MB) exceeds one call's 64 MiB, so it travels in three pieces:
# .gpu_a/gguf.part0 (call "stage"), .gpu_e/gguf.mid (a "stage" call, beside .gpu_u) and
# .gpu_b/gguf.part1 (call "launch": with the tracked files, ~25 MB, it must stay under 64 MiB).
# Wheels missing there (gguf, tensorboardX) travel in .whl. Prepare the folders here with:
#   G=<the GGUF>; head -c 36000000 $G > .gpu_a/gguf.part0 &&
#   tail -c +36000001 $G | head -c 30000000 > .gpu_e/gguf.mid && tail -c +66000001 $G > .gpu_b/gguf.part1
# (36 / 30 / 32 MB: the tracked files are ~25 MB on the evening of 2026-12-07, and a 40 MB piece with
# .whl no longer fits beside them; the middle one travels with the user turns, 7 MB)
#   cat .gpu_a/gguf.part0 .gpu_e/gguf.mid .gpu_b/gguf.part1 | sha256sum   # b179c9523d0e6a0f...
#   python scripts/user_turns.py sharegpt /tmp/u.jsonl && gzip -9c /tmp/u.jsonl > .gpu_u/sharegpt_user_turns.jsonl.gz
# (the turns and .gpu_a together with the tracked files exceed a call's 64 MiB: carry .gpu_u in a
# "stage" call of its own or beside .gpu_c)
# Calls (back to back, each with timeout_s=600):
#   stage    carry .gpu_a and .whl: wheels and the GGUF's first piece to /tmp/dflash; carry .gpu_u
#            (the user turns) and .gpu_e (the GGUF's middle) in the call carrying .gpu_c, or alone
#            (then STAGE_CHECKS="part ..." of scripts/h200_checks.sh, if set); again with carry
#            .gpu_c to restore earlier regenerated answers
#   launch   carry .gpu_b: joins the GGUF, starts the pipeline, watches it until the call ends
#            (refused while an earlier launch's pipeline runs; that launch's logs and drafter
#            parts move to logs/earlier-*; each EXTRA trains in a run directory of its own)
#   watch    watches the pipeline until it is done or the call ends (repeat until "pipeline done")
#   evaluate carry .gpu_b, after "stage" calls that carried .gpu_a/.whl, .gpu_u/.gpu_e and .gpu_d: only the
#            held-out evaluation, of a drafter whose machine was lost after training
# Each call copies the logs, metrics and results written so far to $OUT.
# The logs, metrics and results come back as logs.tar.gz; with the call that sees the pipeline
# done, the regenerated answers too (regen.xz.part_*, ~25 MB for the recipe's first answers and
# prompts, ~37 MB with two sampled first answers): keep them in .gpu_c, and a later session's extra "stage" call carrying .gpu_c (before
# "launch"; .gpu_b + .gpu_c exceed one call's 64 MiB) restores them, so its regeneration finds
# every conversation cached. The trained drafter (its export/ and config.json, xz parts
# drafter-ARM.xz.part_*, ~65 MB) comes back the same way: kept in .gpu_d, a later chain
# stage (.gpu_a .whl) -> stage (.gpu_u .gpu_e) -> stage (.gpu_d) -> evaluate (.gpu_b) measures it
# (`jax_drafter.evaluate --run-dir R --export`). Each set of parts comes back once.
# Environment: EXTRA (config overrides for regeneration and training), BUDGET_S (seconds from the
# pipeline's start until training must end: regeneration + training, default 1140; with the
# dataset's greedy answers restored from .gpu_c, 920 keeps the 20 minutes: their regeneration
# from scratch took 354 s with start-up, benchmarks/h200-2026-12-02d-faster-regen), EVAL_ARGS
# (jax_drafter.evaluate's, default all 64 held-out prompts of 128 new tokens, the target alone
# timed on all 64 too: ~3 minutes with start-up, benchmarks/h200-2026-12-04k-caches-per-prompt;
# earlier runs took the first 32, `jax_drafter.tools.compare --first 32` pairs the two), LIMIT (the call's seconds,
# default 580), ARMS ("name:overrides;name:overrides": launch runs the pipeline once per arm, in
# order, with BUDGET_S per arm; logs come back in arm-NAME/), CONFIG (the config the pipeline
# runs, default configs/smollm2-h200.yaml). With CONFIG=configs/smollm2.yaml the arms are the CPU
# default's recipe on the GPU: ~150 s an arm on an H100, start-up and evaluation included, where one
# arm takes ~13 minutes on 2 CPU cores. A lever can then be judged over seeds in one chain, e.g.
# ARMS="d0:data.held_out=64 train.seed=0;x0:data.held_out=64 LEVER train.seed=0;d1:..." EVAL_ARGS="--num-prompts 64
# --max-new-tokens 64 --speed-prompts 0". The GPU rounds otherwise than the CPU, so such arms compare
# with each other, not with CPU runs; they reproduced the CPU's +0.05 of 64 anchors + dropout over
# three seeds (benchmarks/h100-2026-12-07g-cpu-levers-on-gpu).
# The machine is released 30 s after a call ends: issue each next call at once.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
D=/tmp/dflash
L=$D/logs
mkdir -p "$OUT" "$D" "$L"
T0=$(date +%s)
export PYTHONPATH=/tmp/site:$D/src PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false HF_HUB_OFFLINE=1
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
RUN=$D/runs/${ARM:-recipe}
# A launch with another CONFIG or other EXTRA overrides on a machine still warm from an earlier one
# trains a run of its own (the trainer refuses a run directory holding another architecture, and
# would resume one of the same architecture); the same CONFIG and EXTRA again resume their run from
# the last checkpoint. (The default config's key is EXTRA alone, as before CONFIG existed.)
KEY="${CONFIG:+$CONFIG }${EXTRA:-}"
[ -n "${ARM:-}" ] || [ -z "$KEY" ] || RUN=$RUN-$(printf %s "$KEY" | sha256sum | cut -c1-8)
DONE=${DONE_FILE:-$D/DONE}
LOGS="pipeline.log regen.log regen.json train.log eval.log eval.json metrics.jsonl"  # one launch's, in $L
COMMON=(--config "${CONFIG:-configs/smollm2-h200.yaml}" "target.path=$D/smollm2" "target.gguf_file=$GGUF"
        "data.path=$D/sharegpt_user_turns.jsonl" "data.cache_dir=$D/cache" "train.output_dir=$RUN")
left() { echo $(( ${LIMIT:-580} - ($(date +%s) - T0) )); }
held_out_eval() {  # jax_drafter.evaluate's arguments choosing the drafter -> $L/eval.{json,log}
  python3 -m jax_drafter.evaluate "$@" --target-path "$D/smollm2" --gguf-file "$GGUF" \
      ${EVAL_ARGS:---num-prompts 64 --max-new-tokens 128 --speed-prompts 64} --json "$L/eval.json" > "$L/eval.log" 2>&1
  rc=$?; tail -n 12 "$L/eval.log"
  echo "evaluate rc=$rc after $(( $(date +%s) - P0 )) s" > "$DONE"
}
stamp() { echo "=== [$(date +%T)] $*"; }

collect() {  # what the pipeline wrote so far -> $OUT (at most 8 files come back, 16 MiB each)
  # the run the pipeline is training now (it writes $L/run; an arm's own run under ARMS)
  run=$(cat "$L/run" 2>/dev/null) && [ -f "$run/metrics.jsonl" ] && cp "$run/metrics.jsonl" "$L/metrics.jsonl"
  (cd "$L" && tar czf "$OUT/logs.tar.gz" $(ls -d $LOGS arm-* 2>/dev/null))
  # Once each, by the call that sees the pipeline done: the regenerated answers (regen.xz.part_*,
  # which a later session restores with a "stage" call carrying them in .gpu_c) and each trained
  # drafter (drafter-ARM.xz.part_*: its export/ and config.json, restored from .gpu_d so that
  # "evaluate" can measure a drafter whose machine was lost). Not earlier: a reply carrying them
  # takes long enough to reach the caller that the next call missed the machine's 30 s (2026-12-04
  # with the answers in a launch call's reply; again 2026-12-05, on an H100, with 25 MB: the
  # training lost at step 2,000). The last call has no next call to miss.
  [ -f "$D/DONE" ] || return 0
  for set in regen $(cd "$L" && ls drafter-*.xz.done 2>/dev/null | sed 's/\.xz\.done$//'); do
    [ -f "$L/$set.xz.done" ] && [ ! -f "$L/$set.xz.sent" ] || continue
    n=$(ls "$L/$set".xz.part_* | wc -l)
    room=$(( 8 - $(ls "$OUT" | wc -l) ))
    if [ "$n" -le "$room" ]; then
      cp "$L/$set".xz.part_* "$OUT/" && touch "$L/$set.xz.sent"
    else
      echo "$set: $n parts, $room files left to return in this call; the next call sends them"
    fi
  done
}

watch() {
  while [ ! -f "$D/DONE" ] && [ "$(left)" -gt 25 ]; do
    sleep 20
    # A line a minute: a short report is read, and the next call issued, within the 30 s the
    # machine waits (chains were lost after 6 KB reports; whether the reading time was the cause
    # is not known).
    [ $(( ($(date +%s) - T0) % 60 )) -lt 20 ] || continue
    f=$(ls -t "$L"/regen.log "$L"/train.log "$L"/eval.log 2>/dev/null | head -n 1)
    # the last line that says something (transformers repeats a tokenizer warning per batch)
    line=$(tr '\r' '\n' < "${f:-$L/pipeline.log}" 2>/dev/null | grep -v -e '^\s*$' \
        -e 'Ignoring clean_up_tokenization_spaces' | tail -n 1 | cut -c1-140)
    echo "[$(date +%T)] ${f##*/}: $line"
  done
  collect
  if [ -f "$D/DONE" ]; then echo "pipeline done: $(cat "$D/DONE")"; else echo "pipeline still running"; fi
  grep -h -E "regenerate: [0-9]+ tokens|validation \(|time budget|held-out|tau |lossless|rror" \
      "$L"/regen.log "$L"/train.log "$L"/eval.log 2>/dev/null | tail -n 6 | cut -c1-200
}

case "${1:-}" in
  stage)      # copies whatever of .whl, .gpu_a, .gpu_u, .gpu_c and .gpu_d this call carries
    if [ -d .whl ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
          --target /tmp/site .whl/*.whl || exit 1
    fi
    # The GGUF's first piece (.gpu_a), its middle (.gpu_e) and the user turns (.gpu_u), from
    # whichever call carries them; an earlier call's folders may still be on the machine.
    [ -f .gpu_a/gguf.part0 ] && { cp .gpu_a/gguf.part0 "$D/gguf.part0" || exit 1; }
    [ -f .gpu_e/gguf.mid ] && { cp .gpu_e/gguf.mid "$D/gguf.mid" || exit 1; }
    for f in .gpu_*/sharegpt_user_turns.jsonl.gz; do
      [ -f "$f" ] || continue
      gunzip -c "$f" > "$D/sharegpt_user_turns.jsonl.tmp" &&
          mv "$D/sharegpt_user_turns.jsonl.tmp" "$D/sharegpt_user_turns.jsonl" || exit 1
    done
    if ls .gpu_d/drafter-*.xz.part_* > /dev/null 2>&1; then   # a drafter of a lost machine
      rm -rf "$D/runs/restored" && mkdir -p "$D/runs/restored"
      cat .gpu_d/drafter-*.xz.part_* | xz -dc | tar x -C "$D/runs/restored" || exit 1
      echo "drafter restored: $(ls "$D/runs/restored")"
    fi
    if ls .gpu_c/regen.xz.part_* > /dev/null 2>&1; then   # an earlier session's answers
      mkdir -p "$D/cache"
      cat .gpu_c/regen.xz.part_* | xz -dc > "$D/cache/regenerated.jsonl" || exit 1
      echo "regenerated answers restored: $(wc -l < "$D/cache/regenerated.jsonl") conversations"
      # They are here already: not compressed and sent back again (24 MB in a launch call's reply
      # delayed the next call past the machine's 30 s; a run was lost so on 2026-12-04).
      mkdir -p "$L" && touch "$L/regen.xz.sent"
    fi
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
    # The rest of this call's time can serve other GPU checks (e.g. STAGE_CHECKS=kernel-tests).
    [ -z "${STAGE_CHECKS:-}" ] || OUT=$OUT LIMIT=$(( $(left) - 10 )) bash scripts/h200_checks.sh $STAGE_CHECKS ;;
  launch|evaluate)   # evaluate: only the held-out evaluation of the drafter "stage" restored
    [ -f "$D/gguf.part0" ] && [ -f "$D/gguf.mid" ] && [ -f "$D/sharegpt_user_turns.jsonl" ] || {
      echo "no $D/gguf.part0, gguf.mid or user turns: the machine went cold or a 'stage' call (.gpu_a, .gpu_e, .gpu_u) is missing"; exit 3; }
    [ "$1" = launch ] || [ -f "$D/runs/restored/config.json" ] || {
      echo "no restored drafter: run 'stage' carrying .gpu_d first"; exit 3; }
    mkdir -p "$D/smollm2" "$D/cache"
    cat "$D/gguf.part0" "$D/gguf.mid" .gpu_b/gguf.part1 > "$D/smollm2/$GGUF"
    sha256sum "$D/smollm2/$GGUF" | cut -c1-16   # b179c9523d0e6a0f
    if pgrep -f "$D/src/scripts/[h]200_recipe.sh" > /dev/null; then
      echo "a pipeline of an earlier launch is still running: 'watch' it, or stop it first"; exit 3
    fi
    # An earlier launch's logs and drafter parts (their "sent" marks too) move aside, so this
    # launch's drafter comes back and 'watch' reports this launch; the answers' parts stay.
    if [ -f "$L/run" ]; then
      old=$L/earlier-$(date +%s) && mkdir -p "$old"
      mv $(cd "$L" && ls -d $LOGS run drafter-* 2>/dev/null | sed "s|^|$L/|") "$old/"
    fi
    rm -rf "$D/src" "$D/DONE" && mkdir -p "$D/src"   # the code the pipeline runs, fixed at launch
    cp -r bridge jax_drafter pallas_kernels configs scripts pyproject.toml "$D/src/"
    mode=pipeline; [ -z "${ARMS:-}" ] || mode=arms; [ "$1" = launch ] || mode=eval-restored
    EXTRA=${EXTRA:-} BUDGET_S=${BUDGET_S:-1140} EVAL_ARGS=${EVAL_ARGS:-} ARMS=${ARMS:-} CONFIG=${CONFIG:-} \
        setsid nohup bash "$D/src/scripts/h200_recipe.sh" $mode \
        > "$L/pipeline.log" 2>&1 < /dev/null &
    sleep 2; watch ;;
  watch)
    [ -d "$D/src" ] || { echo "no pipeline on this machine: it went cold"; exit 3; }
    watch ;;
  arms)       # ARMS="name:overrides;name:overrides": the pipeline once per arm, in order, on the
              # same regenerated answers (the first arm regenerates, later ones find them cached);
              # each arm's logs end up in $L/arm-NAME, its run in $D/runs/NAME
    IFS=';' read -ra arms <<< "${ARMS:?ARMS=\"name:overrides;...\"}"
    : > "$L/arms.done"
    for a in "${arms[@]}"; do
      name=${a%%:*}; extra=${a#*:}
      stamp "arm $name: $extra"
      ARM=$name EXTRA="$extra" DONE_FILE="$L/$name.done" bash "$0" pipeline
      mkdir -p "$L/arm-$name"
      cp "$D/runs/$name/metrics.jsonl" "$L/metrics.jsonl" 2>/dev/null
      mv "$L"/regen.log "$L"/regen.json "$L"/train.log "$L"/eval.log "$L"/eval.json \
          "$L"/metrics.jsonl "$L/arm-$name/" 2>/dev/null
      echo "arm $name: $(cat "$L/$name.done")" >> "$L/arms.done"
    done
    cp "$L/arms.done" "$D/DONE" ;;
  pipeline)   # runs in $D/src, in its own session
    P0=$(date +%s)
    echo "$RUN" > "$L/run"
    stamp "regenerate"
    timeout 900 python3 -m jax_drafter.regenerate "${COMMON[@]}" ${EXTRA:-} \
        --json "$L/regen.json" --quiet > "$L/regen.log" 2>&1
    rc=$?; tail -n 3 "$L/regen.log"
    [ $rc -eq 0 ] || { echo "regenerate rc=$rc" > "$DONE"; exit 1; }
    # Compressed copy of the answers for later sessions, on 4 CPU cores beside the training.
    [ -e "$L/regen.xz.part_aa" ] || [ -e "$L/regen.xz.sent" ] || (nice -n 19 xz -T4 -6 -c "$D/cache/regenerated.jsonl" |
        split -b 15M - "$L/regen.xz.part_" && touch "$L/regen.xz.done") &
    # --max-minutes counts the training's start-up too; 10 s for the last checkpoint and export
    MIN=$(python3 -c "print(max(1.0, (${BUDGET_S:-1140} - ($(date +%s) - $P0) - 10) / 60))")
    stamp "train for $MIN minutes"
    python3 -m jax_drafter.train "${COMMON[@]}" train.eval_prompts=0 ${EXTRA:-} \
        --max-minutes "$MIN" --quiet > "$L/train.log" 2>&1
    rc=$?; tail -n 3 "$L/train.log"
    stamp "regeneration + training took $(( $(date +%s) - P0 )) s (train rc=$rc)"
    [ $rc -eq 0 ] || { echo "train rc=$rc" > "$DONE"; exit 1; }
    # The trained drafter (bf16 export + the run's settings, ~65 MB) comes back before the
    # evaluation, so a machine lost during it leaves the drafter for "evaluate" in a later call.
    name=drafter-${ARM:-recipe}
    (cd "$RUN" && tar c config.json export | xz -T8 -1 | split -b 15M - "$L/$name.xz.part_") &&
        touch "$L/$name.xz.done"
    stamp "evaluate"
    held_out_eval --run-dir "$RUN" ;;
  eval-restored)   # runs in $D/src: the evaluation the pipeline would have run, on the export
    P0=$(date +%s)
    stamp "evaluate the restored drafter (its end-of-training export)"
    held_out_eval --run-dir "$D/runs/restored" --export ;;
  *) echo "usage: $0 stage|launch|evaluate|watch"; exit 2 ;;
esac
echo "part took $(( $(date +%s) - T0 )) s"
