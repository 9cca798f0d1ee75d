#!/usr/bin/env bash
# The data-at-scale run on one machine with N GPUs, stage by stage; every stage resumes when rerun,
# so a run spans several device calls while the machine stays warm.
#   bash scripts/scale_run.sh formats   # optional, first: data in the evaluation's formats, answered by the
#                                       # target: completion-format code prompts cut from the 100K file's code
#                                       # records (extract.regenerate.completion) and open requests (Magpie
#                                       # with no opening); `extract` then adds them to the data whole
#   bash scripts/scale_run.sh extract   # the committed 100K-sample recipe data -> fp8 store in /dev/shm
#   bash scripts/scale_run.sh valstore  # optional: 32 a domain of the evaluation's 264 validation prompts
#                                       # (none of the 48 it scores) answered by the target -> a store for
#                                       # train's --val-store; then VAL_STORE=/dev/shm/val.zarr for `train`: the
#                                       # held-out curve and the best checkpoint on the evaluation's formats
#   bash scripts/scale_run.sh train     # 5-layer drafter, DDP over all GPUs, resumes from its checkpoints;
#                                       # it ends with `pack`: a lost machine loses one call, not the run
#                                       # DETACH=S: the trainer runs in a session of its own that outlives
#                                       # this shell (one process for a run longer than a call: one compile,
#                                       # no resume); the stage follows it S seconds, then packs and returns
#   bash scripts/scale_run.sh follow    # FOLLOW=S (default 540): follows the detached trainer S seconds
#                                       # more; exit 0 and the train stage's report once it has ended,
#                                       # 3 while it still runs (after a pack of its latest checkpoint)
#   bash scripts/scale_run.sh together  # SIDES="NAME=TRAIN_ARGS;NAME=...": those runs at once on the one card, each
#                                       # in $W/NAME (resumed where it has checkpoints), for τ at equal steps
#                                       # (their rates share the card: not figures); NAME_metrics.jsonl and
#                                       # NAME_out.txt (log tail, recompiles) in $OUT, 4 runs at most (8 files)
#   bash scripts/scale_run.sh eval      # the served export (bf16) against the float32 target, 48 held-out prompts
#   bash scripts/scale_run.sh evals     # RUNS="DIR DIR": those runs' exports decoded at once, one table of τ
#                                       # (and each one's τ minus the first's, paired over the prompts)
#                                       # (STEP=N: each run's step-N checkpoint, not its best: equal steps)
#   bash scripts/scale_run.sh pack      # metrics, eval.json, log tail and the bf16 export in parts into $OUT
#   bash scripts/scale_run.sh peers     # speculators' drafter on a subset, decoded as ours (PEER_* settings);
#                                       # ours on the same store: STORE=/dev/shm/peers.zarr RUN=... `train` and `eval`
# The export that `pack` brings back is evaluated anywhere (as served: bf16 weights through AutoModel):
#   mkdir E && cat export.safetensors.part-* > E/model.safetensors && cp export_config.json E/config.json
#   cp train/modeling_dflash.py train/decoding_state.py train/draft_tree.py train/markov_head.py E/ && python -m train.eval --export E --target GGUF --limit 48 --max-new-tokens 96
# The options are those of configs/smollm2-h200/ (extract.toml, train.toml); the environment overrides a few.
# Settings (environment): DATA (default: docs/results/recipe-default-100k/train.jsonl.gz), W (work
# dir, default /root/w), STORE (/dev/shm/scale.zarr), FRACTION (share of the 100K file to extract,
# default: as many as fit in /dev/shm and memory beside the formats answers), STEPS (cosine length, default 10000), LR (1.2e-3),
# TLIM (seconds this call may train: train's --time-limit, default 480), EXTRACT_ARGS (more extract
# options, e.g. "--dtype mxfp4"), CUT_LOOPS (1: cut each answer where it starts repeating itself,
# extract.regenerate.loops, before extraction), EXPORT_ARGS (the eval and pack stages' export options, e.g.
# --draft-head: drafting from the draft vocabulary only, not the target's whole lm_head), VERIFY (train's
# --verify-shards: on (default), off or auto), TRAIN_ARGS (more train options, e.g. "--num-layers 8
# --intermediate-size 3072"; to go on from a drafter an earlier machine brought back: "--init-from DIR"
# with DIR its rejoined export), FORMAT_LIMIT and OPEN (the formats stage's completion prompts, default
# all, and open requests invented, default 12000), GGUF (default: the packaged
# model, found by importlib); VAL_STORE (train's --val-store instead of --val-samples VAL; the valstore
# stage writes /dev/shm/val.zarr of VAL_PER_DOMAIN prompts a domain, default 32, 0 = all 264); for a CPU
# dry run: VAL, WORKERS, EVAL_LIMIT, TOKENS, VAL_LIMIT (1000, 6, 48, 16384, 0 = all); TORCH_LOGS (train's,
# default recompiles: why torch.compile compiled again mid-run, brought back as recompiles.txt).
# Expects PYTHONPATH to hold the wheels (zarr, numcodecs, liger-kernel for the preset's loss, ...) and the
# packaged target or GGUF.
set -uo pipefail
stage=$1
W=${W:-/root/w}; STORE=${STORE:-/dev/shm/scale.zarr}; RUN=${RUN:-$W/run}
DATA=${DATA:-docs/results/recipe-default-100k/train.jsonl.gz}
# one torch import for both (seconds each, and `together` starts several stages at once)
read -r NG GPU < <(python3 -c 'import torch; print(max(1, torch.cuda.device_count()), int(torch.cuda.is_available()))')
TARGET=(); [ -n "${GGUF:-}" ] && TARGET=(--target "$GGUF")
mkdir -p "$W"
L=(python3); [ "$NG" -gt 1 ] && L=(torchrun --standalone --nproc-per-node "$NG")  # one process per GPU
pack() {  # metrics, eval.json, log tail and the drafter's bf16 export into $OUT
  local out=${OUT:-/tmp/out}; mkdir -p "$out"
  cp "$RUN/metrics.jsonl" "$RUN/eval.json" "$out/" 2>/dev/null
  # the trained drafter comes back too: its bf16 export in parts under 16 MiB (at most 8 files in all);
  # rejoin with `cat export.safetensors.part-* > model.safetensors` beside a fresh export's config.json
  # shellcheck disable=SC2086
  if python3 -m train.export --run "$RUN" --out "$W/export" --overwrite ${EXPORT_ARGS:-} > /dev/null; then
    cp "$W/export/config.json" "$out/export_config.json"
    split -b 15M -d -a 1 "$W/export/model.safetensors" "$out/export.safetensors.part-"
  fi
  tr '\r' '\n' < "$W/train.log" | grep -v '^\s*$' | tail -n 40 > "$out/train_log_tail.txt"
  # what made torch.compile compile again mid-run (train's TORCH_LOGS=recompiles): a row of low rate
  grep -h -A3 "Recompiling" "$W/train.log" | cut -c1-400 > "$out/recompiles.txt" 2>/dev/null
  ls -la "$out"
}
trained() {  # the train stage's report, once its trainer has ended
  # the wall seconds from the stage's start to the trainer's end: the run's GPU time for training
  echo "train exit $(cat "$W/train.rc") after $(( $(stat -c %Y "$W/train.rc") - $(cat "$W/train.start") )) s"
  tr '\r' '\n' < "$W/train.log" | grep -v '^\s*$' | tail -n 5
  grep val_loss "$RUN/metrics.jsonl" | tail -n 2 | python3 -c 'import json,sys
for line in sys.stdin: r = json.loads(line); print({k: v for k, v in r.items() if k != "val_acc"})'
  # a machine lost between calls takes /root and /dev/shm with it: bring this call's drafter back now
  pack > /dev/null
}
follow() {  # S: wait up to S seconds for the detached trainer of `train` with DETACH
  local end=$(( $(date +%s) + $1 )) pid
  pid=$(cat "$W/train.pid" 2>/dev/null) || { echo "follow: no detached trainer in $W" >&2; return 2; }
  while [ ! -f "$W/train.rc" ] && [ "$(date +%s)" -lt "$end" ]; do
    kill -0 "$pid" 2> /dev/null || break  # gone without an exit status: killed from outside
    sleep 2
  done
  if [ -f "$W/train.rc" ]; then trained; return 0; fi
  kill -0 "$pid" 2> /dev/null || { echo "follow: trainer $pid ended without an exit status" >&2; return 1; }
  echo "trainer $pid still running; its last row:"; grep -v val_loss "$RUN/metrics.jsonl" 2>/dev/null | tail -n 1 | cut -c1-300
  pack > /dev/null 2>&1; return 3  # (an export before the first checkpoint fails: nothing to pack yet)
}
export_dir() { echo "$W/x-$(basename "$1")"; }  # where export_run puts a run's export
is_export() { [ -f "$1/model.safetensors" ]; }  # an export directory (decoded as it is), not a run
export_run() {  # a run's export beside the others, in export_dir (STEP: its step-N checkpoint); prints its path
  local ck=(); [ -n "${STEP:-}" ] && ck=(--checkpoint "$1/checkpoints/step-$STEP")
  # shellcheck disable=SC2086
  python3 -m train.export --run "$1" --out "$(export_dir "$1")" --overwrite "${ck[@]}" ${EXPORT_ARGS:-} > /dev/null \
    && export_dir "$1"
}
decode_at_once() {  # OUT_DIR EXPORT...: each export decoded at the same time, one process each on the one
  # GPU; their τ are figures, their speedups are not (they share the card); then one table of τ per
  # domain, chain and trees (bench/peers_table.py)
  local out=$1; shift
  local ev=(--limit "${EVAL_LIMIT:-48}" --max-new-tokens 96 ${EVAL_ARGS:---no-prompt-lookup --tree-budget 0,512}
    --json "${TARGET[@]}")
  local pids=() pairs=() e i n
  for e in "$@"; do python3 -m train.eval --export "$e" "${ev[@]}" > "$e.eval.log" 2>&1 & pids+=($!); done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}"; e=${*:$((i + 1)):1}; n=$(basename "$e")
    echo "== $n"; tail -n 1 "$e.eval.log" | cut -c1-1500; cp "$e/eval.json" "$out/eval-$n.json" 2>/dev/null
    [ -f "$e/eval.json" ] && pairs+=(--eval "$n=$e/eval.json")
  done
  [ ${#pairs[@]} -gt 0 ] && python3 -m bench peers table "${pairs[@]}" | tee "$out/peers_table.md"
}
case $stage in
extract)
  # ~28.9M tokens (counted with the SmolLM2 template, capped at 1,024): fp8 taps without the final
  # hidden state (CE training does not read it) are about 3.0 KB a token, ~87 GB; where /dev/shm or
  # memory holds less, keep every sample whose index falls in the first FRACTION of each hundred
  # (the file is grouped by domain, so every domain keeps the same share)
  # the formats stage's answers are kept whole and take their room first (~3.39 characters a token)
  extra=(); for f in "$W/completion.jsonl" "$W/open.jsonl"; do [ -s "$f" ] && extra+=("$f"); done
  frac=${FRACTION:-$(python3 - "$STORE" "${extra[@]}" <<'PY'
import os, sys
st = os.statvfs(os.path.dirname(sys.argv[1]) or ".")
avail = st.f_bavail * st.f_frsize - 2 * 2**30
mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") - 24 * 2**30  # training's own memory
extra = sum(os.path.getsize(f) for f in sys.argv[2:]) / 3.39 * 3000
print(f"{max(0.01, min(1.0, (min(avail, mem) - extra) / (28.9e6 * 3000))):.2f}")
PY
)}
  echo "extracting a share of $frac of the 100K samples, ${#extra[@]} formats files whole ($(df -h --output=avail "$(dirname "$STORE")" | tail -n 1) free)"
  { gunzip -c "$DATA" | awk -v f="$frac" '(NR - 1) % 100 < f * 100'; [ ${#extra[@]} -gt 0 ] && cat "${extra[@]}"; } > "$W/train.jsonl"
  wc -l < "$W/train.jsonl"
  if [ "${CUT_LOOPS:-0}" = 1 ]; then  # answers cut where they start repeating (extract.regenerate.loops)
    python3 -m extract.regenerate.loops --data "$W/train.jsonl" --out "$W/train_cut.jsonl" && mv "$W/train_cut.jsonl" "$W/train.jsonl"
  fi
  "${L[@]}" -m extract --config configs/smollm2-h200/extract.toml --store "$STORE" --data "$W/train.jsonl" \
    "${TARGET[@]}" ${EXTRACT_ARGS:-} --json 2>&1 | grep -v "tok/s]" | tail -n 20
  python3 -m cache_format inspect "$STORE" | head -n 30;;
train)
  resume=(); [ -d "$RUN/checkpoints" ] && resume=(--resume)
  held=(--val-samples "${VAL:-1000}"); [ -n "${VAL_STORE:-}" ] && held=(--val-samples 0 --val-store "$VAL_STORE")
  # a CPU dry run compiles nothing (the preset's whole-graph scope needs --compile) and has no Triton
  # for the preset's Liger kernel
  cmd=(timeout $(( ${TLIM:-480} + 120 )) "${L[@]}" -m train --config configs/smollm2-h200/train.toml
    --store "$STORE" --out "$RUN" --max-steps "${STEPS:-10000}" --time-limit "${TLIM:-480}" --lr "${LR:-1.2e-3}"
    --token-budget "${TOKENS:-16384}" "${held[@]}" --workers "${WORKERS:-6}" --verify-shards "${VERIFY:-on}"
    $([ "$GPU" = 1 ] && echo --compile || echo --no-compile --compile-scope layers --ce-kernel torch) "${resume[@]}"
    ${TRAIN_ARGS:-})
  export TORCH_LOGS=${TORCH_LOGS-recompiles}
  if kill -0 "$(cat "$W/train.pid" 2>/dev/null)" 2> /dev/null; then
    echo "train: the detached trainer $(cat "$W/train.pid") still runs in $W: follow it" >&2; exit 2
  fi
  rm -f "$W/train.rc" "$W/train.pid"; date +%s > "$W/train.start"
  if [ -n "${DETACH:-}" ]; then
    # setsid: a session of its own, which the end of this shell (or of a device call) does not end;
    # its exit status lands in train.rc (whole: renamed into place), which `follow` waits for
    setsid bash -c '"$@" > "$0.log" 2>&1; echo $? > "$0.rc.tmp"; mv "$0.rc.tmp" "$0.rc"' "$W/train" "${cmd[@]}" \
      < /dev/null > /dev/null 2>&1 &
    echo $! > "$W/train.pid"
    follow "$DETACH"
  else
    "${cmd[@]}" > "$W/train.log" 2>&1; echo $? > "$W/train.rc"
    trained
  fi;;
follow) follow "${FOLLOW:-540}";;
eval)  # the export as served (bf16 weights through AutoModel) of the best checkpoint; EVAL_ARGS: more
  # train.eval options, e.g. --no-prompt-lookup (the second baseline is a third of the time); EVAL_TOKENS: new
  # tokens per answer (96: the goal's figures; longer answers of the small target loop, which inflates τ)
  # the export drafts from the target's whole lm_head (train.export's default): a drafter trained on the
  # 12,288-token draft vocabulary decodes +0.017 τ so on the H200 (docs/BENCHMARKS.md)
  # shellcheck disable=SC2086
  python3 -m train.export --run "$RUN" --out "$W/export" --overwrite ${EXPORT_ARGS:-} > /dev/null || exit 1
  python3 -m train.eval --export "$W/export" --limit "${EVAL_LIMIT:-48}" --max-new-tokens "${EVAL_TOKENS:-96}" --json "${TARGET[@]}" \
    ${EVAL_ARGS:-} 2>&1 | tail -n 1 | cut -c1-2000
  cp "$W/export/eval.json" "$RUN/eval.json";;
