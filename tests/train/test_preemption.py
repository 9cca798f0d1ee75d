"""Preemption: SIGTERM or SIGINT to `python -m train` (workers included, as a scheduler signals the
process group) stops it at the next log step with a checkpoint there and the signal's exit code;
`--resume` then goes on from that step. Signals land at random points of several runs."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from train.checkpoint import latest_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def _args(store: str, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "train", "--store", store, "--out", str(out), "--num-layers", "1", "--block-size", "4",
            "--num-anchors", "16", "--token-budget", "512", "--max-steps", "150", "--log-every", "5",
            "--workers", "1", "--seed", "3", "--lr", "3e-3", "--epochs", "500", *extra]


def _rows(out: Path) -> list[dict]:
    p = out / "metrics.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []


@pytest.mark.slow
@pytest.mark.parametrize("sig,wait", [(signal.SIGINT, 0.0), (signal.SIGTERM, None)])
def test_a_signal_stops_at_a_log_step_with_a_checkpoint_and_resume_goes_on(store, tmp_path, sig, wait):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen(_args(store, out), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    deadline = time.time() + 120
    while not _rows(out) and time.time() < deadline and p.poll() is None:
        time.sleep(0.05)  # the first log row: the loop runs
    time.sleep(random.Random(str(sig) + str(wait)).uniform(0, 1.0) if wait is None else wait)
    os.killpg(p.pid, sig)  # the whole group: the DataLoader worker too
    _, err = p.communicate(timeout=120)
    assert p.returncode == 128 + sig, err[-2000:]
    step = int(latest_checkpoint(out).name.split("-")[1])
    assert 0 < step < 150 and step % 5 == 0 and _rows(out)[-1]["step"] <= step
    res = subprocess.run(_args(store, out, "--resume"), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "trained 150 steps" in res.stdout, res.stderr[-2000:]
    steps = [r["step"] for r in _rows(out) if "loss" in r]
    assert steps == sorted(set(steps)) and steps[-1] == 150  # no step logged twice, none lost past the checkpoint
