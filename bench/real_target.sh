#!/usr/bin/env bash
# Issue 6 item 1: the packaged SmolLM2 target end to end on one H200, in two device calls.
#   stage=data  : regenerate responses (4 per non-held-out prompt, T=0.8, seed 0) and extract
#   stage=train : train a drafter from the store, evaluate on the held-out prompts
# Expects the GGUF at /root/m (device.md two-call protocol) and wheels in /root/site.
set -euo pipefail
export PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /root/w
G=/root/m/SmolLM2-135M-Instruct.Q4_1.gguf
case "${1:-data}" in
data)
  python3 -m extract.regenerate --out /root/w/regen.jsonl --target "$G" --num-samples 4 --temperature 0.8 \
    --max-new-tokens 256 --batch-size 384 --seed 0 2>&1 | grep -v "it/s]" | tail -2
  wc -l /root/w/regen.jsonl
  python3 -m extract --store /dev/shm/real.zarr --target "$G" --data /root/w/regen.jsonl --max-len 1024 \
    --token-budget 65536 --json 2>&1 | grep -v "it/s]" | tee "$OUT/extract_summary.json" | tail -30
  ;;
train)
  python3 -m train --store /dev/shm/real.zarr --out /root/w/run --num-layers 3 --epochs 2 --token-budget 16384 \
    --workers 6 --log-every 20 2>&1 | grep -v "step/s]" | tail -3
  cp /root/w/run/metrics.jsonl /root/w/run/loss.png /root/w/run/sim_tau.png "$OUT/"
  python3 -m train.eval --run /root/w/run --limit 20 --max-new-tokens 96 --json 2>&1 | grep -v "it/s]" | tail -1
  cp /root/w/run/eval.json /root/w/run/acceptance.png "$OUT/"
  ;;
esac
