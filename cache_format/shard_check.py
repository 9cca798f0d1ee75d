"""Checking a stored shard against its commit-log checksums: what `verify` reports and what a
training reader runs on a shard's first read (StoreReader's verify_shards)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from cache_format.codec import checksum, file_checksum
from cache_format.errors import CacheFormatError, brief
from cache_format.layout import shard_file

if TYPE_CHECKING:  # the reader imports this module
    from cache_format.reader import StoreReader

__all__ = ["check_shard", "finite_rows"]


def check_shard(reader: StoreReader, key: str, shard: int, *, finite: bool = True) -> str | None:
    """Why shard `shard` of group `key` does not match its commit-log checksums (None: it does).

    The crc32c of every array's committed rows; for tail shards also of the stored files (the
    padding past the committed rows is in no row checksum); with `finite`, hidden states must be
    finite too. A training reader leaves that out: stage one commits finite rows only, so rows
    whose crc32c matches are finite, and the test costs as much again as the checksum.
    """
    m = reader.manifest
    entry = reader.index.shards.get(key, {}).get(shard)
    if entry is None:
        return "not in any commit log"
    lo = shard * m.rows_per_shard
    # While stage one still writes, a tail shard's file is rewritten at every flush with more rows:
    # the entry this reader holds may be older than the file, so only its committed rows are checked
    # (they are the same in every rewrite); `verify` checks the finalized file whole.
    growing = entry["rows"] < m.rows_per_shard and not reader.finalized
    try:
        for a in reader._tokens:
            want = entry.get("file_crc32c", {}).get(a.name)
            if want is None or growing:
                continue
            if file_checksum(shard_file(reader.root, key, a, shard)) != want:
                return f"{a.name} file checksum mismatch"
        for name, data in _committed_rows(reader, key, lo, entry["rows"]):
            if checksum(data) != entry["crc32c"][name]:
                return f"{name} checksum mismatch"
            if finite and name in ("hidden", "last_hidden",
                                   "hidden_scale") and not finite_rows(data, name, m.dtype):
                return f"{name} has NaN or Inf"
    except CacheFormatError:
        raise
    except Exception as e:  # noqa: BLE001 - a corrupt shard can fail to decode in many ways
        return f"unreadable ({brief(e)})"
    return None


def _committed_rows(reader: StoreReader, key: str, lo: int, rows: int):
    """(name, rows [lo, lo + rows)) of each token array of a group. An uncompressed store is read
    with the raw reader that training reads with: decoding a 34 MB shard through zarr took about
    0.2 s, and a worker's first epoch touches every shard (a 100K-sample store has 2,460)."""
    if reader._raw is None:
        for name, z in reader._group(key).items():
            yield name, np.asarray(z[lo: lo + rows])
        return
    for a in reader._tokens:
        out = np.empty((rows, a.width) if a.width else (rows,), dtype=a.dtype)
        try:
            reader._raw.read(key, a, lo, lo + rows, out)
        except CacheFormatError as e:
            # a damaged shard index: this shard's fault, named by check_shard
            raise ValueError(str(e)) from None
        yield a.name, out


def finite_rows(data: np.ndarray, name: str, dtype: str) -> bool:
    """Whether stored rows decode to finite values (bf16 bits, fp8 or mxfp4 bits, their scales)."""
    if name == "hidden_scale" and dtype == "mxfp4":
        return not bool((data == 0xFF).any())  # e8m0's only non-finite code: 0xFF is NaN
    if name == "hidden_scale":
        return bool(np.isfinite(data).all())
    if name == "hidden" and dtype == "mxfp4":
        return True  # e2m1 has no inf or NaN codes
    if name == "hidden" and dtype == "fp8_e4m3":
        # e4m3's only non-finite codes are S.1111.111
        return not bool(((data & 0x7F) == 0x7F).any())
    return not bool(((data & 0x7F80) == 0x7F80).any())  # a bf16 exponent of all ones: Inf or NaN