formats)  # ~11K completion prompts from the 100K file (FORMAT_LIMIT caps them, 0: all) and OPEN requests
  # invented with no opening (default 12,000 before near-duplicates go): on the CPU VM the packaged
  # target's unsteered inventions read like people's everyday requests ("How can I make a business
  # run smoothly?") where the recipe's steered ones run to stories and long invented scenarios
  python3 -m extract.regenerate.completion --data "$DATA" --out "$W/completion_prompts.jsonl" --limit "${FORMAT_LIMIT:-0}" || exit 1
  python3 -m extract.regenerate --invent "${OPEN:-12000}" --temperature 1.0 --max-new-tokens 128 --seed 7 \
    --out "$W/open_invented.jsonl" --batch-size 512 "${TARGET[@]}" 2>&1 | grep -v "it/s\]" | tail -n 2
  python3 -m extract.regenerate.dedup --prompts "$W/open_invented.jsonl" --out "$W/open_prompts.jsonl" || exit 1
  for k in completion open; do
    python3 -m extract.regenerate --prompts "$W/${k}_prompts.jsonl" --out "$W/$k.jsonl" --max-new-tokens 256 \
      --batch-size 512 "${TARGET[@]}" 2>&1 | grep -v "it/s\]" | tail -n 2
  done
  wc -l "$W/completion.jsonl" "$W/open.jsonl";;
