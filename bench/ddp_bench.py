"""DDP scaling of `python -m train`: positions/s on 1 GPU vs N GPUs, same synthetic store, same settings.

    python -m bench ddp --shape qwen3-8b --gpus 1,2 --steps 30 --samples 96 --seq 2048

Builds a random store once (bench/train_bench.make_store), then runs the real trainer under
torchrun for each GPU count with the same per-rank token budget (so N GPUs train N x the positions
per step), and reads positions/s from the run's metrics.jsonl, skipping the first log rows
(compilation, worker start). Scaling efficiency = rate(N) / (N x rate(1)). On a CPU machine it
runs gloo ranks on the tiny shape (a smoke run, not a figure).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
from pathlib import Path

from bench.train_bench import bench_batches, drafter_config, flops_per_step, make_store
from cache_format import StoreReader
from train.config import GRAD_REDUCES


def run(store: str, out: str, gpus: int, a: argparse.Namespace) -> float:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus), "-m", "train",
           "--store", store, "--out", out, "--num-layers", str(a.layers), "--token-budget", str(a.token_budget),
           "--max-steps", str(a.steps), "--epochs", "100", "--log-every", str(a.log_every), "--workers", str(a.workers),
           "--grad-reduce", a.grad_reduce, *(["--compile"] if a.compile else [])]
    env = child_env()
    if gpus and os.environ.get("CUDA_VISIBLE_DEVICES") is None and a.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(gpus))
    Path(out).mkdir(parents=True)
    log = Path(out) / "run.log"
    # own session, so a time limit can stop torchrun and its ranks together (they hold the GPUs)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=a.time_limit or None)
        except subprocess.TimeoutExpired:  # the rate comes from the rows logged so far
            stop_tree(proc.pid)
            proc.wait()
            rc = 0
            print(f"{gpus} GPU run stopped at the {a.time_limit:.0f} s limit", file=sys.stderr)
    if rc:
        raise SystemExit(f"{gpus} GPU run failed (exit {rc}):\n{log.read_text()[-3000:]}")
    return steady_rate(Path(out), a.skip_rows)


def stop_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants. torchrun starts each rank in a session of its own, so
    killing torchrun's process group leaves the ranks running (and holding their GPUs)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def child_env(**extra: str) -> dict:
    """The environment for a child run: the project first on PYTHONPATH, the caller's path kept after it
    (on the GPU host the carried wheels live there)."""
    path = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, **extra)


def steady_rate(run: Path, skip: int, key: str = "positions_per_s", stat=statistics.fmean) -> float:
    """`stat` (the mean) of `key` (positions/s) over a run's metrics rows after the first `skip`
    (compilation, worker start)."""
    path = run / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if '"positions_per_s"' in x] if path.exists() else []
    if not rows:
        raise SystemExit(f"{run}: no metrics rows logged (see {run / 'run.log'})")
    steady = rows[skip:] or rows[-1:]
    return stat([r[key] for r in steady])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", default="/dev/shm/draftcache_ddp_bench.zarr")
    ap.add_argument("--out", default="/tmp/draftcache_ddp_bench")
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--gpus", default="1,2")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--skip-rows", type=int, default=2, help="first metrics rows left out (warm-up)")
    ap.add_argument("--token-budget", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--grad-reduce", default="fp32", choices=GRAD_REDUCES, help="train's DDP all-reduce dtype")
    ap.add_argument("--time-limit", type=float, default=0.0,
                    help="stop each run after this many seconds and rate the rows logged by then (0: no limit)")
    ap.add_argument("--reuse-store", action="store_true",
                    help="keep a finalized store already at --store (a second call on a warm machine)")
    ap.add_argument("--base-rate", type=float, default=0.0,
                    help="1-GPU positions/s measured by an earlier call; scaling is then against it")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="H200 dense bf16 spec")
    a = ap.parse_args()
    import torch

    a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if not (a.reuse_store and (Path(a.store) / "zarr.json").exists() and StoreReader(a.store).finalized):
        make_store(a.store, a.shape, a.samples, a.seq)
    rates = {int(g): run(a.store, f"{a.out}/g{g}", int(g), a) for g in a.gpus.split(",")}
    base = a.base_rate or rates[min(rates)] / min(rates)
    fpp = flops_per_position(a)
    print(json.dumps({"shape": a.shape, "device": a.device, "layers": a.layers, "token_budget_per_rank": a.token_budget,
                      "compile": a.compile, "grad_reduce": a.grad_reduce, "positions_per_s": rates, "base_rate_1gpu": base,
                      "scaling_efficiency": {g: r / (g * base) for g, r in rates.items()},
                      "flops_per_position": fpp,
                      "mfu_per_gpu": {g: r * fpp / g / 1e12 / a.peak_tflops for g, r in rates.items()}}))


def flops_per_position(a: argparse.Namespace) -> float:
    """Model FLOPs per supervised draft position, counted as bench/train_bench.py counts them, over the first
    epoch's first batches (this bench's samples all have one length, so every batch costs the same)."""
    dc = drafter_config(a.shape, a.layers)
    ds = bench_batches(a.store, dc, token_budget=a.token_budget, anchors=512, count=4)
    batches = [ds[i] for i in range(len(ds))]
    return sum(flops_per_step(dc, b, 512) for b in batches) / sum(int((b["labels"] != -100).sum()) for b in batches)


if __name__ == "__main__":
    main()
