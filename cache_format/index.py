"""The sample index (sample id -> group, rows, bucket) and finalize, which freezes it into the
store.

Before finalize the index is rebuilt from the done-logs (so stage two can follow a running stage
one); after finalize from the small `offsets`/`sample_ids` arrays, one read per (writer, bucket)
group. Neither path touches `hidden`.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from cache_format.checksums import record_checksums
from cache_format.codec import QUANTIZED, checksum
from cache_format.errors import CacheFormatError
from cache_format.layout import STATE_KEY, group_key, read_root_attrs, update_root_attrs
from cache_format.logs import read_commit_log
from cache_format.schema import Manifest

__all__ = ["SampleIndex", "finalize_store", "load_index"]


@dataclass
class SampleIndex:
    """Flat arrays, one entry per committed sample, plus the latest entry of every shard."""

    groups: list[str] = field(default_factory=list)  # "w00001/b02"
    sample_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    group: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    start: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    length: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    shards: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)
    quant_sq: list[float] = field(default_factory=lambda: [0.0, 0.0])
    _order: np.ndarray | None = None
    _bucket: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.sample_ids)

    def bucket(self) -> np.ndarray:
        """Bucket of every sample, parsed from its group key."""
        if self._bucket is not None and len(self._bucket) == len(self.group):
            return self._bucket
        per_group = np.array([int(g.split("/b")[1]) for g in self.groups] or [0], np.int64)
        self._bucket = per_group[self.group] if len(self.group) else np.zeros(0, np.int64)
        return self._bucket

    def locate(self, sample_id: int) -> int:
        """Row of `sample_id` in these arrays; KeyError if it is not committed."""
        if self._order is None:
            self._order = np.argsort(self.sample_ids, kind="stable")
        pos = np.searchsorted(self.sample_ids, sample_id, sorter=self._order)
        if pos < len(self._order) and self.sample_ids[self._order[pos]] == sample_id:
            return int(self._order[pos])
        raise KeyError(f"sample {sample_id} is not in the store")

    def extend(self, groups: list[str], sid: list[int], grp: list[int], start: list[int],
               length: list[int]) -> None:
        self.groups = groups
        self.sample_ids = np.concatenate([self.sample_ids, np.asarray(sid, np.int64)])
        self.group = np.concatenate([self.group, np.asarray(grp, np.int32)])
        self.start = np.concatenate([self.start, np.asarray(start, np.int64)])
        self.length = np.concatenate([self.length, np.asarray(length, np.int64)])
        self._order = self._bucket = None


class LogFollower:
    """Builds and extends a SampleIndex from the done-logs, reading each log only once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.index = SampleIndex()
        self._log_pos: dict[int, int] = {}
        self._cursor: dict[str, int] = {}  # rows consumed per group

    def poll(self) -> int:
        """Read newly committed log lines; returns how many samples were added."""
        logs = sorted((self.root / "commits").glob("w*.jsonl"))
        groups = list(self.index.groups)
        gid = {g: i for i, g in enumerate(groups)}
        sid, grp, start, length = [], [], [], []
        for log in logs:
            writer = int(log.stem[1:])
            pos = self._log_pos.get(writer, 0)
            entries, self._log_pos[writer] = read_commit_log(log, start=pos)
            for e in entries:
                key = group_key(writer, e["bucket"])
                if key not in gid:
                    gid[key] = len(groups)
                    groups.append(key)
                self.index.shards.setdefault(key, {})[e["shard"]] = e
                self.index.quant_sq[0] += e.get("quant_sq_err", 0.0)
                self.index.quant_sq[1] += e.get("quant_sq_ref", 0.0)
                for s, n in e["samples"]:
                    row = self._cursor.get(key, 0)
                    sid.append(s), grp.append(gid[key]), start.append(row), length.append(n)
                    self._cursor[key] = row + n
        self.index.extend(groups, sid, grp, start, length)
        return len(sid)


def _open_finalized(root: Path, state: dict[str, Any]) -> SampleIndex:
    index = SampleIndex()
    sid, grp, start, length = [], [], [], []
    for i, key in enumerate(state["groups"]):
        g = zarr.open_group(str(root / key), mode="r", use_consolidated=False)
        offsets = np.asarray(g["offsets"][:])
        sid.append(np.asarray(g["sample_ids"][:]))
        grp.append(np.full(len(offsets) - 1, i, np.int32))
        start.append(offsets[:-1])
        length.append(np.diff(offsets))
        index.shards[key] = {int(s["shard"]): s for s in g.attrs["shards"]}
    index.extend(list(state["groups"]),
                 *(np.concatenate(x) if x else [] for x in (sid, grp, start, length)))
    index.quant_sq = list(state.get("quant_sq", [0.0, 0.0]))
    return index


def load_index(root: str | os.PathLike) -> tuple[SampleIndex, LogFollower | None]:
    """The index of a store: from the finalized arrays, or (while writing) from the done-logs."""
    root = Path(root)
    state = read_root_attrs(root).get(STATE_KEY, {})
    if state.get("finalized"):
        return _open_finalized(root, state), None
    follower = LogFollower(root)
    follower.poll()
    return follower.index, follower


def finalize_store(path: str | os.PathLike, manifest: Manifest) -> dict[str, Any]:
    """Rank 0, after every writer closed: freeze the index into the store and mark it final.

    Writes each group's `offsets`/`sample_ids` arrays and shard checksums, then the root state,
    then consolidated metadata last (a consolidated zarr.json is only ever written for a store
    that no writer will touch again).
    """
    root = Path(path)
    follower = LogFollower(root)
    follower.poll()
    index = follower.index
    for gi, key in enumerate(index.groups):
        sel = index.group == gi
        offsets = np.concatenate([[0], np.cumsum(index.length[sel])]).astype(np.int64)
        g = zarr.open_group(str(root / key), mode="r+", use_consolidated=False)
        crc = {}
        for name, data in (("offsets", offsets), ("sample_ids", index.sample_ids[sel])):
            a = g.create_array(name, shape=data.shape, dtype="int64", chunks=(max(len(data), 1),),
                               compressors=None, overwrite=True, fill_value=0)
            a[:] = data
            crc[name] = checksum(data)
        g.attrs["index_crc32c"] = crc
        shards = index.shards[key]
        g.attrs["shards"] = [shards[s] | {"samples": len(shards[s]["samples"])}
                             for s in sorted(shards)]
    ids, counts = np.unique(index.sample_ids, return_counts=True)
    buckets = index.bucket()
    state = {
        "finalized": True,
        "groups": index.groups,
        "num_samples": int(len(index)),
        "num_tokens": int(index.length.sum()),
        "duplicate_sample_ids": ids[counts > 1].tolist()[:100],
        "bucket_samples": [int((buckets == b).sum()) for b in range(manifest.num_buckets)],
        "quant_sq": index.quant_sq,
    }
    if manifest.dtype in QUANTIZED and index.quant_sq[1] > 0:
        state["quant_relative_rms_error"] = float(np.sqrt(index.quant_sq[0] / index.quant_sq[1]))
    update_root_attrs(root, **{STATE_KEY: state})
    with warnings.catch_warnings():
        # commits/ and frozen.safetensors are ours, not zarr nodes; zarr warns about them.
        warnings.simplefilter("ignore")
        try:
            zarr.consolidate_metadata(str(root))
        except Exception as e:  # noqa: BLE001 - consolidation is an optimisation only
            raise CacheFormatError(f"{root}: could not consolidate metadata ({e})") from None
    record_checksums(root, manifest, finalized=True)  # last: covers every file written above
    return state
