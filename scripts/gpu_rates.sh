#!/usr/bin/env bash
# Extraction and training rates on the GPU host, JSON lines in $OUT.
# Run on the GPU machine after installing the carried wheels (zarr, numcodecs, ...) into /root/site:
#   bash scripts/gpu_rates.sh extract    # 1 GPU: writer variants; then both GPUs at once (x2)
#   bash scripts/gpu_rates.sh train      # 1 GPU: 8B-shaped drafter, compiled, fused loss: memory vs store (2 copy paths), 3 rounds
#   bash scripts/gpu_rates.sh train_more # 1 GPU: the same at budget 8192, and with kept logits
#   bash scripts/gpu_rates.sh profile    # 1 GPU: the same eager, with torch.profiler's top CUDA ops
#   bash scripts/gpu_rates.sh small      # 1 GPU: SmolLM2-shaped drafter, eager vs compiled
#   bash scripts/gpu_rates.sh levers     # 1 GPU: the step's levers at the preset's shape (LEVERS: which)
#   bash scripts/gpu_rates.sh recompiles # 1 GPU: how often the preset's compiled drafter compiles, padded or not
#   bash scripts/gpu_rates.sh levprofile # 1 GPU: the preset's step under torch.profiler (--profile-from store in LEVERS: steps fed from the store)
#   bash scripts/gpu_rates.sh replay losskernel  # 1 GPU: bench replay (with a head, and --rank 0); bench loss-kernel (ours vs Liger)
#   bash scripts/gpu_rates.sh ddp        # x2: DDP 1 vs 2 GPUs, compiled, one call (cold: too long for 10 min)
#   bash scripts/gpu_rates.sh ddp1 wait ddp2 savecache  # x2 cold, one call with TL1=300 TL2=200: the 1-GPU
#                                      #   compiled run on GPU 0, then 2 GPUs, warm
#   bash scripts/gpu_rates.sh ddp2       # x2 warm (same call or the next): 2 GPUs, same store; scaling vs ddp1's rate
#   bash scripts/gpu_rates.sh savecache  # the inductor cache as $OUT/inductor.tgz, to carry to a fresh machine
#   bash scripts/gpu_rates.sh fp8        # 1 GPU: extraction rate into an fp8 store (FP8PROF=4: then 4 batches
#                                      #   under torch.profiler: the top CUDA ops and the fp8_quantize range)
#   bash scripts/gpu_rates.sh store      # CPU only: store write/read GB/s on the host's /dev/shm
#   bash scripts/gpu_rates.sh layout     # x2: extract on GPU 0 while train --follow runs on GPU 1
# Several stages run in order: `bash scripts/gpu_rates.sh ddp2 layout`. On a fresh machine every compile is cold
# (minutes at the 8B shape); an inductor cache carried as .devcarry/inductor.tgz is unpacked first.
set -uo pipefail
export PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/root/inductor
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NGPU=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ -f .devcarry/inductor.tgz ] && [ ! -d /root/inductor ]; then mkdir -p /root/inductor && tar xzf .devcarry/inductor.tgz -C /root/inductor; fi
SHAPE=${SHAPE:-qwen3-8b}  # qwen3-32b for 8-GPU runs
XB="--shape $SHAPE --batches 24 --batch 8 --seq 2048"
TB="--shape $SHAPE --samples 24 --seq 2048 --steps 12 --warmup 3 --workers 4 --store /dev/shm/tb.zarr"
# the H200 preset's training shape (configs/smollm2-h200), compiled, lengths 128..1024 as in the real store:
# only options an earlier commit carried as .devcarry/ref also knows (levers' ref: variants); the preset's
# newer ones (--compile-scope model) are the variants' own
LB=${LB:-"--shape smollm2-135m --layers 5 --block-size 8 --draft-vocab 12288 --token-budget 16384 --seq 1024 \
  --min-seq 128 --samples 256 --steps 30 --warmup 5 --rounds 2 --compile --dtype fp8_e4m3 --workers 4 \
  --store /dev/shm/tb.zarr --context-tile 0"}
