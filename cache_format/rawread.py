"""Direct reads of uncompressed shards: pread straight into the output buffer.

The store stays plain zarr v3; this is only a faster way to read what zarr wrote (and what
layout.write_raw_shard writes, byte-identical). zarr-python's default read path measured
1.1 GB/s per process on an H200 host (docs/BENCHMARKS.md); a sample here costs a few preads.

Sharded arrays (zarr v3 sharding codec, index at the end): a shard file holds its inner chunks
somewhere in the file and ends with a uint64 (offset, nbytes) pair per chunk in C order plus a
crc32c; uncompressed chunks are rows in C order, full size even at the array's edge. Unsharded
1-D arrays are one raw chunk per file.
"""

from __future__ import annotations

import os
from pathlib import Path

import google_crc32c
import numpy as np

from cache_format.errors import CacheFormatError
from cache_format.layout import TokenArray, shard_file

__all__ = ["RawShardReader"]

_MISSING = np.uint64(2**64 - 1)


class RawShardReader:
    """Reads row ranges of a store's uncompressed token arrays with os.preadv."""

    def __init__(self, root: str | os.PathLike, rows_per_shard: int, rows_per_chunk: int) -> None:
        self.root = Path(root)
        self.rows, self.chunk = rows_per_shard, rows_per_chunk
        self._index: dict[Path, np.ndarray] = {}
        self._fds: dict[Path, int] = {}
        self._pid = os.getpid()

    def close(self) -> None:
        if self._pid == os.getpid():
            for fd in self._fds.values():
                os.close(fd)
        self._fds.clear()
        self._index.clear()

    def _fd(self, path: Path) -> int:
        if self._pid != os.getpid():  # forked: descriptors are shared with the parent; reopen
            self._fds, self._index, self._pid = {}, {}, os.getpid()
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def forget(self) -> None:
        """Drop cached shard indexes (tail shards are rewritten while a store is being written)."""
        self.close()

    def _shard_index(self, path: Path, fd: int) -> np.ndarray:
        idx = self._index.get(path)
        if idx is None:
            n = self.rows // self.chunk
            size = os.fstat(fd).st_size
            raw = os.pread(fd, 16 * n + 4, size - 16 * n - 4)
            crc = google_crc32c.Checksum()
            crc.update(raw[:-4])
            stored = int.from_bytes(raw[-4:], "little")
            if len(raw) != 16 * n + 4 or int.from_bytes(crc.digest(), "big") != stored:
                raise CacheFormatError(f"{path}: shard index is corrupt")
            idx = self._index[path] = np.frombuffer(raw[:-4], dtype="<u8").reshape(n, 2)
        return idx

    def read(self, key: str, a: TokenArray, start: int, stop: int, out: np.ndarray) -> None:
        """Rows [start, stop) of array `a` of group `key` into `out` (shape [stop-start, ...])."""
        if len(self._fds) > 256:  # bound open descriptors; never mid-read (segments hold fds)
            self.close()
        row_bytes = out.itemsize * (a.width or 1)
        flat = out.reshape(-1).view(np.uint8)
        segs: list[tuple[int, int, int]] = []  # (fd, file offset, bytes), in output order
        pos = start
        while pos < stop:
            shard = pos // self.rows
            hi = min(stop, (shard + 1) * self.rows)
            path = shard_file(self.root, key, a, shard)
            fd = self._fd(path)
            if not a.width:  # one raw chunk per file
                segs.append((fd, (pos - shard * self.rows) * row_bytes, (hi - pos) * row_bytes))
            else:
                idx = self._shard_index(path, fd)
                p = pos
                while p < hi:
                    local = p - shard * self.rows
                    j = local // self.chunk
                    q = min(hi, shard * self.rows + (j + 1) * self.chunk)
                    off, nbytes = idx[j]
                    if off == _MISSING:
                        segs.append((-1, 0, (q - p) * row_bytes))  # never written: fill value 0
                    else:
                        if nbytes != self.chunk * row_bytes:
                            raise CacheFormatError(f"{path}: chunk {j} has {nbytes} bytes; is the "
                                                   "store compressed?")
                        segs.append((fd, int(off) + (local - j * self.chunk) * row_bytes,
                                     (q - p) * row_bytes))
                    p = q
            pos = hi
        # coalesce: chunks that lie back to back in one file become one read
        at = 0
        i = 0
        while i < len(segs):
            fd, off, n = segs[i]
            while i + 1 < len(segs) and fd >= 0 and segs[i + 1][:2] == (fd, off + n):
                n += segs[i + 1][2]
                i += 1
            if fd < 0:
                flat[at: at + n] = 0
            else:
                self._pread(fd, flat, at, n, off, self.root / key / a.name)
            at += n
            i += 1

    @staticmethod
    def _pread(fd: int, flat: np.ndarray, at: int, n: int, offset: int, path: Path) -> None:
        got = os.preadv(fd, [memoryview(flat[at: at + n])], offset)
        if got != n:
            raise CacheFormatError(f"{path}: short read ({got} of {n} bytes at {offset})")