valstore)  # answers of 256 tokens (val_decode_tau_96 reads the evaluation's 96-token window of them)
  # 32 a domain: the evaluation's even mix (all 264 are 57% code, and a pooled τ over them is mostly code's);
  # answers already in $W/val.jsonl are kept (e.g. made beforehand on a CPU by the float32 target with the
  # same two commands): the stage then only extracts them
  python3 -m chat prompts validation "$W/val_prompts.jsonl" --per-domain "${VAL_PER_DOMAIN:-32}" || exit 1
  python3 -m extract.regenerate --prompts "$W/val_prompts.jsonl" --limit "${VAL_LIMIT:-0}" --out "$W/val.jsonl" --max-new-tokens 256 \
    --batch-size 512 "${TARGET[@]}" 2>&1 | grep -v "it/s\]" | tail -n 2
  "${L[@]}" -m extract --config configs/smollm2-h200/extract.toml --store "${VSTORE:-/dev/shm/val.zarr}" \
    --data "$W/val.jsonl" "${TARGET[@]}" ${EXTRACT_ARGS:-} --json 2>&1 | grep -v "tok/s]" | tail -n 3;;
peers)  # speculators 0.9.0's drafter beside ours on one subset (bench/peers_bench.py); each step is skipped
  # when its output is there, so the stage spans calls. PEER_FRACTION of the 100K file (default 0.2: its
  # bf16 hidden-state files, ~6.9 KB a token, ~40 GB, fit the disk beside the image), PEER_STORE (the subset's
  # store, default /dev/shm/peers.zarr), PEER_KIND (dspark or dflash; each kind has its own probe, checkpoints
  # and export), PEER_TLIM (seconds it trains, default 300, its compilation included, as ours' --time-limit),
  # PEER_STEPS and PEER_EPOCHS (its cosine and the epochs that hold it; default: what a probe of PEER_PROBE
  # steps, default 120, says fits PEER_TLIM: `bench peers plan`), PEER_ARGS (more of its train options, e.g.
  # --max-anchors 2048), PEER_EVAL (the kinds the last step decodes, default PEER_KIND, e.g. "dspark
  # dflash"), OURS (our runs on the same store, e.g. "/root/w/ours /root/w/plain": decoded beside them
  # in the last step, each from its export x-NAME), PEER_STOP (data:
  # end after its files; probe: after the probe; train: end after its training and conversion),
  # PEER_CONVERT_ARGS (e.g. --draft-head); its wheels on PYTHONPATH (scripts/peer_wheels.sh).
  # Ours: STORE=$PEER_STORE RUN=$W/ours VAL=400 TRAIN_ARGS="--schedule-seconds T" `train` (its cosine
  # fitted to the same T seconds, as the probe fits the peer's) and `eval`.
  P=$W/peers; PS=${PEER_STORE:-/dev/shm/peers.zarr}; mkdir -p "$P"; kind=${PEER_KIND:-dspark}
  spec=(python3 -c 'import sys; from speculators.__main__ import app; sys.argv[0] = "speculators"; app()')
  if [ ! -f "$PS/zarr.json" ]; then
    gunzip -c "$DATA" | awk -v f="${PEER_FRACTION:-0.2}" '(NR - 1) % 100 < f * 100' > "$P/train.jsonl"
    s=$(date +%s)
    python3 -m extract --config configs/smollm2-h200/extract.toml --store "$PS" --data "$P/train.jsonl" \
      --last-hidden "${TARGET[@]}" --json 2>&1 | grep -v "tok/s]" | tail -n 3 || exit 1
    echo "extract $(( $(date +%s) - s )) s"
  fi
  [ -d "$P/hf" ] || python3 -c 'import sys; from target.loader import save_hf_dir, packaged_gguf
