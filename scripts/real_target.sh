#!/usr/bin/env bash
# Issue 6 items 1 and 4: the packaged SmolLM2 target end to end on two H200s (nvidia-h200-x2).
#   data (committed, or REGEN=1 to regenerate, one process per GPU) -> extract stores (2 ranks) ->
#   train two drafters at once, one per GPU (RUN0 on GPU 0, RUN1 on GPU 1) -> evaluate both at once.
# A store is "name:dtype:data" (data: base = the regenerated packaged prompts; base+code adds the
# target-invented code conversations, docs/results/invented-code/code.jsonl.gz); a run is
# "name:store:extra train args". Defaults: one store (packaged prompts + invented code), a CE drafter (GPU 0)
# and a KL drafter (GPU 1): 4 of 5 responses were sampled at T 0.8, so CE learns sampled tokens while
# greedy decoding accepts the target's argmax; KL against the stored teacher has no such label noise.
# CODE_N=2000 invents and answers fresh code prompts on the GPUs instead of using the committed ones;
# EXTRA=4 adds 4 more sampled responses per packaged prompt (seed 1) to base: the drafter overfits
# the 7,000 samples after ~13 epochs, so more data is the lever left. MATH_N=2000 invents
# and answers math word problems (MATH_PREFIX steers them) and adds them to base.
# COMMITTED_DATA=1 trains on the committed data in docs/results/smollm2-x2-ddp-more-data (no generation);
# LAYERS sets the drafter depth (default 3).
# DEADLINE=S ends training S seconds after the script started, however long the data took (one call <= 600 s).
# Expects the packaged GGUF at /root/m (carried in parts) and the wheels in /root/site.
# STEPS and TLIM bound the training (a run cut by the time limit is evaluated at its last checkpoint;
# STAGE=train resumes training and evaluates; STAGE=eval only evaluates; both while the machine is still warm).
# DDP=1 trains RUN0 alone on both GPUs. EPOCHS caps the passes (default 100: STEPS decides); EVAL=0 skips evaluation. A longer run over two calls on one warm machine:
#   STEPS=2500 TLIM=380 DDP=1 bash scripts/real_target.sh; then STEPS=2500 TLIM=420 DDP=1 STAGE=train bash scripts/real_target.sh
set -uo pipefail
export PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TORCHINDUCTOR_CACHE_DIR=/root/inductor
OUT=${OUT:-/tmp/out}; W=/root/w; mkdir -p "$OUT" $W
G=/root/m/SmolLM2-135M-Instruct.Q4_1.gguf
STEPS=${STEPS:-550}; TLIM=${TLIM:-330}  # ~550 steps fit 330 s at the SmolLM2 shape (third run): the cosine ends
STORES=${STORES:-code:bfloat16:base+code}
RUN0=${RUN0:-ce:code:--loss ce}; RUN1=${RUN1:-kl:code:--loss kl}
CODE=docs/results/invented-code/code.jsonl.gz
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
if [ "${STAGE:-all}" = all ]; then
regen() {  # args: name, extra regenerate options; one shard per GPU
  for g in 0 1; do
    CUDA_VISIBLE_DEVICES=$g python3 -m extract.regenerate --out $W/$1.$g.jsonl --target "$G" --max-new-tokens 256 \
      --batch-size 512 --seed 0 --shard $g/2 "${@:2}" > $W/$1.$g.log 2>&1 &
  done
  wait; tail -n1 $W/$1.*.log
}
# The dataset these commands made on 2026-11-29 is committed (298 s of two GPUs); REGEN=1 makes a new one
# (same prompts and settings; regenerate now batches shortest prompts first, so other draws).
DATA=docs/results/smollm2-x2-820steps/regen.jsonl.gz
if [ "${REGEN:-0}" = 1 ] || [ ! -f $DATA ]; then
  regen sampled --num-samples 4 --temperature 0.8
  regen greedy --num-samples 1 --temperature 0
  cat $W/sampled.0.jsonl $W/sampled.1.jsonl $W/greedy.0.jsonl $W/greedy.1.jsonl > $W/regen.jsonl
  gzip -c $W/regen.jsonl > "$OUT/regen.jsonl.gz"; DATA="$OUT/regen.jsonl.gz"
fi
gunzip -c $DATA > $W/base.jsonl
MORE=docs/results/smollm2-x2-ddp-more-data  # generated data of an earlier two-GPU run, committed
if [ "${COMMITTED_DATA:-0}" = 1 ]; then  # train on exactly that data, in its order, without generating any
  gunzip -c $MORE/math.jsonl.gz $MORE/extra.jsonl.gz >> $W/base.jsonl; CODE=$MORE/code.jsonl.gz
