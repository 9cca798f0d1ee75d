"""Read-only reports on a store: `inspect` (what is in it) and `verify` (is it sound)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cache_format.checksums import check_checksums
from cache_format.codec import checksum
from cache_format.errors import CacheFormatError
from cache_format.layout import STATE_KEY, read_root_attrs
from cache_format.reader import StoreReader
from cache_format.remote import default_local, is_url, object_sizes, pull
from cache_format.shard_check import check_shard

__all__ = ["inspect_store", "verify_store"]


def _disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def inspect_store(path: str | os.PathLike) -> dict[str, Any]:
    """Summary of a store as a JSON-able dict (the `inspect --json` contract)."""
    r = StoreReader(path)
    m = r.manifest
    buckets, lengths = r.buckets(), r.lengths()
    sizes = object_sizes(r.url) if r.url else None  # a remote store's local copy lacks its shards
    out_buckets = []
    for b in range(m.num_buckets):
        lo, hi = m.bucket_range(b)
        sel = buckets == b
        out_buckets.append({"bucket": b, "lo": lo, "hi": hi, "num_samples": int(sel.sum()),
                            "num_tokens": int(lengths[sel].sum())})
    complete = sum(1 for g in r.index.shards.values() for e in g.values()
                   if e["rows"] == m.rows_per_shard)
    incomplete = sum(len(g) for g in r.index.shards.values()) - complete
    if sizes is None:
        data_bytes = sum(_disk_bytes(Path(r.root) / key) for key in r.index.groups)
        disk_bytes = _disk_bytes(Path(r.root))
    else:
        groups = set(r.index.groups)
        data_bytes = sum(n for k, n in sizes.items() if "/".join(k.split("/")[:2]) in groups)
        disk_bytes = sum(sizes.values())
    num_tokens = int(lengths.sum())
    logical = num_tokens * m.bytes_per_token()
    manifest = m.to_dict()
    manifest["hidden_size"] = m.target.hidden_size
    state = _state(r)
    keys = r.prompt_keys()
    return {
        "path": r.url or str(r.root),
        "format_version": m.format_version,
        "finalized": bool(state.get("finalized")),
        "num_samples": int(len(r)),
        "num_tokens": num_tokens,
        "num_prompts": None if keys is None else int(len(np.unique(keys))),
        "bytes_per_token": (data_bytes / num_tokens) if num_tokens else 0.0,
        "logical_bytes_per_token": m.bytes_per_token(),
        "disk_bytes": disk_bytes,
        "compression_ratio": (logical / data_bytes) if data_bytes else 1.0,
        "buckets": out_buckets,
        "shards": {"complete": complete, "incomplete": incomplete},
        "quant_relative_rms_error": state.get("quant_relative_rms_error"),
        "manifest": manifest,
    }


def _state(r: StoreReader) -> dict[str, Any]:
    return read_root_attrs(r.root).get(STATE_KEY, {})


def verify_store(path: str | os.PathLike) -> dict[str, Any]:
    """Recompute every shard checksum and every file's (checksums.json); check offsets, lengths,
    finiteness and duplicate ids. A URL: the whole store is downloaded into its cache directory
    first (cache_format.remote) and that copy verified."""
    if is_url(path):
        path = pull(str(path), default_local(str(path)), data=True)
    bad_files = [{"file": f, "reason": why} for f, why in check_checksums(path)]
    try:
        r = StoreReader(path)
    except CacheFormatError as e:
        if not bad_files:
            raise
        return {"ok": False, "bad_files": bad_files, "num_samples": 0, "num_shards": 0,
                "duplicate_sample_ids": [], "bad_shards": [{"shard": "(index)", "reason": str(e)}]}
    idx = r.index
    bad: dict[str, str] = {}
    for gi, key in enumerate(idx.groups):
        try:
            arrays = r._group(key)
        except CacheFormatError as e:
            bad[key] = str(e)
            continue
        if r.finalized:
            bad_index = _check_index_arrays(r.root / key)
            if bad_index:
                bad[key] = bad_index
                continue
        sel = idx.group == gi
        starts, lens = idx.start[sel], idx.length[sel]
        end = int((starts + lens).max()) if len(starts) else 0
        if len(starts) and (np.any(np.diff(starts) != lens[:-1]) or starts[0] != 0):
            bad[key] = "sample offsets are not contiguous"
            continue
        for name, z in arrays.items():
            if z.shape[0] < end:
                bad[key] = f"{name} has {z.shape[0]} rows, samples need {end}"
        for shard in sorted(idx.shards.get(key, {})):
            why = check_shard(r, key, shard)
            if why:
                bad[f"{key} shard {shard}"] = why
    ids, counts = np.unique(idx.sample_ids, return_counts=True)
    dups = ids[counts > 1].tolist()
    return {
        "ok": not bad and not dups and not bad_files,
        "finalized": bool(r.finalized),
        "bad_files": bad_files,
        "num_samples": int(len(idx)),
        "num_shards": sum(len(g) for g in idx.shards.values()),
        "duplicate_sample_ids": dups,
        "bad_shards": [{"shard": k, "reason": v} for k, v in bad.items()],
    }


def _check_index_arrays(group_dir: Path) -> str | None:
    """The finalized offsets/sample_ids of a group against the checksums finalize recorded."""
    import zarr

    try:
        g = zarr.open_group(str(group_dir), mode="r", use_consolidated=False)
        for name, crc in g.attrs["index_crc32c"].items():
            if checksum(np.asarray(g[name][:])) != crc:
                return f"{name} checksum mismatch"
    except Exception as e:  # noqa: BLE001
        return f"index unreadable ({type(e).__name__}: {e})"
    return None


def sample_norms(hidden: torch.Tensor, num_layers: int) -> list[float]:
    """Mean L2 norm per tapped layer of a sample's hidden [L, K*H]."""
    t = hidden.float().reshape(hidden.shape[0], num_layers, -1)
    return t.norm(dim=-1).mean(dim=0).tolist()