save_hf_dir(sys.argv[1] or packaged_gguf(), sys.argv[2])' "${GGUF:-}" "$P/hf" || exit 1
  [ -s "$P/d/rows.jsonl" ] || python3 -m bench peers rows --store "$PS" --out "$P/d" || exit 1
  s=$(date +%s)
  [ -f "$P/d/dataset_info.json" ] || "${spec[@]}" prepare-data --model "$P/hf" --data "$P/d/rows.jsonl" --output "$P/d" \
    --minimum-valid-tokens 0 --seq-length 1024 --no-skip-token-freq 2>&1 | tail -n 2
  [ -d "$P/d/hidden_states" ] || python3 -m bench peers hidden --store "$PS" --data "$P/d" || exit 1
  echo "prepare-data and hidden files $(( $(date +%s) - s )) s"; du -sh "$PS" "$P/d/hidden_states"; df -h "$P" | tail -n 1
  [ "${PEER_STOP:-}" = data ] && exit 0
  # ours where its defaults differ: block 8, 5 layers, taps, mask, draft vocabulary, lr, full attention,
  # 2% held out (its default 10% is validated every epoch), a log line (and its GPU sync) every 100 steps.
  # PEER_LOSS (default eager): its fused Triton loss fails under torch 2.11's dynamo (the image's torch),
  # while its eager loss keeps the drafter compiled
  ptrain=(train --speculator-type "$kind" --verifier-name-or-path "$P/hf" --data-path "$P/d" --num-layers 5
    --block-size 8 --target-layer-ids 2 9 15 21 28 --mask-token-id 16 --full-attention-indices 0 1 2 3 4
    --no-sample-from-anchor --draft-vocab-size 12288 --lr 1.2e-3 --scheduler-type cosine --total-seq-len 16384
    --train-data-ratio 0.98 --log-freq 100 --loss-implementation "${PEER_LOSS:-eager}" ${PEER_ARGS:-})
  steps=${PEER_STEPS:-}; epochs=${PEER_EPOCHS:-50}; out=${OUT:-/tmp/out}; mkdir -p "$out"
  if [ -z "$steps" ] && [ ! -d "$P/ck-$kind" ]; then  # its step time and compile time from a 120-step probe
    timeout 400 "${spec[@]}" "${ptrain[@]}" --max-steps "${PEER_PROBE:-120}" --epochs 1 --checkpoint-freq 1 \
      --save-path "$P/probe" > "$P/probe-$kind.log" 2>&1
    gzip -c "$P/probe-$kind.log" > "$out/peer_${kind}_probe.log.gz"
    plan=$(python3 -m bench peers plan --log "$P/probe-$kind.log" --seconds "${PEER_TLIM:-300}") || exit 1
    read -r steps epochs < <(python3 -c 'import json, sys; p = json.loads(sys.argv[1]); print(p["steps"], p["epochs"])' "$plan")
    echo "probe $kind: $plan"; rm -rf "$P/probe"
    [ "${PEER_STOP:-}" = probe ] && exit 0
  fi
  if [ ! -d "$P/ck-$kind" ]; then  # a checkpoint every tenth of an epoch: a run the timeout cuts still leaves one
    s=$(date +%s)
    timeout $(( ${PEER_TLIM:-300} + 150 )) "${spec[@]}" "${ptrain[@]}" --max-steps "$steps" --epochs "$epochs" \
      --checkpoint-freq 0.1 --save-path "$P/ck-$kind" > "$P/train-$kind.log" 2>&1
    echo "speculators train $kind exit $? after $(( $(date +%s) - s )) s, $steps steps"
    tr '\r' '\n' < "$P/train-$kind.log" | grep -v '^\s*$' | tail -n 4
    gzip -c "$P/train-$kind.log" > "$out/peer_${kind}_train.log.gz"
  fi
  ck=$(find "$P/ck-$kind" -name model.safetensors -printf '%T@ %h\n' | sort -n | tail -n 1 | cut -d' ' -f2)
  # shellcheck disable=SC2086
  [ -d "$P/e-$kind" ] || python3 -m bench peers convert --checkpoint "$ck" --store "$PS" --out "$P/e-$kind" \
    ${PEER_CONVERT_ARGS:-} > /dev/null || exit 1
  cp "$P/e-$kind/config.json" "$out/peer_${kind}_export_config.json" 2>/dev/null
  [ "${PEER_STOP:-}" = train ] && exit 0
  # each export of PEER_EVAL and of OURS (ours trained on the same store) decoded at the same time, one
  # process each on the one GPU; their τ are figures, their speedups are not (they share the card)
  exports=(); for k in ${PEER_EVAL:-$kind}; do exports+=("$P/e-$k"); done
  for r in ${OURS:-}; do exports+=("$(export_run "$r")") || exit 1; done  # ours beside its peers
  decode_at_once "$out" "${exports[@]}";;
