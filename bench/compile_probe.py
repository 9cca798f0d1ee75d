"""Where a cold first training step spends its time: each compile the step triggers, timed alone.

    python bench/compile_probe.py [--threads N] [--cache-dir DIR]

On a fresh GPU machine `python -m train` at the Qwen3-8B shape logged no step in 200 s, and a
fault-handler dump at 110 s found it still compiling the FlexAttention block mask (then built by a
compiled create_block_mask; train.masks now builds its tiles directly, with no compile). This
times, in one fresh process and in the step's order: (1) a trivial compiled function (inductor's
compile-worker pool starts here), (2) the block mask, (3) compiled flex_attention forward +
backward at the drafter's head shape; then each again, warm.
`--threads` sets TORCHINDUCTOR_COMPILE_THREADS (1 = compile in this process, no worker pool);
`--cache-dir` a fresh TORCHINDUCTOR_CACHE_DIR, so a run is cold even on a machine that compiled
before. One JSON line of seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=0, help="TORCHINDUCTOR_COMPILE_THREADS (0: inductor's default)")
    ap.add_argument("--cache-dir", default="", help="TORCHINDUCTOR_CACHE_DIR for this run (empty: the default)")
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--heads", default="32,8,128", help="query heads, kv heads, head dim")
    a = ap.parse_args()
    if a.threads:
        os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = str(a.threads)
    if a.cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = a.cache_dir
    t_import = time.perf_counter()
    import torch

    from train.masks import flex_block_mask
    from train.model import _compiled_flex

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    out = {"device": dev, "threads": a.threads or "default", "import_s": time.perf_counter() - t_import}

    def timed(name: str, fn) -> None:
        t0 = time.perf_counter()
        fn()
        if dev == "cuda":
            torch.cuda.synchronize()
        out[name] = round(time.perf_counter() - t0, 2)

    x = torch.randn(1 << 20, device=dev)
    trivial = torch.compile(lambda t: (t * 2).sin() + 1)
    g = torch.Generator().manual_seed(0)
    anchors = torch.randint(1, a.ctx - 1, (1, a.anchors), generator=g).to(dev)  # [B=1, N]
    nh, nkv, hd = (int(s) for s in a.heads.split(","))
    q_len, kv_len = a.anchors * 16, a.ctx + a.anchors * 16
    q = torch.randn(1, nh, q_len, hd, device=dev, dtype=torch.bfloat16, requires_grad=True)  # [B, H, Q, D]
    k = torch.randn(1, nkv, kv_len, hd, device=dev, dtype=torch.bfloat16, requires_grad=True)  # [B, Hkv, KV, D]
    v = torch.randn_like(k, requires_grad=True)

    def flex_step(mask) -> None:
        o = _compiled_flex()(q, k, v, block_mask=mask, enable_gqa=True)
        o.float().sum().backward()

    for phase in ("cold", "warm"):
        timed(f"{phase}_trivial_s", lambda: trivial(x))
        timed(f"{phase}_block_mask_s", lambda: flex_block_mask(anchors, a.ctx, 16))
        if dev == "cuda":
            mask = flex_block_mask(anchors, a.ctx, 16)
            timed(f"{phase}_flex_fwd_bwd_s", lambda m=mask: flex_step(m))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
