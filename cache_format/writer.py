"""Creating a store, and the per-process writer that commits whole shards.

Commit protocol (one writer process per GPU rank, each with its own writer id):
1. A writer owns its arrays `w{id}/b{bucket}/*` outright; no other process ever writes them, so
   zarr's lost-update race on shared shards (each write rewrites the whole shard) cannot happen.
2. Rows are buffered per bucket until a shard (`rows_per_shard` tokens) is full; the shard is
   then written whole (zarr's LocalStore writes via temp file + rename, so never torn).
3. Only after the write returns is one line appended to the writer's done-log and fsync'd: the
   samples that ended in that shard, and a crc32c of every array's shard rows. A sample that is
   not in a done-log does not exist for readers.
   A full shard is written and committed by the writer's one I/O thread while `add` fills the
   next buffer (the write into tmpfs is most of a shard's cost:
   docs/benchmarks/2026-11-29_store_h200.md); at most one shard is in flight, and commits stay in
   order. An I/O error surfaces when the next
   shard is handed over, or at `flush`/`close`. No GPU work runs on that thread.
4. `flush()` (and `close()`) also write the incomplete tail shard; a later write rewrites it whole
   with more rows, and its newer log entry supersedes the old checksum.
5. On reopen, the writer drops everything past its last commit: `*.partial` files, rows beyond
   the committed end (arrays are shrunk back), and a torn last log line.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import zarr

from cache_format.checksums import record_checksums
from cache_format.codec import (
    QUANTIZED,
    QuantRows,
    bf16_to_bits,
    checksum,
    compressors_for,
    file_checksum,
    scale_layout,
)
from cache_format.errors import CacheFormatError, ManifestMismatchError
from cache_format.layout import (
    FROZEN_FILE,
    MANIFEST_KEY,
    PROMPTS_FILE,
    STATE_KEY,
    TokenArray,
    atomic_write_bytes,
    commit_log_path,
    group_key,
    read_manifest,
    shard_file,
    token_arrays,
    update_root_attrs,
    write_raw_shard,
)
from cache_format.logs import committed_rows, read_commit_log
from cache_format.schema import Manifest, bucket_of, manifest_differences

__all__ = ["ShardWriter", "create_store", "write_frozen", "write_prompt_keys"]


def create_store(path: str | os.PathLike, manifest: Manifest, *, overwrite: bool = False) -> None:
    """Create a store (rank 0, before any writer opens), or check an existing one for resume.

    An existing store written with other settings is refused with each difference listed, unless
    `overwrite`, which deletes it first.
    """
    root = Path(path)
    if (root / "zarr.json").exists():
        if overwrite:
            shutil.rmtree(root)
        else:
            old = read_manifest(root)
            diffs = manifest_differences(old, manifest)
            if diffs:
                raise ManifestMismatchError(str(root), diffs)
            # Resuming: the store is being written again, so it is no longer final.
            update_root_attrs(root, **{STATE_KEY: {"finalized": False}})
            record_checksums(root, old, finalized=False)
            return
    elif root.exists() and any(root.iterdir()):
        raise CacheFormatError(f"{root}: exists and is not a draftcache store; choose another path")
    root.mkdir(parents=True, exist_ok=True)
    with _os_errors(root):
        zarr.open_group(str(root), mode="w", attributes={
            MANIFEST_KEY: manifest.to_dict(), STATE_KEY: {"finalized": False}})
        (root / "commits").mkdir(exist_ok=True)
        record_checksums(root, manifest, finalized=False)


def write_frozen(path: str | os.PathLike, tensors: dict[str, torch.Tensor]) -> None:
    """Save the target's frozen parts (embedding, lm_head, final norm) into the store,
    atomically."""
    from safetensors.torch import save

    data = save({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()})
    with _os_errors(Path(path)):
        atomic_write_bytes(Path(path) / FROZEN_FILE, data)


def write_prompt_keys(path: str | os.PathLike, sample_ids: np.ndarray, keys: np.ndarray) -> None:
    """Save each sample's prompt key (equal keys = responses to one prompt), atomically.

    Optional in a store: with it a held-out split takes whole prompts, so no response to a held-out
    prompt is trained on (regenerated data has several responses per prompt, and a greedy and a
    sampled response to one prompt share much of their text).
    """
    from safetensors.numpy import save

    ids, k = np.asarray(sample_ids, np.int64), np.asarray(keys, np.int64)
    if ids.shape != k.shape or ids.ndim != 1:
        raise ValueError(f"sample_ids {ids.shape} and keys {k.shape} must be 1-D and of one length")
    with _os_errors(Path(path)):
        atomic_write_bytes(Path(path) / PROMPTS_FILE, save({"sample_ids": ids, "prompt_keys": k}))


@contextmanager
def _os_errors(where: Path) -> Iterator[None]:
    """Turn OS failures (disk full, permissions) into one-line errors naming the store."""
    try:
        yield
    except OSError as e:
        full = e.errno == errno.ENOSPC
        hint = "; free space and rerun the same command to resume" if full else ""
        raise CacheFormatError(f"{where}: {e.strerror or e} while writing{hint}") from None


@dataclass
class _Bucket:
    """One bucket's shard buffer: rows [base, base + fill) of the arrays, not yet all written."""

    base: int
    fill: int
    buf: dict[str, np.ndarray]
    # (sample id, length, end row)
    pending: list[tuple[int, int, int]] = field(default_factory=list)


