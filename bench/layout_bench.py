"""The design card's layout on two GPUs: stage one on GPU 0 while stage two follows the store on GPU 1.

    python -m bench layout --shape qwen3-8b --samples 768 --words 1400 --steps 60

Three phases with the real CLIs (`python -m extract`, `python -m train`), same data and settings:
  A  extraction alone on GPU 0 (store A)
  C  training alone from store A on GPU 1 (this also fills the compile cache, so that B's trainer
     starts within seconds instead of compiling FlexAttention while the extraction runs alone)
  B  extraction on GPU 0 into store B while `train --follow` trains from B on GPU 1
and reports B's rates as fractions of A's and C's ("both at full rate" = both near 1.0). The stores
are fp8 by default (half the bytes of bf16), so that enough samples fit in /dev/shm for the
extraction to outlast the trainer's start. The target
is a random-weight model of the shape, saved as an HF directory with the tests' tiny tokenizer
(no download); the conversations are long random-word answers. On a CPU machine it runs the tiny
shape as a smoke test (both phases share the cores, so its ratios mean nothing): `--shape tiny
--samples 24 --words 100 --max-len 256 --token-budget 512 --steps 12 --workers 1` took 2.4 min on the
2-core VM, where the default budget of 4096 tokens (512 dense-masked anchors) takes ~100 s a step.
--deadline stops phase B's trainer at that many seconds from the start and rates the rows it logged,
so a call's time limit does not cost the summary; train_ratio_median is not moved by one stalled row.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from bench.ddp_bench import child_env, steady_rate  # noqa: E402


def make_target(path: Path, shape: str) -> None:
    import torch
    import transformers

    from bench.common import SHAPES, tiny_tokenizer

    tok = tiny_tokenizer()
    cfg = transformers.Qwen3Config(**SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=False,
                                   eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(dev):
        model = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    tok.save_pretrained(path)


def make_data(path: Path, samples: int, words: int) -> None:
    from bench.common import CORPUS

    rng = random.Random(0)
    vocab = " ".join(CORPUS).split()
    with open(path, "w") as f:
        for _ in range(samples):
            q, a = " ".join(rng.choices(vocab, k=20)), " ".join(rng.choices(vocab, k=rng.randint(words // 2, words)))
            f.write(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n")


def launch(args: list[str], gpu: int, log: Path) -> subprocess.Popen:
    env = child_env(CUDA_VISIBLE_DEVICES=str(gpu))
    return subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, env=env, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)


def finish(p: subprocess.Popen, log: Path, deadline: float | None = None) -> bool:
    """Wait for a phase; False if `deadline` (time.time()) came first and it was stopped there."""
    try:
        code = p.wait(None if deadline is None else max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        p.terminate()
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
        return False
    if code != 0:
        raise SystemExit(f"{log}:\n{log.read_text()[-3000:]}")
    return True


def extract_rate(log: Path) -> float:
    text = log.read_text()
    summary = json.loads(text[text.index("{\n"):text.rindex("}") + 1])
    return summary["tokens_per_s_per_rank"][0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/dev/shm/draftcache_layout_bench")
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--samples", type=int, default=768)
    ap.add_argument("--dtype", default="fp8_e4m3", choices=["bfloat16", "fp8_e4m3", "mxfp4"])
    ap.add_argument("--words", type=int, default=1400)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--token-budget", type=int, default=4096)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--skip-rows", type=int, default=2)
    ap.add_argument("--deadline", type=float, default=0,
                    help="seconds from the start: phase B's trainer is stopped then and rated on the rows it logged")
    ap.add_argument("--compile", action="store_true",
                    help="train with --compile (the same graphs as gpu_rates.sh ddp1, so its inductor cache serves)")
    a = ap.parse_args()
    d = Path(a.dir)
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    t0 = time.time()
    make_target(d / "target", a.shape)
    make_data(d / "data.jsonl", a.samples, a.words)
    print(f"target and data in {time.time() - t0:.0f} s", flush=True)
    x = ["extract", "--target", str(d / "target"), "--data", str(d / "data.jsonl"), "--max-len", str(a.max_len),
         "--token-budget", str(max(a.max_len, 16384)), "--min-supervised", "32", "--dtype", a.dtype, "--json"]
    t = ["train", "--num-layers", str(a.layers), "--token-budget", str(a.token_budget), "--max-steps", str(a.steps),
         "--epochs", "1000", "--log-every", "5", "--workers", str(a.workers), *(["--compile"] if a.compile else [])]
    finish(launch([*x, "--store", str(d / "A.zarr")], 0, d / "A.log"), d / "A.log")
    print(f"A done at {time.time() - t0:.0f} s", flush=True)
    finish(launch([*t, "--store", str(d / "A.zarr"), "--out", str(d / "Crun")], 1, d / "C.log"), d / "C.log")
    print(f"C done at {time.time() - t0:.0f} s", flush=True)
    pb_x = launch([*x, "--store", str(d / "B.zarr")], 0, d / "Bx.log")
    pb_t = launch([*t, "--store", str(d / "B.zarr"), "--out", str(d / "Brun"), "--follow"], 1, d / "Bt.log")
    finish(pb_x, d / "Bx.log")
    print(f"B extraction done at {time.time() - t0:.0f} s", flush=True)
    whole = finish(pb_t, d / "Bt.log", t0 + a.deadline if a.deadline else None)
    ax, bx = extract_rate(d / "A.log"), extract_rate(d / "Bx.log")
    bt, ct = steady_rate(d / "Brun", a.skip_rows), steady_rate(d / "Crun", a.skip_rows)
    # a following trainer slower than alone: waiting on the store (data wait) or on a shared host (not)
    bw, cw = (steady_rate(d / r, a.skip_rows, "data_wait_frac") for r in ("Brun", "Crun"))
    print(json.dumps({"shape": a.shape, "extract_tok_s_alone": ax, "extract_tok_s_with_training": bx,
                      "extract_ratio": bx / ax, "train_pos_s_alone": ct, "train_pos_s_following": bt,
                      "train_ratio": bt / ct, "train_data_wait_alone": cw, "train_data_wait_following": bw,
                      "train_ratio_median": (steady_rate(d / "Brun", a.skip_rows, stat=statistics.median)
                                             / steady_rate(d / "Crun", a.skip_rows, stat=statistics.median)),
                      "train_b_stopped_at_deadline": not whole, "wall_s": time.time() - t0}))


if __name__ == "__main__":
    main()