DB=${DB:-"--shape $SHAPE --samples 96 --seq 2048 --steps 5000 --compile --skip-rows 3"}  # env: a CPU smoke run
ddp_files() {  # metrics and the log's tail of each run, back in $OUT (log tails in one file: 8 files come back)
  for g in "$@"; do cp /tmp/draftcache_ddp_bench/g$g/metrics.jsonl "$OUT/ddp_g$g.jsonl"; echo "== g$g"; \
    tr '\r' '\n' < /tmp/draftcache_ddp_bench/g$g/run.log | grep -v '^\s*$' | tail -n 15; done >> "$OUT/ddp_logs.log"
}
for stage in "${@:-extract}"; do
case "$stage" in
extract)
  CUDA_VISIBLE_DEVICES=0 timeout 280 python3 -m bench.extract_bench $XB --store /dev/shm/xb.zarr \
    --variants thread:3,thread:4,process:3 2>&1 | tee "$OUT/extract_1gpu.log" | grep '^{'
  if [ "$NGPU" -ge 2 ]; then  # one extraction per GPU, all at once: the host (RAM bandwidth, /dev/shm) is shared
    for g in $(seq 0 $((NGPU - 1))); do
      CUDA_VISIBLE_DEVICES=$g timeout 200 python3 -m bench.extract_bench $XB --store /dev/shm/xb$g.zarr \
        --variants thread:3 > /tmp/extract_gpu_$g.log 2>&1 &
    done
    wait; grep -h '^{' /tmp/extract_gpu_*.log | tee "$OUT/extract_allgpu.log"  # one file: 8 at most come back
  fi
  ;;
train)  # 1 GPU, compiled, fused loss (the default), budget 4096: in memory / from the store (compute-stream copy)
  # / from the store (side-stream copy) in 3 alternating rounds, medians. A cold compile adds minutes.
  CUDA_VISIBLE_DEVICES=0 timeout 420 python3 -m bench.train_bench $TB --compile --token-budget 4096 --rounds 3 2>&1 \
    | tee "$OUT/train_fused_4096.log" | grep '^{'
  ;;
train_more)  # 1 GPU: budget 8192, then kept logits (the 47.2% MFU run of 2026-11-30), one round each
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m bench.train_bench $TB --compile --token-budget 8192 --rounds 1 2>&1 \
    | tee "$OUT/train_fused_8192.log" | grep '^{'
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m bench.train_bench $TB --compile --token-budget 4096 --loss-backward keep \
    --loss-chunk 8192 --rounds 1 2>&1 | tee "$OUT/train_keep_4096.log" | grep '^{'
  ;;
profile)  # 1 GPU: eager, fused loss, torch.profiler's top CUDA ops over 2 steps
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m bench.train_bench $TB --token-budget 4096 --profile 2 2>&1 \
    | tee "$OUT/train_eager_profile.log" | grep -A30 "Self CUDA" | cut -c1-160
  ;;
small)  # 1 GPU: the SmolLM2-shaped drafter of the real-target runs, eager vs compiled
  SB="--shape smollm2-135m --layers 3 --samples 256 --seq 512 --steps 20 --warmup 3 --token-budget 16384 --workers 4 --store /dev/shm/sb.zarr"
  timeout 150 python3 -m bench.train_bench $SB 2>&1 | tee "$OUT/train_small_eager.log" | grep '^{'
  timeout 200 python3 -m bench.train_bench $SB --compile 2>&1 | tee "$OUT/train_small_compile.log" | grep '^{'
  ;;
