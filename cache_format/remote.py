"""Stores on object storage: `s3://bucket/prefix` (and the other URLs obstore opens: gs://, az://).

An object store has no rename, no append and no flock, so a store there is a mirror of a local one:

- **Writing.** Stage one writes the store as always into a local staging directory (the writer's
  commit protocol is unchanged) and `Mirror.push` copies it up. A push first snapshots every
  writer's done-log, then uploads the shard files, then the snapshots: an object PUT is atomic (an
  object is absent or whole), so a reader never meets a commit whose shard is missing or torn. The
  other files follow; the root `zarr.json`, whose state says "finalized", goes last.
- **One writer.** A lease object (`LEASE.json`: holder, expiry) is created with a conditional PUT
  (create only if absent) and renewed by every push (replace only if unchanged since our last
  write). A second writer is refused in one line naming the holder; a lease not renewed for its
  time to live (a writer killed with -9) is taken over, so a resumed run waits at most that long.
- **Resume.** A writer starting on a URL that already holds a store downloads what its staging
  directory lacks, then resumes locally as on a filesystem (uncommitted rows are dropped).
- **Reading.** `local_copy` downloads everything but the shard data into a cache directory (one
  per URL); `fetch` brings shards on first use, and readers check each against its done-log
  checksum (cache_format.reader's shard checks are on for every remote store). Each node keeps its
  own cache and reads only the shards its samples live in.

Credentials and endpoint come from the environment, as obstore reads them (AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ALLOW_HTTP for a plain-http test server).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

try:  # a dependency of the package; optional for a checkout run from PYTHONPATH with local stores only
    import obstore
    from obstore.exceptions import AlreadyExistsError, NotFoundError, PreconditionError
    from obstore.store import from_url
except ImportError:  # pragma: no cover - the GPU image runs without it
    obstore = from_url = None

    class AlreadyExistsError(Exception):  # never raised: stand-ins for the except clauses
        pass

    NotFoundError = PreconditionError = AlreadyExistsError

from cache_format.errors import CacheFormatError

__all__ = ["LEASE_KEY", "Lease", "Mirror", "cache_root", "clear", "default_local", "fetch", "is_url", "lease_gone",
           "local_copy", "object_sizes", "open_bucket", "pull", "writing_to"]

LEASE_KEY = "LEASE.json"
_ALWAYS_FRESH = ("zarr.json", "checksums.json")  # rewritten in place by finalize; re-read at every open


def is_url(path: str | os.PathLike) -> bool:
    """Whether a --store value names object storage (a URL) rather than a local path."""
    s = str(path)
    return "://" in s and not s.startswith("file://")


def open_bucket(url: str):
    """The obstore store of `url` (bucket and prefix), configured from the environment."""
    if from_url is None:
        raise CacheFormatError(f"{url}: stores on object storage need the obstore package (pip install obstore)")
    try:
        return from_url(url)
    except Exception as e:  # noqa: BLE001 - obstore raises its own types for a bad URL or config
        raise CacheFormatError(f"{url}: cannot open the object store ({_brief(e)})") from None


def cache_root() -> Path:
    """Where local copies of remote stores live: $DRAFTCACHE_STORE_CACHE, else ~/.cache/draftcache/stores."""
    return Path(os.environ.get("DRAFTCACHE_STORE_CACHE") or Path.home() / ".cache" / "draftcache" / "stores")


def default_local(url: str) -> Path:
    """The local directory of `url`'s copy under cache_root (one per URL)."""
    return cache_root() / hashlib.sha256(url.encode()).hexdigest()[:16]


def _brief(e: Exception) -> str:
    return " ".join(str(e).split())[:200] or type(e).__name__


# The per-token arrays (cache_format.layout): their chunk files are the shard data, fetched on use.
# The index arrays that finalize writes (offsets, sample_ids) are metadata: pulled at open.
_DATA_ARRAYS = {"hidden", "hidden_scale", "last_hidden", "input_ids", "loss_mask"}