fi
invented() {  # args: name, N, prefix: the target invents N prompts on the GPUs and answers them greedily
  regen $1q --invent "$2" --temperature 1.0 --invent-prefix "$3" --max-new-tokens 128
  cat $W/$1q.0.jsonl $W/$1q.1.jsonl > $W/$1_prompts.jsonl
  regen $1a --prompts $W/$1_prompts.jsonl --temperature 0
  cat $W/$1a.0.jsonl $W/$1a.1.jsonl | gzip > "$OUT/$1.jsonl.gz"; stamp invented $1
}
if [ "${CODE_N:-0}" -gt 0 ]; then invented code "$CODE_N" "Write a Python function"; CODE="$OUT/code.jsonl.gz"; fi
if [ "${MATH_N:-0}" -gt 0 ]; then  # math word problems beside GSM8K's (added to base)
  invented math "$MATH_N" "${MATH_PREFIX:-Solve this math word problem step by step:}"
  gunzip -c "$OUT/math.jsonl.gz" >> $W/base.jsonl
fi
if [ "${EXTRA:-0}" -gt 0 ]; then  # EXTRA more sampled responses per prompt (seed 1: new draws), added to base
  regen extra --num-samples "$EXTRA" --temperature 0.8 --seed 1
  cat $W/extra.0.jsonl $W/extra.1.jsonl | tee -a $W/base.jsonl | gzip > "$OUT/extra.jsonl.gz"; stamp extra responses
fi
{ cat $W/base.jsonl; gunzip -c $CODE; } > $W/base+code.jsonl
wc -l $W/*.jsonl; stamp data ready
for st in $STORES; do
  IFS=: read -r name d data <<< "$st"
  torchrun --standalone --nproc-per-node 2 -m extract --store /dev/shm/$name.zarr --target "$G" --data $W/$data.jsonl \
    --max-len 1024 --token-budget 65536 --dtype $d --json 2>&1 | grep -v "tok/s]" | tee "$OUT/extract_$name.json" | tail -n 32
  stamp extracted $name
done
fi
runs=("$RUN0" "$RUN1"); ids="0 1"; launch=python3; ddp_gpus=
# DDP=1: RUN0 alone, one drafter on both GPUs (torchrun, 16,384 tokens per rank: twice the samples a step)
if [ "${DDP:-0}" = 1 ]; then ids=0; launch="torchrun --standalone --nproc-per-node 2"; ddp_gpus=0,1; fi
if [ "${STAGE:-all}" != eval ]; then
tlim=$TLIM  # DEADLINE=S: training ends by S seconds after the script's start, however long the data took
if [ -n "${DEADLINE:-}" ]; then tlim=$(( DEADLINE - ($(date +%s) - t0) )); [ $tlim -lt $TLIM ] || tlim=$TLIM; fi
stamp training for at most $tlim s
[ $tlim -ge 30 ] || { stamp no time left to train; ids=; }  # (timeout 0 would mean no limit at all)
groups=()
for i in $ids; do
  IFS=: read -r name store extra <<< "${runs[$i]}"
  CUDA_VISIBLE_DEVICES=${ddp_gpus:-$i} setsid timeout $tlim $launch -m train \
    --store /dev/shm/$store.zarr --out $W/run_$name --num-layers ${LAYERS:-3} \
    --epochs ${EPOCHS:-100} --max-steps $STEPS --lr 1e-3 --token-budget 16384 --workers 6 --log-every 20 --checkpoint-every 100 \
    --val-samples 200 --val-every 100 --compile $extra $([ -d $W/run_$name/checkpoints ] && echo --resume) \
    > $W/train_$name.log 2>&1 &
  groups+=($!)  # setsid: the pid is its process group's id, the launcher's ranks included
done
wait; stamp trained
for g in "${groups[@]}"; do kill -9 -- -"$g" 2>/dev/null; done  # a rank outliving its limit must not hold a GPU during eval
fi
for i in $ids; do
  IFS=: read -r name store extra <<< "${runs[$i]}"
  # at most 8 files come back: metrics, the train log's tail and eval.json per run (plots are redrawn from
  # them: train.metrics.plot_metrics, train.eval._plot)
  mkdir -p "$OUT/$name"; cp $W/run_$name/metrics.jsonl "$OUT/$name/" 2>/dev/null
  tr '\r' '\n' < $W/train_$name.log | grep -v '^\s*$' | tail -n 30 > "$OUT/$name/train.log"
  grep val_loss $W/run_$name/metrics.jsonl | tail -n 1 | cut -c1-300
done
[ "${EVAL:-1}" = 0 ] && { stamp no evaluation; exit 0; }
for i in $ids; do
  IFS=: read -r name store extra <<< "${runs[$i]}"
  CUDA_VISIBLE_DEVICES=$i python3 -m train.eval --run $W/run_$name --limit 16 --max-new-tokens 96 --json \
    > $W/eval_$name.log 2>&1 &
done
wait; stamp evaluated
for i in $ids; do
  IFS=: read -r name store extra <<< "${runs[$i]}"
  tail -n 1 $W/eval_$name.log | cut -c1-1500; cp $W/run_$name/eval.json "$OUT/$name/" 2>/dev/null
done