levers)  # 1 GPU: the training step's levers at the H200 preset's shape, one process a variant in turn, each
  # a JSON line in $OUT/levers.jsonl (LEVERS: the variants instead, ';'-separated bench train options,
  # each after LB, the preset's shape as the preset trains it: an empty variant is the preset itself).
  # A variant "ref:OPTIONS" runs the code carried in .devcarry/ref (`git archive REF` of the packages):
  # an earlier commit side by side with this one, in the same call
  P="--compile-scope model"  # the preset's, since 2026-12-06
  K="--loss-chunk 8192 --ce-kernel liger --flex-kernel tuned"  # the kernels that paid on 2026-12-06
  IFS=";" read -r -a variants <<< "${LEVERS:-ref:--context-tile 1;$P;$P $K;$P $K --residual-dtype bfloat16}"
  for v in "${variants[@]}"; do
    code=$PWD; [[ $v == ref:* ]] && code=$PWD/.devcarry/ref
    # shellcheck disable=SC2086
    (cd "$code" && PYTHONPATH=/root/site:$code timeout ${TLEVER:-300} python3 -m bench.train_bench $LB ${v#ref:}) \
      > /tmp/lever.log 2>&1
    echo "rc $? variant: $v" >> "$OUT/levers_logs.log"  # 124: cut by TLEVER; each run's tail, one file
    grep -v '^{' /tmp/lever.log | tail -n 8 >> "$OUT/levers_logs.log"
    grep '^{"shape"' /tmp/lever.log | sed "s|^{|{\"variant\": \"$v\", |" | tee -a "$OUT/levers.jsonl"
  done
  ;;
recompiles)  # 1 GPU: compiles of the preset's drafter over a run's micro-batch shapes, padded (train --compile's
  # train.shapes) and not, each its own process; the inductor cache emptied for each, so both compile cold
  for pad in --pad-shapes --no-pad-shapes; do
    rm -rf /root/inductor_rc; TORCHINDUCTOR_CACHE_DIR=/root/inductor_rc timeout ${TRC:-280} python3 -m bench recompiles $pad 2>&1 \
      | tail -n 1 | tee -a "$OUT/recompiles.jsonl"
  done
  ;;
levprofile)  # 1 GPU: the preset's shape under torch.profiler, the top CUDA ops of 3 steps (LEVERS' first variant);
  # TRACE=NAME.json.gz: their timeline too, as $OUT/NAME.json.gz, summed up (bench trace) in $OUT/trace_summary.jsonl,
  # with each host-device sync inside them warned about in the log; TAG: the log's name, levers_profile$TAG.log
  tr=(); [ -n "${TRACE:-}" ] && tr=(--trace "$OUT/$TRACE" --sync-debug)
  # shellcheck disable=SC2086
  timeout 300 python3 -m bench.train_bench $LB --rounds ${LPROUNDS:-1} --profile 3 ${LEVERS%%;*} "${tr[@]}" 2>&1 \
    | tee "$OUT/levers_profile${TAG:-}.log" | grep -A34 "Self CUDA" | cut -c1-160
  if [ -n "${TRACE:-}" ]; then
    python3 -m bench trace "$OUT/$TRACE" | sed "s|^{|{\"trace\": \"$TRACE\", |" | tee -a "$OUT/trace_summary.jsonl"
  fi
  ;;
replay)  # 1 GPU: the held-out tree replay with the Markov head and without one (the preset's plain drafter),
  # trees at every block vs at the visited ones
  timeout 300 python3 -m bench replay 2>&1 | tail -n 1 | tee "$OUT/replay.json"
  timeout 300 python3 -m bench replay --rank 0 2>&1 | tail -n 1 | tee "$OUT/replay_plain.json"
  ;;
losskernel)  # 1 GPU: the draft loss's chunks at the preset's shape, ours against Liger's kernels (its wheel carried)
  timeout 300 python3 -m bench loss-kernel 2>&1 | tail -n 1 | tee "$OUT/loss_kernel.json"
  ;;
