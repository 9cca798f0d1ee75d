"""One ShardWriter's write rate, for A/B runs of two checkouts on the same machine.

    python bench/writer_ab.py --root /path/to/checkout --tokens 150000 [--profile]

Imports cache_format from --root (so an older commit's writer can be timed against this one's,
alternating), touches and frees 6.7 GB of tmpfs first (on the CPU VM the first touch of fresh
guest pages costs 4x a reused one, which swamped the difference being measured), then writes
synthetic bf16 rows of width 20480 (Qwen3-8B, 5 taps) with store_bench's sample lengths and its
timed write loop (store_bench.write_part, from --root too). One line;
--profile adds cProfile's cumulative times of the writer's functions (the calling thread only).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

ap = argparse.ArgumentParser()
ap.add_argument("--root", required=True, help="checkout whose cache_format is timed")
ap.add_argument("--tokens", type=int, default=150_000)
ap.add_argument("--dir", default="/dev/shm")
ap.add_argument("--profile", action="store_true")
a = ap.parse_args()
sys.path[:0] = [a.root, os.path.join(a.root, "bench")]

import cProfile  # noqa: E402
import pstats  # noqa: E402
import queue  # noqa: E402

import numpy as np  # noqa: E402
from store_bench import lengths, manifest, write_part  # noqa: E402

from cache_format import create_store  # noqa: E402

path = os.path.join(a.dir, f"writer_ab_{os.getpid()}.zarr")
m = manifest(20480, 5, 2048)
create_store(path, m)
junk = np.ones(64 << 20, dtype=np.uint8)
for i in range(100):
    with open(os.path.join(a.dir, f"writer_ab_junk{i}"), "wb") as f:
        f.write(junk)
for i in range(100):
    os.unlink(os.path.join(a.dir, f"writer_ab_junk{i}"))
prof = cProfile.Profile()
if a.profile:
    prof.enable()
lens, done = lengths(a.tokens, 0), queue.Queue()
write_part(path, m.to_dict(), 0, list(range(len(lens))), lens, done)  # times add..close itself
prof.disable()
nbytes, dt = done.get()
print(f"{a.root}: {nbytes / dt / 1e9:.3f} GB/s ({nbytes / 1e9:.2f} GB in {dt:.2f} s)", flush=True)
if a.profile:
    pstats.Stats(prof).sort_stats("cumtime").print_stats(r"writer.py|layout.py|codec.py|zarr/core/array.py", 20)
shutil.rmtree(path)
