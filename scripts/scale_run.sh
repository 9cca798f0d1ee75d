#!/usr/bin/env bash
# The data-at-scale run on one machine with N GPUs (made for nvidia-h200-x2), stage by stage; every
# stage resumes when rerun, so a run spans several device calls while the machine stays warm.
#   bash scripts/scale_run.sh extract   # the committed 100K-sample recipe data -> fp8 store in /dev/shm
#   bash scripts/scale_run.sh train     # 5-layer drafter, DDP over all GPUs, resumes from its checkpoints
#   bash scripts/scale_run.sh eval      # float32 evaluation, 16 held-out prompts per domain, lossless check
#   bash scripts/scale_run.sh pack      # metrics, eval.json and log tails into $OUT
# Settings (environment): DATA (default: docs/results/recipe-default-100k/train.jsonl.gz), W (work
# dir, default /root/w), STORE (/dev/shm/scale.zarr), EPOCHS (6), LR (6e-4), TLIM (seconds this
# call may train, default 480), GGUF (default: the packaged model, found by importlib); for a CPU
# dry run of the stages: VAL, WORKERS, EVAL_LIMIT, TOKENS (1000, 6, 48, 16384).
# Expects PYTHONPATH to hold the wheels (zarr, numcodecs, ...) and the packaged target or GGUF.
set -uo pipefail
stage=$1
W=${W:-/root/w}; STORE=${STORE:-/dev/shm/scale.zarr}; RUN=$W/run
DATA=${DATA:-docs/results/recipe-default-100k/train.jsonl.gz}
NG=$(python3 -c 'import torch; print(max(1, torch.cuda.device_count()))')
GPU=$(python3 -c 'import torch; print(int(torch.cuda.is_available()))')
TARGET=(); [ -n "${GGUF:-}" ] && TARGET=(--target "$GGUF")
mkdir -p "$W"
L=(python3); [ "$NG" -gt 1 ] && L=(torchrun --standalone --nproc-per-node "$NG")  # one process per GPU
case $stage in
extract)
  gunzip -c "$DATA" > "$W/train.jsonl"
  # ~24M tokens (estimated from its ~90M characters): fp8 taps without the final hidden state
  # (CE training does not read it) are about 2.9 KB a token, ~70 GB in /dev/shm; with it ~97 GB
  "${L[@]}" -m extract --store "$STORE" --data "$W/train.jsonl" "${TARGET[@]}" --max-len 1024 \
    --token-budget 65536 --dtype fp8_e4m3 --no-last-hidden --json 2>&1 | grep -v "tok/s]" | tail -n 20
  python3 -m cache_format inspect "$STORE" | head -n 30;;
train)
  resume=(); [ -d "$RUN/checkpoints" ] && resume=(--resume)
  timeout "${TLIM:-480}" "${L[@]}" -m train --store "$STORE" --out "$RUN" --num-layers 5 --epochs "${EPOCHS:-6}" \
    --lr "${LR:-6e-4}" --token-budget "${TOKENS:-16384}" --log-every 20 --checkpoint-every 200 \
    --val-samples "${VAL:-1000}" --val-every 200 --workers "${WORKERS:-6}" $([ "$GPU" = 1 ] && echo --compile) \
    --loss ce "${resume[@]}" > "$W/train.log" 2>&1
  echo "train exit $? (124: the call's time limit; rerun to resume)"
  tr '\r' '\n' < "$W/train.log" | grep -v '^\s*$' | tail -n 5
  grep val_loss "$RUN/metrics.jsonl" | tail -n 2 | cut -c1-300;;
eval)
  python3 -m train.eval --run "$RUN" --limit "${EVAL_LIMIT:-48}" --max-new-tokens 96 --json "${TARGET[@]}" 2>&1 \
    | tail -n 1 | cut -c1-2000;;
pack)
  out=${OUT:-/tmp/out}; mkdir -p "$out"
  cp "$RUN/metrics.jsonl" "$RUN/eval.json" "$out/" 2>/dev/null
  tr '\r' '\n' < "$W/train.log" | grep -v '^\s*$' | tail -n 40 > "$out/train_log_tail.txt"
  ls -la "$out";;
*) echo "stage must be extract, train, eval or pack" >&2; exit 2;;
esac
