"""Store throughput: write GB/s per writer process, random-batch read GB/s, 1M-sample index open.

    python -m bench store --dir /dev/shm/bench --width 20480 --tokens 2000000 --writers 1,4 --readers 1,4

Synthetic bf16 rows of `width` (20480 = Qwen3-8B with 5 taps); sample lengths lognormal around
600 tokens clipped to [64, 4096]. Data generation is not timed. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import synthetic_manifest
from cache_format import Manifest, ShardWriter, StoreReader, create_store, finalize_store


def manifest(width: int, taps: int, rows_per_shard: int, compression: str = "none") -> Manifest:
    return synthetic_manifest(name="synthetic", hidden_size=width // taps, vocab_size=151936,
                              layer_ids=tuple(range(1, 1 + taps)), max_len=4096, bucket_bounds=(512, 1024, 2048, 4096),
                              rows_per_shard=rows_per_shard, compression=compression)


def lengths(n_tokens: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    out, total = [], 0
    while total < n_tokens:
        n = int(np.clip(rng.lognormal(np.log(600), 0.8), 64, 4096))
        out.append(n)
        total += n
    return out


def run_procs(target, arglists: list[tuple]) -> tuple[list[tuple[int, float]], float]:
    """Run target(*args, queue) in one spawned process per arglist; (their (bytes, seconds)), wall."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    t0 = time.perf_counter()
    procs = [ctx.Process(target=target, args=(*args, q)) for args in arglists]
    for p in procs:
        p.start()
    res = [q.get() for _ in procs]
    for p in procs:
        p.join()
    return res, time.perf_counter() - t0


def write_part(path: str, m: dict, writer: int, ids: list[int], lens: list[int], q) -> None:
    man = Manifest.from_dict(m)
    g = torch.Generator().manual_seed(writer)
    pool = torch.randn(4096, man.row_width, generator=g).to(torch.bfloat16)  # reused rows: generation untimed
    w = ShardWriter(path, writer_id=writer)
    t0 = time.perf_counter()
    nbytes = 0
    for sid, n in zip(ids, lens):
        w.add(sid, input_ids=torch.zeros(n, dtype=torch.int32), loss_mask=torch.ones(n, dtype=torch.uint8),
              hidden=pool[:n])
        nbytes += n * man.row_width * 2
    w.close()
    q.put((nbytes, time.perf_counter() - t0))


def bench_write(root: Path, width: int, n_tokens: int, writers: int, rows: int, compression: str) -> dict:
    path = root / f"w{writers}_{compression}.zarr"
    shutil.rmtree(path, ignore_errors=True)
    m = manifest(width, 5, rows, compression)
    create_store(path, m)
    lens = lengths(n_tokens, 0)
    res, wall = run_procs(write_part, [(str(path), m.to_dict(), w, list(range(w, len(lens), writers)), lens[w::writers])
                                       for w in range(writers)])
    finalize_store(path, m)
    total = sum(b for b, _ in res)
    return {"writers": writers, "compression": compression, "bytes": total,
            "per_writer_gbps": [b / s / 1e9 for b, s in res], "aggregate_gbps": total / wall / 1e9, "path": str(path)}


def read_part(path: str, seed: int, batches: int, batch: int, q) -> None:
    r = StoreReader(path)
    rng = np.random.default_rng(seed)
    batch = min(batch, len(r))  # a small store: every sample in each batch (else the child dies and we wait)
    r.get_batch(rng.choice(r.sample_ids, batch, replace=False))  # warm-up
    nbytes, t0 = 0, time.perf_counter()
    for _ in range(batches):
        for s in r.get_batch(rng.choice(r.sample_ids, batch, replace=False)):
            nbytes += s.hidden.numel() * 2
    q.put((nbytes, time.perf_counter() - t0))


def bench_read(path: str, readers: int, batches: int, batch: int) -> dict:
    res, wall = run_procs(read_part, [(path, i, batches, batch) for i in range(readers)])
    return {"readers": readers, "batch": batch, "per_reader_gbps": [b / s / 1e9 for b, s in res],
            "aggregate_gbps": sum(b for b, _ in res) / wall / 1e9}


def bench_open(root: Path, n_samples: int) -> dict:
    """A finalized store of n tiny samples (width 8): how long StoreReader takes to open it."""
    path = root / f"open{n_samples}.zarr"
    if not (path / "zarr.json").exists():
        m = manifest(10, 5, 1 << 16)
        create_store(path, m)
        lens = np.random.default_rng(1).integers(2, 64, n_samples)
        with ShardWriter(path, writer_id=0) as w:
            h = torch.zeros(64, 10)
            ids = torch.zeros(64, dtype=torch.int32)
            for sid, n in enumerate(lens.tolist()):
                w.add(sid, input_ids=ids[:n], loss_mask=ids[:n], hidden=h[:n])
        finalize_store(path, m)
    t0 = time.perf_counter()
    r = StoreReader(path)
    t_open = time.perf_counter() - t0
    t0 = time.perf_counter()
    r.index.locate(n_samples - 1)
    return {"samples": len(r), "open_s": t_open, "first_lookup_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/dev/shm/draftcache_bench")
    ap.add_argument("--width", type=int, default=20480)
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--rows-per-shard", type=int, default=2048)
    ap.add_argument("--writers", default="1,4")
    ap.add_argument("--readers", default="1,4")
    ap.add_argument("--compression", default="none")
    ap.add_argument("--open-samples", type=int, default=1_000_000)
    a = ap.parse_args()
    root = Path(a.dir)
    root.mkdir(parents=True, exist_ok=True)
    out = {"width": a.width, "tokens": a.tokens, "write": [], "read": []}
    for w in (int(x) for x in a.writers.split(",")):
        out["write"].append(bench_write(root, a.width, a.tokens, w, a.rows_per_shard, a.compression))
        print(json.dumps(out["write"][-1]), flush=True)
    store = out["write"][0]["path"]
    for r in (int(x) for x in a.readers.split(",")):
        out["read"].append(bench_read(store, r, 6, 64))
        print(json.dumps(out["read"][-1]), flush=True)
    if a.open_samples:
        out["open"] = bench_open(root, a.open_samples)
        print(json.dumps(out["open"]), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