class ShardWriter:
    """Writes samples of one writer id into whole shards and commits them to its done-log."""

    def __init__(self, path: str | os.PathLike, *, writer_id: int) -> None:
        self.root = Path(path)
        self.writer_id = writer_id
        self.manifest = read_manifest(self.root)
        self._arrays = token_arrays(self.manifest)
        self._rows = self.manifest.rows_per_shard
        self._log_path = commit_log_path(self.root, writer_id)
        self._buckets: dict[int, _Bucket] = {}
        self._zarr: dict[int, dict[str, zarr.Array]] = {}
        self.quant_err = [0.0, 0.0]  # sum of squared error, sum of squares (quantized dtypes only)
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"draftcache-w{writer_id}")
        # the shard the I/O thread is writing; its result is its buffer
        self._in_flight: Future | None = None
        self._spare: list[dict[str, np.ndarray]] = []  # shard buffers whose write has finished
        with _os_errors(self.root):
            self.committed: set[int] = self._recover()

    # ---------------------------------------------------------------- recovery
    def _recover(self) -> set[int]:
        for p in (self.root / f"w{self.writer_id:05d}").rglob("*.partial"):
            p.unlink(missing_ok=True)
        log, _ = read_commit_log(self._log_path, repair=True)
        committed = {int(sid) for entry in log for sid, _ in entry["samples"]}
        for b, rows in committed_rows(log).items():
            arrays = self._open(b)
            base = rows - rows % self._rows
            bucket = self._new_bucket(base)
            # the done-log entry that committed these rows of the shard: what they must read back as
            n = base // self._rows
            entry = next((e for e in reversed(log) if e["bucket"] == b and e["shard"] == n), None)
            for a in self._arrays:
                z = arrays[a.name]
                # the entry's rows may run past the committed end (a sample continuing in the next
                # shard); z.shape checks they were not cut by an earlier resume
                if (entry is not None and rows > base and z.shape[0] >= base + entry["rows"]
                        and checksum(z[base:base + entry["rows"]]) != entry["crc32c"][a.name]):
                    raise CacheFormatError(f"{self.root}: writer {self.writer_id} bucket {b} shard "
                                           f"{base // self._rows}: the committed rows of {a.name} "
                                           "do not read back as committed (a stale or damaged tail "
                                           "shard); the store cannot be resumed as it is")
                z.resize((rows, *z.shape[1:]))  # forget uncommitted rows
                bucket.buf[a.name][: rows - base] = z[base:rows]
            bucket.fill = rows - base
            self._buckets[b] = bucket
        return committed

    def _new_bucket(self, base: int) -> _Bucket:
        return _Bucket(base=base, fill=0, buf=self._new_buffer())

    def _new_buffer(self) -> dict[str, np.ndarray]:
        if self._spare:
            return self._spare.pop()
        return {a.name: np.empty((self._rows, a.width) if a.width else (self._rows,), dtype=a.dtype)
                for a in self._arrays}

    def _open(self, bucket: int) -> dict[str, zarr.Array]:
        """This writer's arrays for `bucket`, created empty on first use."""
        if bucket in self._zarr:
            return self._zarr[bucket]
        key = group_key(self.writer_id, bucket)
        m = self.manifest
        out = {}
        if (self.root / key / "zarr.json").exists():
            g = zarr.open_group(str(self.root / key), mode="r+", use_consolidated=False)
            out = {a.name: g[a.name] for a in self._arrays}
        else:
            g = zarr.open_group(str(self.root / key), mode="a", use_consolidated=False)
            for a in self._arrays:
                if a.width:
                    shape, chunks = (0, a.width), (m.rows_per_chunk, a.width)
                    shards = (self._rows, a.width)
                else:  # 1-D arrays are small: one chunk per shard, no inner chunking
                    shape, chunks, shards = (0,), (self._rows,), None
                out[a.name] = g.create_array(
                    a.name, shape=shape, dtype=a.dtype, chunks=chunks, shards=shards, fill_value=0,
                    compressors=(compressors_for(m.compression, np.dtype(a.dtype).itemsize)
                                 if a.width else None),
                    attributes={"logical_dtype": _logical_dtype(a, m)},
                    # an all-zero chunk (a loss mask, padding) must still exist on disk: its
                    # absence would be indistinguishable from a lost file
                    config={"write_empty_chunks": True},
                )
        self._zarr[bucket] = out
        return out

    # ---------------------------------------------------------------- writing
    def add(self, sample_id: int, *, input_ids: torch.Tensor, loss_mask: torch.Tensor,
            hidden: torch.Tensor | QuantRows, last_hidden: torch.Tensor | None = None) -> None:
        """Buffer one sample; shards that fill up are written and committed.

        input_ids [L] ints, loss_mask [L] 0/1, hidden [L, K*H] float (or, for an fp8 or mxfp4 store,
        rows already quantized by the caller), last_hidden [L, H] float.
        """
        m = self.manifest
        n = int(input_ids.shape[0])
        if isinstance(hidden, QuantRows):
            if m.dtype == "bfloat16":
                raise CacheFormatError(f"sample {sample_id}: quantized rows given to a {m.dtype} "
                                       "store")
            width, scales, _ = scale_layout(m.dtype, len(m.layer_ids), m.target.hidden_size)
            if hidden.bits.shape != (n, width) or hidden.scales.shape != (n, scales):
                raise CacheFormatError(f"sample {sample_id}: {m.dtype} rows "
                                       f"{tuple(hidden.bits.shape)} / scales "
                                       f"{tuple(hidden.scales.shape)} do not fit {n} tokens x "
                                       f"{m.row_width} values")
        elif hidden.shape != (n, m.row_width):
            raise CacheFormatError(f"sample {sample_id}: hidden has shape {tuple(hidden.shape)}, "
                                   f"expected {(n, m.row_width)}")
        if m.last_hidden != (last_hidden is not None):
            raise CacheFormatError(f"sample {sample_id}: last_hidden is "
                                   f"{'required' if m.last_hidden else 'not stored'}")
        if sample_id in self.committed:
            raise CacheFormatError(f"sample {sample_id}: already committed by writer "
                                   f"{self.writer_id}")
        rows = {"input_ids": input_ids.to(torch.int32).cpu().numpy(),
                "loss_mask": loss_mask.to(torch.uint8).cpu().numpy()}
        if m.dtype == "bfloat16":
            rows["hidden"] = bf16_to_bits(hidden.cpu())
        else:
            q = hidden if isinstance(hidden, QuantRows) else QuantRows.of(hidden.cpu(),
                                                                          len(m.layer_ids), m.dtype)
            rows["hidden"], rows["hidden_scale"] = q.bits.cpu().numpy(), q.scales.cpu().numpy()
            self.quant_err[0] += q.sq_err
            self.quant_err[1] += q.sq_ref
        if last_hidden is not None:
            rows["last_hidden"] = bf16_to_bits(last_hidden.cpu())
        b = bucket_of(n, m.bucket_bounds)
        bucket = self._buckets.get(b) or self._buckets.setdefault(b, self._new_bucket(0))
        bucket.pending.append((sample_id, n, bucket.base + bucket.fill + n))
        done = 0
        while done < n:
            take = min(n - done, self._rows - bucket.fill)
            for name, src in rows.items():
                bucket.buf[name][bucket.fill: bucket.fill + take] = src[done: done + take]
            bucket.fill += take
            done += take
            if bucket.fill == self._rows:
                self._submit(b, bucket)
                bucket.base += self._rows
                bucket.fill = 0

    def _submit(self, b: int, bucket: _Bucket) -> None:
        """Commit bucket `b`'s rows [base, base+fill): a full shard on the I/O thread (the bucket
        gets a fresh buffer), a tail shard here and now (its buffer keeps filling afterwards)."""
        end = bucket.base + bucket.fill
        done = [(sid, n) for sid, n, e in bucket.pending if e <= end]
        bucket.pending = [p for p in bucket.pending if p[2] > end]
        quant_err, self.quant_err = self.quant_err, [0.0, 0.0]
        self._wait()  # at most one shard in flight, so commits land in order
        job = (b, bucket.base, bucket.fill, bucket.buf, done, quant_err)
        if bucket.fill == self._rows:
            bucket.buf = self._new_buffer()
            self._in_flight = self._io.submit(self._write, *job)
        else:
            self._write(*job)

    def _wait(self) -> None:
        """Wait for the shard in flight; its buffer becomes a spare, its error is raised here."""
        f, self._in_flight = self._in_flight, None
        if f is not None:
            self._spare.append(f.result())

    def _write(self, b: int, base: int, fill: int, buf: dict[str, np.ndarray],
               done: list[tuple[int, int]], quant_err: list[float]) -> dict[str, np.ndarray]:
        """Write rows [base, base+fill) of bucket `b` as one whole shard, then commit `done`;
        returns `buf`."""
        end = base + fill
        with _os_errors(self.root), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            arrays = self._open(b)
            crc = {}
            raw = fill == self._rows and self.manifest.compression == "none"
            group, shard = group_key(self.writer_id, b), base // self._rows
            for a in self._arrays:
                z, data = arrays[a.name], buf[a.name][:fill]
                if z.shape[0] != end:
                    z.resize((end, *z.shape[1:]))
                if raw:  # a whole uncompressed shard: its zarr v3 bytes are the rows + an index
                    write_raw_shard(shard_file(self.root, group, a, shard), data,
                                    self.manifest.rows_per_chunk if a.width else 0)
                else:
                    z[base:end] = data
                crc[a.name] = checksum(data)
            entry = {"bucket": b, "shard": shard, "rows": fill, "crc32c": crc, "samples": done}
            if fill < self._rows:
                # A tail shard's edge chunk is padded past the array's end; the padding is not
                # covered by the row checksums, so checksum the stored files too (small, rare).
                files = {a.name: shard_file(self.root, group, a, shard) for a in self._arrays}
                entry["file_crc32c"] = {name: file_checksum(p) for name, p in files.items()}
            if self.manifest.dtype in QUANTIZED:  # error added since the previous entry
                entry["quant_sq_err"], entry["quant_sq_ref"] = quant_err
            self._append_log(entry)
        self.committed.update(sid for sid, _ in done)
        return buf

    def _append_log(self, entry: dict) -> None:
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self._log_path, "a") as f:
            f.write(json.dumps(entry, separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def flush(self) -> None:
        """Write and commit every bucket's incomplete tail shard (readers can then see it)."""
        for b, bucket in sorted(self._buckets.items()):
            if bucket.pending:
                self._submit(b, bucket)
        self._wait()

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._io.shutdown(wait=True)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # failing: the full shard in flight is still committed (it is whole); tails are not
            self._wait()
        except Exception:  # noqa: BLE001 - the error already being raised is the one to report
            pass
        finally:
            self._io.shutdown(wait=True)


def _logical_dtype(a: TokenArray, m: Manifest) -> str:
    if a.name == "hidden":
        return m.dtype
    return "bfloat16" if a.name == "last_hidden" else a.dtype
