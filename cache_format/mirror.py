"""Writing a store to object storage: the lease that makes one writer, the mirror that uploads a
local store in commit order, and `writing_to`, which extraction wraps its run in. The protocol and
why it is safe: cache_format.remote's module doc."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cache_format.errors import CacheFormatError
from cache_format.layout import group_key, read_manifest, shard_keys, token_arrays
from cache_format.logs import committed_rows, parse_commit_lines
from cache_format.remote import (
    LEASE_KEY,
    AlreadyExistsError,
    NotFoundError,
    PreconditionError,
    _brief,
    _is_data,
    _listing,
    fetch,
    obstore,
    open_bucket,
    pull,
)
from cache_format.schema import Manifest

__all__ = ["Lease", "Mirror", "clear", "writing_to"]


class Lease:
    """The writing lease of one store on object storage (see the module doc)."""

    def __init__(self, url: str, *, ttl: float = 60.0, bucket=None) -> None:
        self.url, self.ttl = url, ttl
        self.bucket = bucket or open_bucket(url)
        self.holder = f"{socket.gethostname()}:{os.getpid()}"
        self.etag: str | None = None

    def _record(self) -> bytes:
        return json.dumps({"holder": self.holder, "expires": time.time() + self.ttl,
                           "ttl": self.ttl}).encode()

    def _current(self) -> tuple[dict[str, Any], str] | None:
        try:
            got = obstore.get(self.bucket, LEASE_KEY)
            return json.loads(bytes(got.bytes())), got.meta["e_tag"]
        except (FileNotFoundError, NotFoundError):
            return None
        except ValueError:  # a torn or foreign lease object: treat as expired
            return {"holder": "?", "expires": 0.0}, obstore.head(self.bucket, LEASE_KEY)["e_tag"]

    def acquire(self, *, wait: float | None = None) -> Lease:
        """Take the lease; a live holder's is waited out up to `wait` seconds (default: the time
        to live, so a killed writer's lease expires meanwhile), then refused in one line."""
        deadline = time.time() + (self.ttl if wait is None else wait)
        while True:
            try:
                cur = self._current()
                if cur is None:
                    self.etag = obstore.put(self.bucket, LEASE_KEY, self._record(),
                                            mode="create")["e_tag"]
                    return self
                rec, etag = cur
                if rec.get("expires", 0) < time.time():  # expired: replace exactly that version
                    self.etag = obstore.put(self.bucket, LEASE_KEY, self._record(),
                                            mode={"e_tag": etag})["e_tag"]
                    return self
            except (FileExistsError, AlreadyExistsError, PreconditionError):
                # lost a race: look again
                rec = {"holder": "another writer", "expires": time.time()}
            except Exception as e:  # noqa: BLE001
                raise CacheFormatError(
                    f"{self.url}: cannot take the writing lease ({_brief(e)})") from None
            if time.time() >= deadline:
                left = max(0.0, rec.get("expires", 0) - time.time())
                raise CacheFormatError(f"{self.url}: being written by {rec.get('holder', '?')} "
                                       f"(its lease runs {left:.0f} s more); one writer per store")
            time.sleep(min(1.0, max(0.05, deadline - time.time())))

    def renew(self) -> None:
        """Extend the lease; a lease another writer took meanwhile is one line."""
        try:
            self.etag = obstore.put(self.bucket, LEASE_KEY, self._record(),
                                    mode={"e_tag": self.etag})["e_tag"]
        except PreconditionError:
            raise CacheFormatError(f"{self.url}: the writing lease was taken by another writer "
                                   f"(this one was not renewed for {self.ttl:g} s); "
                                   "stopping") from None
        except Exception as e:  # noqa: BLE001
            raise CacheFormatError(
                f"{self.url}: cannot renew the writing lease ({_brief(e)})") from None

    def release(self) -> None:
        if self.etag is not None:
            try:
                obstore.delete(self.bucket, LEASE_KEY)
            except Exception:  # noqa: BLE001 - it expires anyway
                pass
            self.etag = None


def _signature(st: os.stat_result) -> tuple[int, int, int]:
    """What tells a file's versions apart: size, mtime and inode. The mtime alone does not: the
    clock that stamps it ticks every few milliseconds, and two flushes of a tail shard within one
    tick can leave the same size; but every flush is a new file renamed into place, so a new
    inode."""
    return st.st_size, st.st_mtime_ns, st.st_ino


def _writer_entries(logs: dict[str, bytes]) -> list[tuple[int, list[dict[str, Any]]]]:
    """(writer id, entries) of done-log snapshots {"commits/wNNNNN.jsonl": whole lines}."""
    return [(int(Path(key).stem[1:]), parse_commit_lines(raw, key)) for key, raw in logs.items()]


