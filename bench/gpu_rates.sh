#!/usr/bin/env bash
# Extraction and training rates on one GPU (issue 6 items 2 and 3), results as JSON lines in $OUT.
# Run on the device machine after installing the carried wheels into /root/site (see device.md):
#   bash bench/gpu_rates.sh
set -uo pipefail
export PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 bench/extract_bench.py --shape qwen3-8b --batches 12 --batch 8 --seq 2048 --store /dev/shm/xb.zarr \
  2>&1 | tee "$OUT/extract_bench.log" | tail -1
rm -rf /dev/shm/xb.zarr
python3 bench/train_bench.py --shape qwen3-8b --samples 24 --seq 2048 --steps 12 --warmup 3 --token-budget 4096 \
  --workers 4 --store /dev/shm/tb.zarr 2>&1 | tee "$OUT/train_bench.log" | tail -1
rm -rf /dev/shm/tb.zarr