ddp)  # x2: DDP scaling of python -m train --compile (the fused loss, the default), 1 then 2 GPUs in one call;
  # each run is rated on the rows logged before its limit (on a fresh machine the compile alone takes minutes)
  timeout 560 python3 -m bench.ddp_bench $DB --gpus 1,$NGPU --time-limit 220 2>&1 | tee "$OUT/ddp.log" | tail -n 3
  ddp_files 1 $NGPU
  ;;
ddp1)  # 1 GPU (GPU 0), long enough for a cold compile and then steady steps; the store stays for ddp2
  { CUDA_VISIBLE_DEVICES=0 timeout 470 python3 -m bench.ddp_bench $DB --gpus 1 --time-limit ${TL1:-420} 2>&1 \
    | tee "$OUT/ddp1.log" /tmp/ddp1.log | tail -n 3; ddp_files 1; } &
  sleep 5  # in the background: a later stage may use GPU 1 meanwhile; `wait` joins it
  ;;
wait)  # join a background stage (ddp1) before the next
  wait
  ;;
ddp2)  # 2 GPUs, the store and compile cache of ddp1 (same machine, still warm); scaling against ddp1's rate
  BASE=${BASE:-$(python3 -c 'import json; print(json.loads(open("/tmp/ddp1.log").read().splitlines()[-1])["positions_per_s"]["1"])' 2>/dev/null || echo 0)}
  timeout 300 python3 -m bench.ddp_bench $DB --gpus $NGPU --reuse-store --base-rate ${BASE:-0} --time-limit ${TL2:-240} \
    ${DDP2_ARGS:-} 2>&1 | tee "$OUT/ddp2.log" | tail -n 3  # DDP2_ARGS="--grad-reduce bf16": half the all-reduce bytes
  ddp_files $NGPU
  ;;
savecache)  # fits the 16 MiB a returned file may have, or says it does not
  tar czf "$OUT/inductor.tgz" -C /root/inductor . && ls -l "$OUT/inductor.tgz"
  ;;
fp8)  # 1 GPU: extraction into an fp8 store (quantized on the GPU)
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m bench.extract_bench $XB --store /dev/shm/xb.zarr --dtype fp8_e4m3 \
    --variants thread:3 --profile ${FP8PROF:-0} 2>&1 | tee "$OUT/extract_fp8.log" | grep -E '^\{|wrote|^range|Self CUDA'
  ;;
store)  # the store bench on this host's /dev/shm (CPU only): write GB/s per process, reads, open
  timeout 300 python3 -m bench.store_bench --dir /dev/shm/sb --width 20480 --tokens 300000 --writers 1,4 --readers 1,4 \
    --open-samples 0 2>&1 | tee "$OUT/store.log" | tail -n 1; rm -rf /dev/shm/sb
  ;;
layout)  # x2: the design card's layout, stage one on GPU 0 while stage two follows on GPU 1
  # its own process group (setsid), so the phases it starts can be ended by that group's id below
  setsid timeout ${TLAYOUT:-560} python3 -m bench.layout_bench --shape $SHAPE --samples 1024 --words 1400 --steps 150 \
    --compile --deadline $(( ${TLAYOUT:-560} - 40 )) > "$OUT/layout.log" 2>&1 &
  lp=$!; wait $lp; tail -n 2 "$OUT/layout.log"
  for f in /dev/shm/draftcache_layout_bench/*.log; do  # each phase's own log, also when cut by the limit
    echo "== $(basename "$f")"; tr '\r' '\n' < "$f" | grep -v '^\s*$' | tail -n 40
  done > "$OUT/layout_phases.log"  # one file: at most 8 come back
  for r in B C; do cp /dev/shm/draftcache_layout_bench/${r}run/metrics.jsonl "$OUT/layout_${r}run.jsonl" 2>/dev/null; done
  kill -9 -- -$lp 2>/dev/null || true  # a phase cut by the limit must not keep its GPU: only the group we started
  ;;
esac
done
wait