def _settled_shards(m: Manifest, logs: dict[str, bytes], *, partly: bool = False) -> list[str]:
    """The data files (relative keys) of the shards whose every row the done-log snapshots commit:
    the rows below a writer's committed end are never read or written again, even by a resume. A
    shard whose entry says it is full is not enough: a sample that began in it and ends in a later
    shard may not be committed, and a resuming writer then reads that shard back and rewrites it
    (ShardWriter._recover) -- evicting it meanwhile raced the writer's own tail flush.
    partly: also the shard each committed end lies in (every shard a reader may need)."""
    arrays, rps = token_arrays(m), m.rows_per_shard
    return [k for writer, entries in _writer_entries(logs)
            for bucket, n in committed_rows(entries).items()
            for shard in range(-(-n // rps) if partly else n // rps)
            for k in shard_keys(arrays, group_key(writer, bucket), shard)]


def _lost(url: str, key: str, why: str) -> CacheFormatError:
    return CacheFormatError(f"{url}/{key}: committed by commits/{key.split('/')[0]}.jsonl but "
                            f"missing from the object store{why}; write the store again (extract "
                            "--overwrite)")


class Mirror:
    """Copies a local store up to `url` in commit order (see the module doc), each file only when
    it changed since the last push."""

    def __init__(self, local: str | os.PathLike, url: str, *, bucket=None, evict: bool = False,
                 armed: bool = True) -> None:
        """evict: delete the local files of settled shards (every row committed) once they and the
        done-log lines that commit them are on the server (the writer never reads or writes those
        rows again), so the staging directory holds the tail shards and metadata, not the store.
        armed False: pushes do nothing until `arm()` (the stage not yet checked against its run)."""
        self.local, self.url, self.evict = Path(local), url, evict
        self.bucket = bucket or open_bucket(url)
        # key -> _signature of the version last uploaded
        self.sent: dict[str, tuple[int, int, int]] = {}
        self.bytes_sent = 0
        self.armed = armed

    def arm(self) -> None:
        """Let pushes go up (writing_to's mirror waits for this: the stage checked against the run
        first)."""
        self.armed = True

    def _files(self) -> list[str]:
        out = []
        for p in self.local.rglob("*"):
            if p.is_file() and ".partial" not in p.name and not p.name.startswith("."):
                out.append(p.relative_to(self.local).as_posix())
        return sorted(out)

    def _put(self, key: str, data: bytes | None = None) -> None:
        p, snapshot = self.local / key, data is not None
        try:
            stat = p.stat()
            if data is None:
                if self.sent.get(key) == _signature(stat):
                    return
                data = p.read_bytes()
            obstore.put(self.bucket, key, data)
        except FileNotFoundError:
            return  # replaced or removed since the listing (a recovering writer's leftovers)
        except Exception as e:  # noqa: BLE001
            raise CacheFormatError(f"{self.url}/{key}: upload failed ({_brief(e)})") from None
        # a done-log snapshot is recorded by its length (the file may have grown since)
        self.sent[key] = (len(data), -1, -1) if snapshot else _signature(stat)
        self.bytes_sent += len(data)

    def _on_server(self, key: str, size: int) -> bool | None:
        """Whether the server holds `key` at `size` bytes; None where it cannot tell now."""
        try:
            return int(obstore.head(self.bucket, key)["size"]) == size
        except (FileNotFoundError, NotFoundError):
            return False
        except Exception:  # noqa: BLE001 - unreachable for now: ask again at the next push
            return None

    def _evict(self, logs: dict[str, bytes]) -> None:
        for key in _settled_shards(read_manifest(self.local), logs):
            p = self.local / key
            try:
                st = p.stat()
            except FileNotFoundError:
                continue  # evicted before
            if self.sent.get(key) != _signature(st):
                continue  # not sent as it is here
            # the one copy leaves this machine only once the server shows it (one HEAD per shard)
            there = self._on_server(key, st.st_size)
            if there:
                p.unlink()
            elif there is False:  # acknowledged, yet not there: send it again next push
                del self.sent[key]

    def _check_complete(self, logs: dict[str, bytes]) -> None:
        """Every shard the done-log snapshots commit is on the server (one listing): one still in
        the stage is sent again, one gone from both is a one-line error, before the root goes up."""
        there = _listing(self.bucket, self.url)
        for key in _settled_shards(read_manifest(self.local), logs, partly=True):
            if key in there:
                continue
            if not (self.local / key).exists():
                raise _lost(self.url, key, f" and no longer in the staging directory {self.local}")
            self.sent.pop(key, None)
            self._put(key)

    def push(self, *, final: bool = False) -> None:
        """One pass: the root zarr.json (the first time); done-log snapshots; then the shards and
        the arrays' metadata (their shapes grow with the rows written), read now, so at least as new
        as the snapshots; then the snapshots; the rest; the root zarr.json last. final (the last
        pass of a writing run): first check that the server holds every committed shard
        (_check_complete)."""
        if not self.armed or not (self.local / "zarr.json").exists():
            # not checked or not created yet (a push can come before create_store or its checks)
            return
        # the root first, once: what a resume looks for to know a store is there
        if "zarr.json" not in self.sent:
            self._put("zarr.json")
        logs = {}
        for p in sorted((self.local / "commits").glob("*.jsonl")):
            raw = p.read_bytes()
            logs[f"commits/{p.name}"] = raw[: raw.rfind(b"\n") + 1]  # whole lines only
        files = self._files()
        for key in files:
            if _is_data(key):
                self._put(key)
        for key in files:
            if key.endswith("zarr.json") and key != "zarr.json":
                self._put(key)
        for key, raw in logs.items():
            if self.sent.get(key, (-1,))[0] != len(raw):
                self._put(key, raw)
        if self.evict:
            self._evict(logs)
        for key in files:
            if not _is_data(key) and key not in logs and not key.endswith("zarr.json"):
                self._put(key)
        if final:
            self._check_complete(logs)
        self._put("zarr.json")


def clear(url: str, bucket=None) -> None:
    """Delete every object of the store at `url` but the lease (extract --overwrite)."""
    bucket = bucket or open_bucket(url)
    keys = [k for k in _listing(bucket, url) if k != LEASE_KEY]
    try:
        for i in range(0, len(keys), 1000):
            obstore.delete(bucket, keys[i:i + 1000])
    except Exception as e:  # noqa: BLE001
        raise CacheFormatError(f"{url}: cannot delete the old store ({_brief(e)})") from None


def _prepare_prefix(url: str, local: str | os.PathLike, bucket, *, overwrite: bool) -> None:
    """Clear the prefix (`overwrite`), or pull a resume's metadata, done-logs and unsettled shards
    into `local`; refuse a prefix that holds something else, or committed shards lost from both."""
    there = set(_listing(bucket, url)) - {LEASE_KEY}
    # our root goes up first: not a store of ours
    if there and "zarr.json" not in there and not overwrite:
        raise CacheFormatError(f"{url}: holds {len(there)} objects but no draftcache store; "
                               "choose an empty prefix, or --overwrite to delete them")
    if overwrite:
        clear(url, bucket)
    elif there:  # a resume: metadata, done-logs, unsettled shards (never a settled one)
        pull(url, local, data=False, bucket=bucket)
        logs = {f"commits/{p.name}": p.read_bytes()
                for p in sorted((Path(local) / "commits").glob("*.jsonl"))}
        m = read_manifest(Path(local))
        settled = set(_settled_shards(m, logs))
        # a log the server lacks stays as the stage has it (a rerun on the same machine), its
        # shards too
        lost = sorted(k for k in settled - there if not (Path(local) / k).exists())
        if lost:  # its rows are committed, so no writer would write them again
            raise _lost(url, lost[0],
                        f" ({len(lost)} shard files in all)" if len(lost) > 1 else "")
        fetch(url, Path(local), sorted(k for k in there if _is_data(k) and k not in settled),
              bucket)


@contextmanager
def writing_to(url: str, local: str | os.PathLike, *, ttl: float = 60.0,
               overwrite: bool = False) -> Iterator[Mirror]:
    """Write a store to `url` through the local directory `local`: take the lease (waiting out a
    killed writer's), clear the old store with `overwrite` or else download its metadata, done-logs
    and tail shards (a resume, on this machine or another), then, once the caller arms the mirror
    (`mirror.arm()`: the stage checked against its run), push every ttl/6 seconds from an I/O thread
    (no GPU work on it) and once more on the way out, finished or not, so that a resume finds every
    commit; release the lease. A run refused before it arms pushes nothing: the URL stays as it was.
    Settled shards leave `local` once they are on the server (Mirror's evict)."""
    lease = Lease(url, ttl=ttl).acquire()
    try:
        _prepare_prefix(url, local, lease.bucket, overwrite=overwrite)
    except BaseException:
        lease.release()
        raise
    # nothing goes up before the caller has checked the stage against its run (mirror.arm()): a
    # stage left by another store's run, refused by those checks, must not reach this URL first
    mirror = Mirror(local, url, bucket=lease.bucket, evict=True, armed=False)
    stop, errors = threading.Event(), []

    def loop() -> None:
        while not stop.wait(ttl / 6):
            try:
                mirror.push()
                lease.renew()
            except CacheFormatError as e:
                errors.append(e)
                return

    thread = threading.Thread(target=loop, name="draftcache-mirror", daemon=True)
    thread.start()
    failed = True
    try:
        yield mirror
        failed = False
    finally:
        stop.set()
        thread.join()
        try:
            if not errors and mirror.armed:
                mirror.push(final=True)
        except CacheFormatError as e:
            errors.append(e)
        lease.release()
        if errors and not failed:
            raise errors[0]
