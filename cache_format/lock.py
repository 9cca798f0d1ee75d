"""One writing run per store (and per training run directory and regeneration output): an OS
file lock beside it, held for the run's life.

`flock` locks belong to the open file and vanish with the process, so a run killed with -9 never
leaves a stale lock. The lock file sits beside the store (`STORE.lock`), not inside it: an
`--overwrite` deletes the store directory, and a lock inside it would be deleted with it.

A multi-rank run takes it per rank: rank 0 takes `STORE.lock` before anything is written, then
every other rank takes `STORE.lock.rankR` after a barrier. A second, separate run is refused by
its rank 0 (its other ranks wait at its barrier and never write). The holder writes its pid,
host and rank into the file, so the refusal names who holds the store. Readers (`train
--follow`) take no lock. The lock is named after the resolved path, so a second run reaching the
same store through a symbolic link meets the same lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from cache_format.errors import CacheFormatError

__all__ = ["WriterLock", "WriterLockedError", "lock_path", "writer_gone"]


class WriterLockedError(CacheFormatError):
    """Another process is writing there (a store, a run directory or a regeneration output)."""


def lock_path(store: str | os.PathLike, rank: int = 0) -> Path:
    base = str(Path(store).resolve()).rstrip("/") + ".lock"
    return Path(base if rank == 0 else f"{base}.rank{rank}")


class WriterLock:
    """One writer at a time: the lock of one rank on a store, a run directory or a regeneration
    output (see the module doc)."""

    def __init__(self, store: str | os.PathLike, rank: int = 0, *, what: str = "store") -> None:
        self.store, self.rank, self.what = str(store), rank, what
        self.path = lock_path(store, rank)
        self.fd: int | None = None

    def acquire(self, *, wait: bool = False) -> WriterLock:
        """Take the lock now or raise WriterLockedError naming the holder; `wait`: block until it is
        free."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise WriterLockedError(f"{self.store}: another run is writing this {self.what} "
                                    f"({holder}; lock {self.path}); wait for it to end or stop "
                                    "it") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd,
                  json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "rank": self.rank,
                                  "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> WriterLock:
        # `with lock.acquire(wait=True):` holds it once
        return self if self.fd is not None else self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def writer_gone(store: str | os.PathLike) -> str | None:
    """Why the last writer of `store` is known to be gone (None: running, or not known here).

    Reads the holder record of STORE.lock without taking the lock (taking it, even for a moment,
    would refuse a writer starting then): the writer is gone when it ran on this host and its pid no
    longer exists. A writer on another host is never called gone (its pid means nothing here).
    """
    try:
        info = json.loads(lock_path(store).read_text() or "{}")
        pid, host = int(info["pid"]), info["host"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if host != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"its writer (pid {pid} on {host}, since {info.get('since', '?')}) is gone"
    except PermissionError:
        return None  # alive, another user's
    return None


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return (f"pid {info['pid']} on host {info['host']}, rank {info['rank']}, "
                f"since {info['since']}")
    except (ValueError, KeyError, OSError):
        return "holder unknown"
