#!/usr/bin/env bash
# Issue 6 items 1 and 4: the packaged SmolLM2 target end to end on two H200s (nvidia-h200-x2), one call.
#   regenerate (one process per GPU) -> extract a bf16 and an fp8 store (2 ranks each) ->
#   train one drafter per store at once (GPU 0: bf16, GPU 1: fp8) -> evaluate both at once.
# Expects the GGUF at /root/m (device.md two-call protocol) and the wheels in /root/site.
# STEPS and TLIM bound the training (a run cut by the time limit is evaluated at its last checkpoint;
# STAGE=train reruns only training, resuming, and evaluation while the machine is still warm).
set -uo pipefail
export PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; W=/root/w; mkdir -p "$OUT" $W
G=/root/m/SmolLM2-135M-Instruct.Q4_1.gguf
STEPS=${STEPS:-900}; TLIM=${TLIM:-330}
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
if [ "${STAGE:-all}" = all ]; then
regen() {  # args: name, extra regenerate options; one shard per GPU
  for g in 0 1; do
    CUDA_VISIBLE_DEVICES=$g python3 -m extract.regenerate --out $W/$1.$g.jsonl --target "$G" --max-new-tokens 256 \
      --batch-size 512 --seed 0 --shard $g/2 "${@:2}" > $W/$1.$g.log 2>&1 &
  done
  wait; tail -n1 $W/$1.*.log
}
# The dataset these commands made on 2026-11-29 is committed (298 s of two GPUs); REGEN=1 remakes it.
DATA=docs/results/smollm2-x2-820steps/regen.jsonl.gz
if [ "${REGEN:-0}" = 1 ] || [ ! -f $DATA ]; then
  regen sampled --num-samples 4 --temperature 0.8
  regen greedy --num-samples 1 --temperature 0
  cat $W/sampled.0.jsonl $W/sampled.1.jsonl $W/greedy.0.jsonl $W/greedy.1.jsonl > $W/regen.jsonl
  gzip -c $W/regen.jsonl > "$OUT/regen.jsonl.gz"
else
  gunzip -c $DATA > $W/regen.jsonl
fi
wc -l $W/regen.jsonl; stamp data ready
for d in bfloat16 fp8_e4m3; do
  torchrun --standalone --nproc-per-node 2 -m extract --store /dev/shm/$d.zarr --target "$G" --data $W/regen.jsonl \
    --max-len 1024 --token-budget 65536 --dtype $d --json 2>&1 | grep -v "tok/s]" | tee "$OUT/extract_$d.json" | tail -n 32
  stamp extracted $d
done
fi
for i in 0 1; do
  d=$([ $i = 0 ] && echo bfloat16 || echo fp8_e4m3)
  CUDA_VISIBLE_DEVICES=$i timeout $TLIM python3 -m train --store /dev/shm/$d.zarr --out $W/run_$d --num-layers 3 \
    --epochs 20 --max-steps $STEPS --lr 1e-3 --token-budget 16384 --workers 6 --log-every 20 --checkpoint-every 100 \
    --val-samples 200 --val-every 100 --compile $([ -d $W/run_$d/checkpoints ] && echo --resume) > $W/train_$d.log 2>&1 &
done
wait; stamp trained
for d in bfloat16 fp8_e4m3; do
  mkdir -p "$OUT/$d"; cp $W/run_$d/metrics.jsonl $W/run_$d/*.png "$OUT/$d/" 2>/dev/null
  grep -v "step/s]" $W/train_$d.log | tail -n 4; tail -n 1 $W/run_$d/metrics.jsonl | cut -c1-400
done
for i in 0 1; do
  d=$([ $i = 0 ] && echo bfloat16 || echo fp8_e4m3)
  CUDA_VISIBLE_DEVICES=$i python3 -m train.eval --run $W/run_$d --limit 16 --max-new-tokens 96 --json \
    > $W/eval_$d.log 2>&1 &
done
wait; stamp evaluated
for d in bfloat16 fp8_e4m3; do
  tail -n 1 $W/eval_$d.log | cut -c1-1500; cp $W/run_$d/eval.json $W/run_$d/acceptance.png "$OUT/$d/" 2>/dev/null
done
