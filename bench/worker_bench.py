"""Seconds per training micro-batch in one DataLoader worker: read, (dequantize,) collate.

    python -m bench worker --dtype fp8_e4m3            # 8B shape, 2 x 2048 tokens per micro-batch
    python -m bench worker --dtype bfloat16 --profile  # + cProfile's top functions
    python -m bench worker --shape smollm2-135m --samples 2000 --seq 300 --check-shards  # one shard's first-read check

A worker runs with one torch thread; so does this. With W workers the trainer gets at most W / t
micro-batches a second: when that is near its step rate, the prefetched batches run out mid-epoch and
the GPU waits (docs/benchmarks/2026-11-30_profiles_h200-x2.md). Needs no GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import shutil
import time
from pathlib import Path

import torch

from bench.common import SHAPES
from bench.train_bench import bench_batches, drafter_config, make_store
from cache_format.reader import StoreReader
from cache_format.shard_check import check_shard


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default="/dev/shm/draftcache_worker_bench.zarr")
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="fp8_e4m3", choices=["bfloat16", "fp8_e4m3", "mxfp4"])
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--token-budget", type=int, default=4096)
    ap.add_argument("--items", type=int, default=5, help="micro-batches timed (after one untimed)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--verify-shards", action="store_true", help="the reader checks each shard on first read "
                    "(python -m train --verify-shards on): the first micro-batch pays for its shards")
    ap.add_argument("--check-shards", action="store_true",
                    help="also time the first-read check of every shard: as a training reader checks (raw reads, "
                    "no finite test) and as verify checks (zarr decode, finite test)")
    a = ap.parse_args()
    torch.set_num_threads(1)  # as in a DataLoader worker
    t0 = time.perf_counter()
    make_store(a.store, a.shape, a.samples, a.seq, dtype=a.dtype)
    built = time.perf_counter() - t0
    dc = drafter_config(a.shape, 5)
    ds = bench_batches(a.store, dc, token_budget=a.token_budget, anchors=512, count=a.items + 1,
                       verify_shards=a.verify_shards)
    t0 = time.perf_counter()
    ds[0]  # the reader opens, the first shard pages are touched (and checked, with --verify-shards)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(1, a.items + 1):
        ds[i]
    per = (time.perf_counter() - t0) / a.items
    print({"shape": a.shape, "dtype": a.dtype, "tokens_per_micro_batch": a.token_budget, "s_per_micro_batch": per,
           "s_first_micro_batch": first, "verify_shards": a.verify_shards, "store_bytes": sum(
               p.stat().st_size for p in Path(a.store).rglob("*") if p.is_file()), "store_built_s": built}, flush=True)
    if a.check_shards:
        print(check_timing(a.store), flush=True)
    if a.profile:
        prof = cProfile.Profile()
        prof.enable()
        for i in range(1, a.items + 1):
            ds[i]
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(10)
    shutil.rmtree(a.store, ignore_errors=True)


def check_timing(store: str) -> dict:
    """Seconds to check every shard of `store` once, as a training reader and as verify does."""
    out = {}
    for name, raw, finite in (("reader", True, False), ("verify", False, True)):
        r = StoreReader(store)
        if not raw:
            r._raw = None  # the zarr path: what every check took before the raw reads
        shards = [(k, s) for k in r.index.shards for s in r.index.shards[k]]
        t0 = time.perf_counter()
        bad = [why for k, s in shards if (why := check_shard(r, k, s, finite=finite))]
        sec = time.perf_counter() - t0
        assert not bad, bad
        out[name] = {"shards": len(shards), "s": round(sec, 3), "ms_per_shard": round(1e3 * sec / len(shards), 2)}
    size = sum(p.stat().st_size for p in Path(store).rglob("c/**/*") if p.is_file())
    out["shard_mb"] = round(size / 1e6 / max(1, out["reader"]["shards"]), 1)
    return out


if __name__ == "__main__":
    main()
