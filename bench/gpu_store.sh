#!/usr/bin/env bash
# Extraction rate (after the raw-shard write path) and store throughput on the GPU host.
set -uo pipefail
export PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 240 python3 bench/extract_bench.py --shape qwen3-8b --batches 12 --batch 8 --seq 2048 --store /dev/shm/xb.zarr \
  2>&1 | tee "$OUT/extract_bench2.log" | tail -1
rm -rf /dev/shm/xb.zarr
timeout 300 python3 bench/store_bench.py --dir /dev/shm/sb --width 20480 --tokens 300000 --writers 1,4 --readers 1,4 \
  --open-samples 1000000 2>&1 | tee "$OUT/store_bench.log" | tail -1
rm -rf /dev/shm/sb
