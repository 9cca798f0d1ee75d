"""Reading samples from a store: by id, or a whole batch with all reads in flight at once.

The reader is safe to create in a parent process and use in forked DataLoader workers: zarr
handles are opened lazily, per process (a handle opened before a fork is never reused after it;
third-party codec pipelines deadlock in forked children otherwise, zarrs-python#171).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import zarr
from zarr.core.sync import sync

from cache_format.codec import bits_to_bf16, quantized_to_bf16
from cache_format.errors import CacheFormatError, brief
from cache_format.index import load_index
from cache_format.layout import (
    FROZEN_FILE,
    KEPT_LAYER_PREFIX,
    PROMPTS_FILE,
    STATE_KEY,
    read_manifest,
    read_root_attrs,
    shard_keys,
    token_arrays,
)
from cache_format.rawread import RawShardReader
from cache_format.remote import fetch, is_url, local_copy, pull
from cache_format.schema import Manifest
from cache_format.shard_check import check_shard

__all__ = ["Sample", "StoreReader"]


def _verify_hint(root) -> str:
    """What an error about damaged files tells the user to run."""
    return f"python -m cache_format verify {root} names the damaged files"


@dataclass
class Sample:
    """One stored sample. hidden [L, K*H] bf16, or the stored uint8 bits of an fp8 or mxfp4 store
    when read with quant_bits; last_hidden [L, H] bf16 or None."""

    sample_id: int
    input_ids: torch.Tensor  # [L] int64
    loss_mask: torch.Tensor  # [L] uint8
    hidden: torch.Tensor
    last_hidden: torch.Tensor | None
    bucket: int
    # [L, K] float32 (fp8), [L, K*H/32] uint8 (mxfp4): with bits only
    hidden_scale: torch.Tensor | None = None


class StoreReader:
    """Random access to the committed samples of a store."""

    def __init__(self, path: str | os.PathLike, *, verify_shards: bool = False, remote: str = "",
                 cache: str | os.PathLike = "", verified_dir: str | os.PathLike = "") -> None:
        """path: a store directory, or a URL (cache_format.remote: the metadata is copied into its
        cache directory now, each shard on first use). remote: the URL whose local copy `path`
        already is (DataLoader workers of a reader opened by URL). cache: the directory local copies
        of URLs go under (default: cache_format.remote.cache_root()). verify_shards: check each data
        shard's checksums the first time this process reads from it (a mismatch is a one-line
        CacheFormatError naming shard and array); always on for a remote store. verified_dir: a
        directory the reader processes of one run share: each shard checked leaves a marker there
        (named by its commit's checksums), so a shard is checked once per run, not once per process
        (DataLoader workers are new processes every epoch)."""
        self.url = str(path) if is_url(path) else remote
        self.root = local_copy(self.url, cache) if is_url(path) else Path(path)
        self.verify_shards, self._verified = verify_shards or bool(self.url), set()
        self.verified_dir = Path(verified_dir) if verified_dir else None
        self.manifest: Manifest = read_manifest(self.root)
        try:
            self.index, self._follower = load_index(self.root)
        except CacheFormatError:
            raise
        except Exception as e:  # damaged zarr metadata fails inside zarr in many ways
            raise CacheFormatError(f"{self.root}: the index cannot be read ({brief(e)}); "
                                   f"python -m cache_format verify {self.root} names the damaged "
                                   "files") from None
        self._tokens = token_arrays(self.manifest)
        self._arrays = [a.name for a in self._tokens]
        self._handles: dict[str, dict[str, zarr.Array]] = {}
        self._pid = os.getpid()
        m = self.manifest
        # Uncompressed stores are read with direct preads; compressed ones through zarr's codecs.
        self._raw = RawShardReader(self.root, m.rows_per_shard,
                                   m.rows_per_chunk) if m.compression == "none" else None

    # ---------------------------------------------------------------- state
    @property
    def finalized(self) -> bool:
        return bool(read_root_attrs(self.root).get(STATE_KEY, {}).get("finalized"))

    def refresh(self) -> int:
        """Pick up shards committed since opening; returns the number of new samples."""
        if self._follower is None:
            return 0
        # the writer's newer done-logs (each log after its shards: never ahead of them)
        if self.url:
            pull(self.url, self.root, data=False)
        added = self._follower.poll()
        self.index = self._follower.index
        self._handles.clear()  # array shapes grew; reopen lazily
        if self._raw is not None:
            self._raw.forget()  # tail shards may have been rewritten
        return added

    def __len__(self) -> int:
        return len(self.index)

    @property
    def sample_ids(self) -> np.ndarray:
        return self.index.sample_ids

    def lengths(self) -> np.ndarray:
        return self.index.length

    def buckets(self) -> np.ndarray:
        return self.index.bucket()

    def home_shards(self) -> np.ndarray:
        """int64 [len(self)]: the shard each sample starts in (group index x 2^32 + shard), in the
        order of `sample_ids`: what training splits among nodes (a sample that runs into the next
        shard also reads that one)."""
        shard = self.index.start // self.manifest.rows_per_shard
        return self.index.group.astype(np.int64) * 2**32 + shard

    def prompt_keys(self) -> np.ndarray | None:
        """int64 [len(self)]: the prompt key of each sample (order of `sample_ids`), or None when
        the store has no prompts file. A sample missing from the file gets a key of its own."""
        path = self.root / PROMPTS_FILE
        if not path.exists():
            return None
        from safetensors.numpy import load_file

        try:
            f = load_file(str(path))
            ids, keys = f["sample_ids"], f["prompt_keys"]
        except Exception as e:  # a torn or foreign file: say which, not where safetensors failed
            raise CacheFormatError(f"{path}: unreadable prompts file ({e})") from None
        mine = self.sample_ids
        # a key of its own for an unlisted sample: negative, apart from the file's (>= 0)
        own = -1 - mine
        if len(ids) == 0:
            return own
        order = np.argsort(ids, kind="stable")
        pos = np.searchsorted(ids[order], mine).clip(max=len(ids) - 1)
        return np.where(ids[order[pos]] == mine, keys[order[pos]], own)

    def frozen(self) -> dict[str, torch.Tensor]:
        """The target's frozen embedding, lm_head and final norm saved in the store."""
        return self._frozen(lambda name: not name.startswith(KEPT_LAYER_PREFIX), tied=True)

    def kept_layers(self) -> dict[str, torch.Tensor]:
        """The decoder layers extraction kept (extract --keep-layers) as layers.{id}.*, and the
        final norm.weight: what train --init-layers starts a drafter from. Read apart from frozen(),
        so a run reads each tensor of the file once and a run without --init-layers none of
        these."""
        kept = lambda name: name.startswith(KEPT_LAYER_PREFIX) or name == "norm.weight"
        return self._frozen(kept, tied=False)

    def _frozen(self, wanted, *, tied: bool) -> dict[str, torch.Tensor]:
        """The tensors of the frozen file whose names `wanted` takes (only those are read); with
        `tied`, lm_head.weight is the embedding where the file stores them once."""
        from safetensors import safe_open

        path = self.root / FROZEN_FILE
        if not path.exists():
            raise CacheFormatError(f"{self.root}: store has no {FROZEN_FILE} (embedding, lm_head, "
                                   "norm)")
        try:
            with safe_open(str(path), framework="pt") as f:
                parts = {name: f.get_tensor(name) for name in f.keys() if wanted(name)}
            if tied:
                parts.setdefault("lm_head.weight", parts["embed_tokens.weight"])  # tied embeddings
        except Exception as e:  # safetensors raises its own error types on a damaged file
            raise CacheFormatError(f"{path}: damaged ({brief(e)}); "
                                   "extract the store again") from None
        return parts

    # ---------------------------------------------------------------- reads
    def _group(self, key: str) -> dict[str, zarr.Array]:
        if self._pid != os.getpid():  # forked: never reuse the parent's handles
            self._handles.clear()
            self._pid = os.getpid()
        if key not in self._handles:
            try:
                g = zarr.open_group(str(self.root / key), mode="r", use_consolidated=False)
                self._handles[key] = {name: g[name] for name in self._arrays}
            except Exception as e:  # damaged zarr metadata fails inside zarr in many ways
                raise CacheFormatError(f"{self.root / key}: cannot be opened ({brief(e)}); "
                                       f"python -m cache_format verify {self.root} names the "
                                       "damaged files") from None
        return self._handles[key]

    def group_tokens(self, key: str) -> dict[str, np.ndarray]:
        """input_ids [N] and loss_mask [N] of a whole length group (index rows point into them by
        start and length): the token arrays only, for passes over the data that need no states."""
        # a remote store's token arrays are fetched first (zarr reads a missing chunk as zeros)
        if self.url:
            rows = np.flatnonzero(self.index.group == self.index.groups.index(key)).tolist()
            ids = [a for a in self._tokens if a.name in ("input_ids", "loss_mask")]
            fetch(self.url, self.root,
                  [k for g, shard in self._shards(rows) for k in shard_keys(ids, g, shard)])
        arrays = self._group(key)
        try:
            return {name: arrays[name][...] for name in ("input_ids", "loss_mask")}
        except Exception as e:  # noqa: BLE001 - a damaged chunk fails inside zarr's codecs
            raise CacheFormatError(f"{self.root / key}: token arrays cannot be read ({brief(e)}); "
                                   f"python -m cache_format verify {self.root} names the damaged "
                                   "files") from None

    def get(self, sample_id: int) -> Sample:
        return self.get_batch([sample_id])[0]

    def get_batch(self, sample_ids: list[int] | np.ndarray, *,
                  quant_bits: bool = False) -> list[Sample]:
        """Read several samples; every array read of the batch is issued concurrently.

        quant_bits leaves an fp8 or mxfp4 store's hidden states quantized (uint8 bits and
        hidden_scale), for a caller that dequantizes on its GPU: on a CPU, fp8 -> float32 is most of
        a training worker's time.
        """
        rows = [self.index.locate(int(s)) for s in sample_ids]
        if self.url:
            fetch(self.url, self.root, [k for g, shard in self._shards(rows)
                   for k in shard_keys(self._tokens, g, shard)])
        if self.verify_shards:
            self._verify_rows(rows)
        if self._raw is not None:
            return [self._read_raw(r, quant_bits) for r in rows]
        jobs = []
        for r in rows:
            key = self.index.groups[self.index.group[r]]
            sel = slice(int(self.index.start[r]), int(self.index.start[r] + self.index.length[r]))
            arrays = self._group(key)
            jobs.extend(arrays[name]._async_array.getitem(sel) for name in self._arrays)

        async def gather() -> list[np.ndarray]:
            return await asyncio.gather(*jobs)

        flat = sync(gather())
        out, k, buckets = [], len(self._arrays), self.index.bucket()
        for i, r in enumerate(rows):
            got = dict(zip(self._arrays, flat[i * k:(i + 1) * k]))
            out.append(self._decode(int(self.index.sample_ids[r]), got, int(buckets[r]),
                                    quant_bits))
        return out

    def prefetch(self, sample_ids, *, parallel: int = 8) -> int:
        """A store read by URL: download, `parallel` at once, the shards of these samples that the
        local copy lacks (training calls it for each epoch's samples of its rank, before its
        DataLoader workers start). Returns how many files came; 0 for a local store."""
        if not self.url:
            return 0
        rows = [self.index.locate(int(s)) for s in sample_ids]
        return fetch(self.url, self.root, [k for g, shard in self._shards(rows)
                      for k in shard_keys(self._tokens, g, shard)],
                     parallel=parallel)

    def verify_samples(self, sample_ids) -> None:
        """Check now every shard the samples lie in against its commit log (fetching those a store
        read by URL lacks): CacheFormatError naming the first damaged shard. A small store (a
        validation store) is checked whole this way before training starts, not at its first
        read."""
        self.prefetch(sample_ids)
        self._verify_rows([self.index.locate(int(s)) for s in sample_ids])

    def _shards(self, rows: list[int]) -> list[tuple[str, int]]:
        """(group key, shard) of every shard the index rows `rows` lie in, in order, each once."""
        rs, out = self.manifest.rows_per_shard, {}
        for r in rows:
            key = self.index.groups[self.index.group[r]]
            start, n = int(self.index.start[r]), int(self.index.length[r])
            for shard in range(start // rs, (start + n - 1) // rs + 1):
                out[(key, shard)] = None
        return list(out)

    def _marker(self, key: str, shard: int) -> Path | None:
        """The file that says this shard, as its latest commit describes it, was checked in this
        run."""
        if self.verified_dir is None:
            return None
        e = self.index.shards.get(key, {}).get(shard)
        if e is None:
            return None
        tag = hashlib.sha256(json.dumps([e["rows"], e["crc32c"], e.get("file_crc32c")],
                                        sort_keys=True).encode())
        return self.verified_dir / f"{key.replace('/', '-')}-{shard}-{tag.hexdigest()[:16]}"

    def _verify_rows(self, rows: list[int]) -> None:
        for key, shard in self._shards(rows):
            marker = self._marker(key, shard)
            if (key, shard) in self._verified or (marker is not None and marker.exists()):
                continue
            why = check_shard(self, key, shard, finite=False)
            for _ in range(3 if why and (not self.finalized or self.url) else 0):
                time.sleep(0.2)  # a tail shard swapped for its next flush mid-read: read it again
                if self._raw is not None:
                    self._raw.forget()  # the cached shard index may be the previous file's
                # the local copy holds an older tail shard than the commit names: fetch again
                if self.url:
                    keys = shard_keys(self._tokens, key, shard)
                    for k in keys:
                        (self.root / k).unlink(missing_ok=True)
                    fetch(self.url, self.root, keys)
                why = check_shard(self, key, shard, finite=False)
                if not why:
                    break
            if why:
                where = f"{self.url}/{key}" if self.url else str(self.root / key)
                raise CacheFormatError(f"{where} shard {shard}: {why}; the store is damaged "
                                       f"(python -m cache_format verify {self.url or self.root})")
            self._verified.add((key, shard))
            if marker is not None:
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.touch()

    def _read_raw(self, r: int, quant_bits: bool) -> Sample:
        key = self.index.groups[self.index.group[r]]
        start, n = int(self.index.start[r]), int(self.index.length[r])
        got = {}
        for a in self._tokens:
            out = np.empty((n, a.width) if a.width else (n,), dtype=a.dtype)
            self._raw.read(key, a, start, start + n, out)
            got[a.name] = out
        return self._decode(int(self.index.sample_ids[r]), got,
                            int(self.index.bucket()[r]), quant_bits)

    def _decode(self, sample_id: int, got: dict[str, np.ndarray], bucket: int,
                quant_bits: bool) -> Sample:
        scale = None
        if self.manifest.dtype == "bfloat16":
            hidden = bits_to_bf16(got["hidden"])
        elif quant_bits:
            hidden = torch.from_numpy(np.ascontiguousarray(got["hidden"]))
            scale = torch.from_numpy(np.ascontiguousarray(got["hidden_scale"]))
        else:
            hidden = quantized_to_bf16(got["hidden"], got["hidden_scale"])
        last = bits_to_bf16(got["last_hidden"]) if "last_hidden" in got else None
        return Sample(
            sample_id=sample_id,
            input_ids=torch.from_numpy(got["input_ids"].astype(np.int64)),
            loss_mask=torch.from_numpy(np.ascontiguousarray(got["loss_mask"])),
            hidden=hidden,
            last_hidden=last,
            bucket=bucket,
            hidden_scale=scale,
        )
