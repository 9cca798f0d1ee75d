"""Preemption at random points over many runs: SIGTERM or SIGINT to the whole process group of
`python -m train`, `python -m extract` and `python -m extract.regenerate` (as a scheduler signals a
job), at a uniformly random moment of an uninterrupted run's length; then the same command again
(train with --resume), which must end equal to the uninterrupted run.

    python -m bench preempt --runs 20 --stages train,extract,regen --seed 0

Per run it records how the signalled process ended: the signal's own code 128 + N after saving or
committing what it had (`handled`), killed by the signal while the interpreter starts or shuts
down, outside the stage's command (`outside the command`: nothing written yet, or all of it), or done
before the signal came (`finished`). Any other end, a rerun that fails, or a result unlike the uninterrupted one is a
failure: train must log every step once with the same losses, extract must hold the same samples
(bitwise ids and tokens, hidden states within bf16 rounding), regeneration the same answers.
Tiny random-weight targets on the CPU; the figures: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import tiny_target_dir, write_chats
from cache_format import StoreReader

ROOT = Path(__file__).resolve().parents[1]
TRAIN_STEPS = 120


def commands(stage: str, work: Path, out: Path) -> tuple[list[str], list[str]]:
    """(first command, rerun command) of a stage writing `out`, on the fixture under `work`."""
    target, chats, store = str(work / "t"), str(work / "c.jsonl"), str(work / "ref.zarr")
    if stage == "train":
        cmd = ["-m", "train", "--store", store, "--out", str(out), "--num-layers", "1", "--block-size", "4",
               "--num-anchors", "16", "--token-budget", "512", "--max-steps", str(TRAIN_STEPS), "--log-every", "5",
               "--workers", "1", "--seed", "3", "--lr", "3e-3", "--epochs", "500"]
        return cmd, [*cmd, "--resume"]
    if stage == "extract":
        cmd = ["-m", "extract", "--store", str(out), "--target", target, "--data", chats, "--layers", "0,2,4",
               "--max-len", "256", "--min-supervised", "4", "--token-budget", "256", "--rows-per-shard", "64"]
        return cmd, cmd
    cmd = ["-m", "extract.regenerate", "--target", target, "--prompts", chats, "--out", str(out), "--limit", "30",
           "--max-new-tokens", "24", "--batch-size", "1"]
    return cmd, cmd


def result(stage: str, out: Path):
    """What must equal the uninterrupted run's: train's losses by step, extract's samples, the answers."""
    if stage == "train":
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
        return [(r["step"], r["loss"]) for r in rows if "loss" in r]
    if stage == "extract":
        r = StoreReader(out)
        return {s.sample_id: (s.input_ids, s.hidden) for s in r.get_batch(r.sample_ids)}
    records = [json.loads(x) for x in out.read_text(encoding="utf-8").split("\n")[:-1]]
    return sorted((r["prompt_index"], r["sample"], r["messages"][-1]["content"]) for r in records)


def same(stage: str, a, b) -> bool:
    if stage == "train":  # every step once, in order, with the uninterrupted run's loss (resume is exact)
        return [s for s, _ in a] == [s for s, _ in b] and all(abs(x - y) <= 1e-4 * abs(y) for (_, x), (_, y) in zip(a, b))
    if stage == "extract":
        return a.keys() == b.keys() and all(
            torch.equal(a[k][0], b[k][0]) and torch.allclose(a[k][1].float(), b[k][1].float(), rtol=1e-2, atol=1e-2)
            for k in a)
    return a == b


def run(cmd: list[str], **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, *cmd], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, **kw)


def one_run(stage: str, work: Path, out: Path, delay: float, sig: int, reference) -> tuple[str, str]:
    """Signal one run after `delay` seconds, rerun it: (how the first ended, '' or what failed)."""
    first, again = commands(stage, work, out)
    p = run(first)
    try:
        p.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, sig)  # the whole group, as a scheduler: DataLoader workers and writers too
    text, _ = p.communicate(timeout=300)
    end = {0: "finished", 128 + sig: "handled", -sig: "outside the command"}.get(p.returncode)
    if end is None:
        return "failed", f"exit {p.returncode} after {signal.Signals(sig).name}: {text.strip()[-300:]}"
    r = run(again)
    text, _ = r.communicate(timeout=600)
    if r.returncode != 0:
        return end, f"rerun exit {r.returncode}: {text.strip()[-300:]}"
    return end, "" if same(stage, result(stage, out), reference) else "the rerun's result differs from the uninterrupted run"


def fixture(work: Path) -> None:
    """A tiny random-weight target, 120 conversations, and the store train reads."""
    tiny_target_dir(work / "t", "llama")
    write_chats(work / "c.jsonl", 120, seed=2, cyclic=True)
    p = run(commands("extract", work, work / "ref.zarr")[0])
    text, _ = p.communicate(timeout=600)
    if p.returncode:
        raise SystemExit(f"error: the fixture's extraction failed: {text.strip()[-500:]}")


def stage_runs(stage: str, work: Path, runs: int, rng: random.Random) -> dict:
    """`runs` signalled runs of one stage, each at a random moment of an uninterrupted run's length."""
    ref_out = work / f"{stage}-ref"
    t0 = time.time()
    p = run(commands(stage, work, ref_out)[0])
    text, _ = p.communicate(timeout=600)
    if p.returncode:
        raise SystemExit(f"error: the uninterrupted {stage} run failed: {text.strip()[-500:]}")
    seconds = time.time() - t0
    reference = result(stage, ref_out)
    ends, failures = {"handled": 0, "outside the command": 0, "finished": 0, "failed": 0}, []
    for i in range(runs):
        out = work / f"{stage}-{i}"
        delay, sig = rng.uniform(0, seconds), rng.choice([signal.SIGTERM, signal.SIGINT])
        end, failure = one_run(stage, work, out, delay, sig, reference)
        ends[end] += 1
        if failure:
            failures.append({"run": i, "delay_s": round(delay, 2), "signal": signal.Signals(sig).name, "what": failure})
        shutil.rmtree(out, ignore_errors=True) if out.is_dir() else out.unlink(missing_ok=True)
        print(f"{stage} run {i + 1}/{runs}: {signal.Signals(sig).name} at {delay:.1f} s: {end}"
              f"{': ' + failure if failure else ''}", flush=True)
    return {"stage": stage, "runs": runs, "uninterrupted_s": round(seconds, 1), **ends, "failures": failures}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench preempt", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20, help="signalled runs per stage")
    ap.add_argument("--stages", default="train,extract,regen", help="comma-separated: train, extract, regen")
    ap.add_argument("--seed", type=int, default=0, help="draws the moments and the signals")
    ap.add_argument("--json", default="", help="also write the figures to this file")
    a = ap.parse_args()
    stages = [s for s in a.stages.split(",") if s]
    if a.runs < 1 or not stages or not set(stages) <= {"train", "extract", "regen"}:
        raise SystemExit("error: --runs must be at least 1 and --stages a list of train, extract, regen")
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # launched in the background: the children would
        signal.signal(signal.SIGINT, signal.default_int_handler)  # inherit that; a scheduler's job does not
    rng = random.Random(a.seed)
    with tempfile.TemporaryDirectory(prefix="preempt-") as tmp:
        work = Path(tmp)
        fixture(work)
        res = {"seed": a.seed, "stages": [stage_runs(s, work, a.runs, rng) for s in stages]}
    print(json.dumps(res))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    if any(s["failures"] or s["failed"] for s in res["stages"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
