#!/usr/bin/env bash
# The default recipe (math + code + chat, 100K samples) on every GPU of one machine, one process per
# GPU, detached (setsid) so it outlives one device call; rerun to wait for it again (it resumes).
#   bash scripts/recipe_gpu.sh start DIR [SAMPLES]   # start (or resume) the shards, then wait
#   bash scripts/recipe_gpu.sh wait DIR SECONDS      # wait up to SECONDS for the merge
#   bash scripts/recipe_gpu.sh pack DIR OUTDIR       # train.jsonl.gz in 15 MB pieces + recipe.json + logs
# Ends only the processes it started (their pids are in DIR/pids).
set -uo pipefail
cmd=$1; dir=$2
case $cmd in
start)
  mkdir -p "$dir"; : > "$dir/pids"
  n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
  for g in $(seq 0 $((n - 1))); do
    CUDA_VISIBLE_DEVICES=$g setsid python3 -m extract.regenerate --recipe default --out "$dir" \
      --recipe-samples "${3:-100000}" --shard "$g/$n" > "$dir/shard$g.log" 2>&1 &
    echo $! >> "$dir/pids"
  done
  echo "started $n shards: $(tr '\n' ' ' < "$dir/pids")";;
wait)
  end=$(( $(date +%s) + $3 ))
  while [ ! -f "$dir/recipe.json" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
  tail -n 2 "$dir"/shard*.log; ls "$dir/parts" | tr '\n' ' '; echo
  [ -f "$dir/recipe.json" ] && cat "$dir/recipe.json" | head -c 1500;;
pack)
  mkdir -p "$3"; gzip -c "$dir/train.jsonl" | split -b 15M -d - "$3/train.jsonl.gz.part-"
  cp "$dir/recipe.json" "$3/"; tail -n 60 "$dir"/shard*.log > "$3/recipe_logs.txt"; ls -la "$3";;
stop)
  while read -r p; do kill "$p" 2>/dev/null; done < "$dir/pids";;
esac