evals)  # RUNS (e.g. "/root/w/base /root/w/new", or export directories): decoded at once, one table (as `peers`)
  out=${OUT:-/tmp/out}; mkdir -p "$out"; exports=()
  for r in ${RUNS:?RUNS: the run directories to decode}; do  # or export directories, decoded as they are
    if is_export "$r"; then exports+=("$r"); else exports+=("$(export_dir "$r")"); fi
  done
  # refused before any export is written: a run's export would overwrite a given export of its name
  dup=$(for e in "${exports[@]}"; do basename "$e"; done | sort | uniq -d | head -n 1)
  [ -n "$dup" ] && { echo "evals: two exports are named $dup (the table names each by its directory)" >&2; exit 2; }
  for r in $RUNS; do is_export "$r" || export_run "$r" > /dev/null || exit 1; done
  decode_at_once "$out" "${exports[@]}";;
together)  # the call also holds each run's setup before its trainer starts and its closing pass and export
  # after, all of them slower for sharing the card: TLIM is only the trainers' share of the call
  out=${OUT:-/tmp/out}; mkdir -p "$out"; pids=(); names=()
  IFS=";" read -r -a sides <<< "${SIDES:?SIDES: NAME=TRAIN_ARGS;NAME=TRAIN_ARGS;...}"
  [ ${#sides[@]} -gt 4 ] && { echo "together: 4 runs at most (2 files each come back, 8 in all)" >&2; exit 2; }
  for s in "${sides[@]}"; do
    n=${s%%=*}; names+=("$n")
    RUN=$W/$n OUT=$W/work-$n/pack TRAIN_ARGS="${s#*=}" W=$W/work-$n bash "$0" train > "$W/$n.out" 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}"
  for n in "${names[@]}"; do
    cp "$W/$n/metrics.jsonl" "$out/${n}_metrics.jsonl" 2>/dev/null
    { tail -n 12 "$W/$n.out"; echo "== recompiles"; cat "$W/work-$n/pack/recompiles.txt"; ls "$W/$n/checkpoints"; } \
      > "$out/${n}_out.txt" 2>&1
    echo "== $n"; tail -n 3 "$W/$n.out"
  done;;
pack) pack;;
*) echo "stage must be formats, extract, valstore, train, follow, together, eval, evals, peers or pack" >&2; exit 2;;
esac
