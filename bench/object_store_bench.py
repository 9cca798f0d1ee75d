"""Write and read GB/s of a store on an S3-compatible server against the same store on the local
filesystem, in one run.

    python -m bench objstore                         # starts moto's S3 server on this machine
    AWS_ENDPOINT_URL=... python -m bench objstore --url s3://bucket/prefix   # a server of yours

Builds a synthetic store (random bf16 taps at a target's shape, `--samples` x `--seq` tokens),
then measures, on the same bytes:
- write: the store (every file, the frozen embedding and lm_head included) copied to another
  local directory, against `Mirror.push` to the server (the upload extraction does, in commit order);
- read: every sample in a random order through `StoreReader` (batches of 16; GB/s of shard bytes): the local store with
  shard checks off and on, the URL with a cold cache (each shard fetched, then checked, as training
  reads it) and again with the cache warm.
The server is whatever `--url` names; without one, moto's server mode (a Python process) on a free
local port, which measures the client path more than a real object store's bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import new_bucket, start_moto
from bench.train_bench import make_store
from cache_format import StoreReader
from cache_format.mirror import Mirror


def _read_all(reader: StoreReader, order: np.ndarray) -> float:
    """Seconds to read every sample of `order` in batches of 16."""
    t = time.perf_counter()
    for i in range(0, len(order), 16):
        reader.get_batch(order[i:i + 16])
    return time.perf_counter() - t


def _bytes(root: Path, data_only: bool = False) -> int:
    """Bytes of every file of a store (data_only: the shard files that reads fetch)."""
    from cache_format.remote import _is_data

    return sum(p.stat().st_size for p in root.rglob("*")
               if p.is_file() and (not data_only or _is_data(p.relative_to(root).as_posix())))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="", help="s3://bucket/prefix on a server of yours (default: a local moto server)")
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dir", default="", help="where the local stores go (default: a temporary directory)")
    a = ap.parse_args()
    work = Path(a.dir or tempfile.mkdtemp(prefix="draftcache-objstore-"))
    proc, url = None, a.url
    if not url:
        proc, endpoint = start_moto()
        url = f"s3://{new_bucket(endpoint)}/store"
    os.environ["DRAFTCACHE_STORE_CACHE"] = str(work / "cache")
    try:
        src = work / "src.zarr"
        make_store(str(src), a.shape, a.samples, a.seq)
        total, shards = _bytes(src), _bytes(src, data_only=True)
        t = time.perf_counter()
        shutil.copytree(src, work / "copy.zarr", dirs_exist_ok=True)
        local_write = time.perf_counter() - t
        t = time.perf_counter()
        Mirror(src, url).push()
        push = time.perf_counter() - t
        order = np.random.default_rng(0).permutation(StoreReader(src).sample_ids)
        plain = _read_all(StoreReader(src), order)
        checked = _read_all(StoreReader(src, verify_shards=True), order)
        t = time.perf_counter()
        remote = StoreReader(url)
        opened = time.perf_counter() - t
        cold = _read_all(remote, order)
        warm = _read_all(StoreReader(url), order)
        gb, rb = total / 1e9, shards / 1e9  # writes move every file, reads the shards
        print(json.dumps({
            "url": url, "server": "moto (local, Python)" if proc else "given", "store_bytes": total,
            "shard_bytes": shards,
            "write_gb_s": {"local_copy": gb / local_write, "object_push": gb / push},
            "read_gb_s": {"local": rb / plain, "local_checked": rb / checked, "object_cold_checked": rb / cold,
                          "object_warm_checked": rb / warm},
            "object_open_s": opened, "samples": a.samples, "seq": a.seq, "shape": a.shape,
        }))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)
        if not a.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