def _is_data(key: str) -> bool:
    """Shard data (a token array's zarr chunk key .../ARRAY/c/...): fetched on use, never in a metadata pull."""
    parts = key.split("/")
    return "c" in parts and parts.index("c") > 0 and parts[parts.index("c") - 1] in _DATA_ARRAYS


def _listing(bucket, url: str) -> dict[str, int]:
    """{key: size} of every object under the store's prefix."""
    try:
        return {o["path"]: int(o["size"]) for batch in obstore.list(bucket) for o in batch}
    except Exception as e:  # noqa: BLE001
        raise CacheFormatError(f"{url}: cannot list the store ({_brief(e)})") from None


def object_sizes(url: str) -> dict[str, int]:
    """{key: bytes} of every object of the store at `url` (inspect's disk figures)."""
    return _listing(open_bucket(url), url)


def _download(bucket, url: str, key: str, dst: Path) -> None:
    """One object into dst, whole or not at all (temp file + rename)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.partial")
    try:
        data = obstore.get(bucket, key).bytes()
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, dst)
    except (FileNotFoundError, NotFoundError):
        tmp.unlink(missing_ok=True)
        raise CacheFormatError(f"{url}/{key}: missing from the object store") from None
    except Exception as e:  # noqa: BLE001
        tmp.unlink(missing_ok=True)
        raise CacheFormatError(f"{url}/{key}: cannot be downloaded ({_brief(e)})") from None


def pull(url: str, local: str | os.PathLike, *, data: bool, bucket=None) -> Path:
    """Download the store at `url` into `local`: every file it lacks (with `data`, shards too);
    done-logs, zarr.json files and checksums.json again whenever their size differs (they grow or
    are rewritten). Returns `local`."""
    bucket = bucket or open_bucket(url)
    root = Path(local)
    listing = {k: n for k, n in _listing(bucket, url).items() if k != LEASE_KEY}
    if "zarr.json" not in listing:
        raise CacheFormatError(f"{url}: no draftcache store there (no zarr.json)")
    for key, size in sorted(listing.items()):
        if _is_data(key) and not data:
            continue
        dst = root / key
        fresh = key.endswith(_ALWAYS_FRESH) or key.startswith("commits/")
        if dst.exists() and (not fresh or dst.stat().st_size == size):
            continue
        _download(bucket, url, key, dst)
    return root


def local_copy(url: str, local: str | os.PathLike | None = None) -> Path:
    """The metadata of the store at `url` in a local directory (default: its cache directory)."""
    return pull(url, local or default_local(url), data=False)


def fetch(url: str, local: Path, keys: list[str], bucket=None) -> None:
    """Download the shard files `keys` (relative to the store) that `local` does not hold yet."""
    todo = [k for k in keys if not (local / k).exists()]
    if todo:
        bucket = bucket or open_bucket(url)
        for k in todo:
            _download(bucket, url, k, local / k)


class Lease:
    """The writing lease of one store on object storage (see the module doc)."""

    def __init__(self, url: str, *, ttl: float = 60.0, bucket=None) -> None:
        self.url, self.ttl = url, ttl
        self.bucket = bucket or open_bucket(url)
        self.holder = f"{socket.gethostname()}:{os.getpid()}"
        self.etag: str | None = None

    def _record(self) -> bytes:
        return json.dumps({"holder": self.holder, "expires": time.time() + self.ttl, "ttl": self.ttl}).encode()

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
                    self.etag = obstore.put(self.bucket, LEASE_KEY, self._record(), mode="create")["e_tag"]
                    return self
                rec, etag = cur
                if rec.get("expires", 0) < time.time():  # expired: replace exactly that version
                    self.etag = obstore.put(self.bucket, LEASE_KEY, self._record(), mode={"e_tag": etag})["e_tag"]
                    return self
            except (FileExistsError, AlreadyExistsError, PreconditionError):
                rec = {"holder": "another writer", "expires": time.time()}  # lost a race: look again
            except Exception as e:  # noqa: BLE001
                raise CacheFormatError(f"{self.url}: cannot take the writing lease ({_brief(e)})") from None
            if time.time() >= deadline:
                left = max(0.0, rec.get("expires", 0) - time.time())
                raise CacheFormatError(f"{self.url}: being written by {rec.get('holder', '?')} (its lease runs "
                                       f"{left:.0f} s more); one writer per store")
            time.sleep(min(1.0, max(0.05, deadline - time.time())))

    def renew(self) -> None:
        """Extend the lease; a lease another writer took meanwhile is one line."""
        try:
            self.etag = obstore.put(self.bucket, LEASE_KEY, self._record(), mode={"e_tag": self.etag})["e_tag"]
        except PreconditionError:
            raise CacheFormatError(f"{self.url}: the writing lease was taken by another writer (this one was "
                                   f"not renewed for {self.ttl:g} s); stopping") from None
        except Exception as e:  # noqa: BLE001
            raise CacheFormatError(f"{self.url}: cannot renew the writing lease ({_brief(e)})") from None

    def release(self) -> None:
        if self.etag is not None:
            try:
                obstore.delete(self.bucket, LEASE_KEY)
            except Exception:  # noqa: BLE001 - it expires anyway
                pass
            self.etag = None


def _complete_shards(local: Path, logs: dict[str, bytes]) -> list[str]:
    """The data files (relative keys) of the complete shards that the done-log snapshots commit."""
    from cache_format.layout import group_key, read_manifest, shard_file, token_arrays

    m = read_manifest(local)
    out = []
    for key, raw in logs.items():
        writer = int(Path(key).stem[1:])
        for line in raw.splitlines():
            e = json.loads(line) if line.strip() else {}
            if e.get("rows") == m.rows_per_shard:
                out += [shard_file("", group_key(writer, e["bucket"]), a, e["shard"]).as_posix()
                        for a in token_arrays(m)]
    return out


def _committed_ends(local: Path, logs: dict[str, bytes]) -> list[str]:
    """The data files of the shard each writer's committed rows end inside, per bucket: a resuming
    writer reads that shard's committed rows back into its buffer (ShardWriter._recover), and it may
    be a complete shard (a sample that began in it was not committed)."""
    from cache_format.layout import group_key, read_manifest, shard_file, token_arrays

    m = read_manifest(local)
    out = []
    for key, raw in logs.items():
        writer, rows = int(Path(key).stem[1:]), {}
        for line in raw.splitlines():
            e = json.loads(line) if line.strip() else {}
            for _, n in e.get("samples", []):
                rows[e["bucket"]] = rows.get(e["bucket"], 0) + int(n)
        for bucket, n in rows.items():
            if n % m.rows_per_shard:
                out += [shard_file("", group_key(writer, bucket), a, n // m.rows_per_shard).as_posix()
                        for a in token_arrays(m)]
    return out


def lease_gone(url: str) -> str | None:
    """Why the writer of the store at `url` is known to be gone: its lease has expired (not renewed
    for its time to live) or was released without a finalize; None while it is renewed."""
    try:
        got = obstore.get(open_bucket(url), LEASE_KEY)
        rec = json.loads(bytes(got.bytes()))
    except (FileNotFoundError, NotFoundError):
        return "no writer holds its lease"
    except Exception:  # noqa: BLE001 - unreadable now: not known to be gone
        return None
    late = time.time() - float(rec.get("expires", 0))
    return f"its writer's lease ({rec.get('holder', '?')}) expired {late:.0f} s ago" if late > 0 else None


class Mirror:
    """Copies a local store up to `url` in commit order (see the module doc), each file only when
    it changed since the last push."""

    def __init__(self, local: str | os.PathLike, url: str, *, bucket=None, evict: bool = False) -> None:
        """evict: delete the local files of complete shards once they and the done-log line that
        commits them are on the server (the writer never reads a complete shard again), so the
        staging directory holds the tail shards and metadata, not the store."""
        self.local, self.url, self.evict = Path(local), url, evict
        self.bucket = bucket or open_bucket(url)
        self.sent: dict[str, tuple[int, int]] = {}  # key -> (size, mtime_ns) last uploaded
        self.bytes_sent = 0

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
                if self.sent.get(key) == (stat.st_size, stat.st_mtime_ns):
                    return
                data = p.read_bytes()
            obstore.put(self.bucket, key, data)
        except FileNotFoundError:
            return  # replaced or removed since the listing (a recovering writer's leftovers)
        except Exception as e:  # noqa: BLE001
            raise CacheFormatError(f"{self.url}/{key}: upload failed ({_brief(e)})") from None
        # a done-log snapshot is recorded by its length (the file may have grown since)
        self.sent[key] = (len(data), -1) if snapshot else (stat.st_size, stat.st_mtime_ns)
        self.bytes_sent += len(data)

    def _evict(self, logs: dict[str, bytes]) -> None:
        for key in _complete_shards(self.local, logs):
            p = self.local / key
            try:
                st = p.stat()
            except FileNotFoundError:
                continue  # evicted before
            if self.sent.get(key) == (st.st_size, st.st_mtime_ns):  # on the server as it is here
                p.unlink()

    def push(self) -> None:
        """One pass: the root zarr.json (the first time); done-log snapshots; then the shards and the arrays' metadata (their shapes grow
        with the rows written), read now, so at least as new as the snapshots; then the snapshots;
        the rest; the root zarr.json last."""
        if not (self.local / "zarr.json").exists():
            return  # not created yet (the first push of an extraction can come before create_store)
        if "zarr.json" not in self.sent:  # the root first, once: what a resume looks for to know a store is there
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


@contextmanager
def writing_to(url: str, local: str | os.PathLike, *, ttl: float = 60.0, overwrite: bool = False) -> Iterator[Mirror]:
    """Write a store to `url` through the local directory `local`: take the lease (waiting out a killed
    writer's), clear the old store with `overwrite` or else download its metadata, done-logs and tail
    shards (a resume, on this machine or another), then push every ttl/6 seconds from an I/O thread (no GPU work on it) and once
    more on the way out, finished or not, so that a resume finds every commit; release the lease.
    Complete shards leave `local` once they are on the server (Mirror's evict)."""
    lease = Lease(url, ttl=ttl).acquire()
    try:
        there = set(_listing(lease.bucket, url)) - {LEASE_KEY}
        if there and "zarr.json" not in there and not overwrite:  # our root goes up first: not a store of ours
            raise CacheFormatError(f"{url}: holds {len(there)} objects but no draftcache store; choose an empty "
                                   "prefix, or --overwrite to delete them")
        if overwrite:
            clear(url, lease.bucket)
        elif there:  # a resume: the metadata, done-logs and tail shards (a writer never reads a complete one)
            pull(url, local, data=False, bucket=lease.bucket)
            logs = {f"commits/{p.name}": p.read_bytes() for p in sorted((Path(local) / "commits").glob("*.jsonl"))}
            complete = set(_complete_shards(Path(local), logs))
            needed = {k for k in there if _is_data(k) and k not in complete} | set(_committed_ends(Path(local), logs))
            fetch(url, Path(local), sorted(needed & there), lease.bucket)
    except BaseException:
        lease.release()
        raise
    mirror, stop, errors = Mirror(local, url, bucket=lease.bucket, evict=True), threading.Event(), []

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
            if not errors:
                mirror.push()
        except CacheFormatError as e:
            errors.append(e)
        lease.release()
        if errors and not failed:
            raise errors[0]
