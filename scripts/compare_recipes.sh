#!/usr/bin/env bash
# Training recipes compared by decoding τ at a fixed budget: each variant trains from the same store
# with the same steps, then is evaluated by real speculative decoding on the held-out prompts.
#   bash scripts/scale_run.sh extract          # the store (FRACTION=0.4: ~39K samples, enough for short runs)
#   bash scripts/compare_recipes.sh train      # every variant at once, one process each on the one GPU
#   bash scripts/compare_recipes.sh eval       # train.eval of each variant's best checkpoint, at once (whole
#                                              # lm_head, as the default export serves it)
#   bash scripts/compare_recipes.sh pack       # metrics and eval JSON of every variant into $OUT
# On one GPU the variants run side by side: the small drafter's step leaves most of an H200 idle
# (22% MFU), so N processes finish N runs far sooner than one after another; each gets the same
# steps, and its rows' positions_per_s show what it got of the GPU.
# A variant may name its own store, the last --store wins: the 4-bit codec against bf16 on the same data
#   FRACTION=0.2 STORE=/dev/shm/bf16.zarr EXTRACT_ARGS="--dtype bfloat16" bash scripts/scale_run.sh extract
#   FRACTION=0.2 STORE=/dev/shm/mx.zarr EXTRACT_ARGS="--dtype mxfp4" bash scripts/scale_run.sh extract
#   VARIANTS="bf16:--store /dev/shm/bf16.zarr;mxfp4:--store /dev/shm/mx.zarr" bash scripts/compare_recipes.sh train
# Settings (environment): VARIANTS ("name:train options" separated by ';'), STORE, W (work dir,
# default /root/cmp), STEPS (cosine length, default 900: pick what every variant reaches within TLIM, or
# the one that goes further had more training; the train stage warns), TLIM (seconds each may train,
# 420), VAL (held-out samples, 500), VAL_STORE (train's --val-store instead: `scale_run.sh valstore`
# makes one of 32 a domain of the evaluation's validation prompts; val_decode_tau_96 then ranks the
# variants on its formats; with --val-tree-budget N in a variant's options, val_tree_tau_96 ranks its trees), WORKERS (DataLoader workers per variant, 3), EVAL_LIMIT (48), TOKENS (96),
# EVAL_ARGS (more train.eval options, e.g. --no-prompt-lookup: a third less evaluation time),
# GGUF (the target for eval; default: the run's).
set -uo pipefail
stage=$1
W=${W:-/root/cmp}; STORE=${STORE:-/dev/shm/scale.zarr}
VARIANTS=${VARIANTS:-"reach:;decay:--position-weights decay;visit:--visit-weight 1;block16:--block-size 16"}
TARGET=(); [ -n "${GGUF:-}" ] && TARGET=(--target "$GGUF")
mkdir -p "$W"
IFS=';' read -r -a VS <<< "$VARIANTS"
pids=()
run_all() {  # run_all CMD...: CMD once per variant, in the background; $name and $args are set for it
  pids=()
  for v in "${VS[@]}"; do
    name=${v%%:*}; args=${v#*:}
    "$@" > "$W/$name.$stage.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done  # only the processes this script started
}
train_one() {
  local held=(--val-samples "${VAL:-500}"); [ -n "${VAL_STORE:-}" ] && held=(--val-samples 0 --val-store "$VAL_STORE")
  # shellcheck disable=SC2086
  timeout $(( ${TLIM:-420} + 120 )) python3 -m train --config configs/smollm2-h200/train.toml --store "$STORE" \
    --out "$W/$name" --max-steps "${STEPS:-900}" --time-limit "${TLIM:-420}" "${held[@]}" \
    --val-every 300 --checkpoint-every 300 --workers "${WORKERS:-3}" --compile $args
}
eval_one() {
  # shellcheck disable=SC2086
  python3 -m train.eval --run "$W/$name" --limit "${EVAL_LIMIT:-48}" --max-new-tokens "${TOKENS:-96}" --json \
    "${TARGET[@]}" ${EVAL_ARGS:-}
}
case $stage in
train) run_all train_one
  last=()
  for v in "${VS[@]}"; do
    name=${v%%:*}
    step=$(grep '"loss"' "$W/$name/metrics.jsonl" 2>/dev/null | tail -n 1 | python3 -c \
      'import json,sys; t=sys.stdin.read(); print(json.loads(t)["step"] if t.strip() else 0)')
    last+=("$step")
    echo "$name: trained to step $step; last held-out:"
    grep val_decode_tau "$W/$name/metrics.jsonl" | tail -n 1 | python3 -c \
      'import json,sys; r=json.loads(sys.stdin.read() or "{}"); print({k: r.get(k) for k in ("step","val_loss","val_sim_tau","val_decode_tau","val_decode_tau_96","val_decode_tau_96_by_domain","val_tree_budget","val_tree_tau_96","val_tree_tau_96_by_domain") if k in r})'
  done
  # a variant that ran further had more training: its τ is not comparable (rerun with fewer STEPS)
  if [ "$(printf '%s\n' "${last[@]}" | sort -u | wc -l)" -gt 1 ]; then
    echo "warning: the variants stopped at different steps (${last[*]}): not equal budgets; set STEPS to what all reach in TLIM"
  fi;;
eval) run_all eval_one
  for v in "${VS[@]}"; do
    name=${v%%:*}
    tail -n 1 "$W/$name.eval.log" | python3 -c 'import json,sys
try: r = json.loads(sys.stdin.read())
except ValueError: print("no result"); sys.exit()
print(sys.argv[1], {k: r.get(k) for k in ("tau", "tau_per_response", "lossless", "speedup", "tau_by_domain",
                                         "draft_vocab_coverage", "checkpoint", "tree_curve")})' "$name"
  done;;
pack)
  out=${OUT:-/tmp/out}; mkdir -p "$out"
  for v in "${VS[@]}"; do
    name=${v%%:*}
    cp "$W/$name/metrics.jsonl" "$out/$name.metrics.jsonl" 2>/dev/null \
      || echo "warning: $W/$name has no metrics.jsonl (pack takes the VARIANTS the train stage had)" >&2
    cp "$W/$name/eval.json" "$out/$name.eval.json" 2>/dev/null
  done
  ls -la "$out";;
*) echo "stage must be train, eval or pack" >&2; exit 2;;
esac
