"""Stores on object storage: `s3://bucket/prefix` (and the other URLs obstore opens: gs://, az://).

An object store has no rename, no append and no flock, so a store there is a mirror of a local one:

- **Writing.** Stage one writes the store as always into a local staging directory (the writer's
  commit protocol is unchanged) and `mirror.Mirror.push` copies it up. A push first snapshots every
  writer's done-log, then uploads the shard files and the arrays' metadata, then the snapshots: an
  object PUT is atomic (an object is absent or whole), so a reader never meets a commit whose shard
  is missing or torn. The other files follow; the root `zarr.json` goes up before anything else
  once, and again last (its state says "finalized"). Settled shards (every row committed) then
  leave the stage, each once a HEAD shows it on the server at its size (an upload acknowledged but
  not there is sent again). The last push of a run lists the server first: every shard the
  done-logs commit must be there (one still staged is sent again), else it fails in one line
  naming the shard, and the root never says "finalized".
- **One writer.** A lease object (`LEASE.json`: holder, expiry) is created with a conditional PUT
  (create only if absent) and renewed by every push (replace only if unchanged since our last
  write). A second writer is refused in one line naming the holder; a lease not renewed for its
  time to live (a writer killed with -9) is taken over, so a resumed run waits at most that long.
- **Resume.** A writer starting on a URL that already holds a store downloads its metadata,
  done-logs and every shard that is not settled (the shard each writer's committed rows end in,
  and any written past it), then resumes locally as on a filesystem (uncommitted rows are dropped).
  A settled shard missing from the server and from the stage is refused in one line: its rows are
  committed, so nothing would write them again.
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
import re
import sys
import time
from pathlib import Path

# a dependency of the package; optional for a checkout run from PYTHONPATH with local stores only
try:
    import obstore
    from obstore.exceptions import AlreadyExistsError, NotFoundError, PreconditionError
    from obstore.store import from_url
except ImportError:  # pragma: no cover - the GPU image runs without it
    obstore = from_url = None

    class AlreadyExistsError(Exception):  # never raised: stand-ins for the except clauses
        pass

    NotFoundError = PreconditionError = AlreadyExistsError

from cache_format.errors import CacheFormatError

__all__ = ["LEASE_KEY", "cache_root", "default_local", "fetch", "is_url", "lease_gone",
           "local_copy", "object_sizes", "open_bucket", "pull"]

LEASE_KEY = "LEASE.json"
# rewritten in place by finalize; re-read at every open
_ALWAYS_FRESH = ("zarr.json", "checksums.json")


def is_url(path: str | os.PathLike) -> bool:
    """Whether a --store value names object storage (a URL) rather than a local path."""
    s = str(path)
    return "://" in s and not s.startswith("file://")


# The process that first used obstore. Its async runtime does not survive a fork: a forked child
# (a DataLoader worker) that calls obstore hangs, so such a child downloads through a fresh
# interpreter instead (`python -m cache_format.remote fetch ...`, see fetch).
_obstore_pid: list[int] = []


def _forked_after_use() -> bool:
    return bool(_obstore_pid) and _obstore_pid[0] != os.getpid()


def open_bucket(url: str):
    """The obstore store of `url` (bucket and prefix), configured from the environment."""
    if from_url is None:
        raise CacheFormatError(f"{url}: stores on object storage need the obstore package (pip "
                               "install obstore)")
    if _forked_after_use():
        raise CacheFormatError(f"{url}: obstore cannot run in a process forked after its parent "
                               "used it")
    _obstore_pid[:] = _obstore_pid or [os.getpid()]
    try:
        return from_url(url)
    except Exception as e:  # noqa: BLE001 - obstore raises its own types for a bad URL or config
        raise CacheFormatError(f"{url}: cannot open the object store ({_brief(e)})") from None


def cache_root(root: str | os.PathLike = "") -> Path:
    """Where local copies of remote stores live: `root` if given, else $DRAFTCACHE_STORE_CACHE, else
    ~/.cache/draftcache/stores."""
    return Path(root or os.environ.get("DRAFTCACHE_STORE_CACHE")
                or Path.home() / ".cache" / "draftcache" / "stores")


def default_local(url: str, root: str | os.PathLike = "") -> Path:
    """The local directory of `url`'s copy under cache_root(root) (one per URL)."""
    return cache_root(root) / hashlib.sha256(url.encode()).hexdigest()[:16]


def _brief(e: Exception) -> str:
    """An object-store error in one line: the server's own code and reason where its answer carries
    them (an S3 XML error body, e.g. "NoSuchBucket: The specified bucket does not exist"), else the
    first 200 characters of the client's text."""
    text = str(e)
    code = re.search(r"<Code>([^<]+)</Code>", text)
    why = re.search(r"<Message>([^<]+)</Message>", text)
    if code:
        status = re.search(r"status code: (\d{3}[^:<]*)", text)
        return f"{code.group(1)}: {why.group(1) if why else ''}".rstrip(": ") + \
            (f" (HTTP {status.group(1).strip()})" if status else "")
    return " ".join(text.split())[:200] or type(e).__name__


# The per-token arrays (cache_format.layout): their chunk files are the shard data, fetched on use.
# The index arrays that finalize writes (offsets, sample_ids) are metadata: pulled at open.
_DATA_ARRAYS = {"hidden", "hidden_scale", "last_hidden", "input_ids", "loss_mask"}


def _is_data(key: str) -> bool:
    """Shard data (a token array's zarr chunk key .../ARRAY/c/...): fetched on use, never in a
    metadata pull."""
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


def local_copy(url: str, cache: str | os.PathLike = "") -> Path:
    """The metadata of the store at `url` in its directory under cache_root(cache)."""
    return pull(url, default_local(url, cache), data=False)


def fetch(url: str, local: Path, keys: list[str], bucket=None, *, parallel: int = 1) -> int:
    """Download the shard files `keys` (relative to the store) that `local` does not hold yet, up to
    `parallel` at once (I/O threads); returns how many. In a process forked after its parent used
    obstore, through a fresh interpreter (one per call)."""
    todo = [k for k in keys if not (local / k).exists()]
    if not todo:
        return 0
    if _forked_after_use():
        import subprocess

        cmd = [sys.executable, "-m", "cache_format.remote", "fetch", url, str(local), *todo]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            lines = (done.stderr or "").strip().splitlines()
            raise CacheFormatError(lines[-1].removeprefix("error: ") if lines
                                   else f"{url}: fetch failed")
        return len(todo)
    bucket = bucket or open_bucket(url)
    if parallel > 1 and len(todo) > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=parallel,
                                thread_name_prefix="draftcache-fetch") as pool:
            # re-raises the first error
            list(pool.map(lambda k: _download(bucket, url, k, local / k), todo))
    else:
        for k in todo:
            _download(bucket, url, k, local / k)
    return len(todo)


def main(argv: list[str]) -> int:
    """`python -m cache_format.remote fetch URL LOCAL KEY...`: fetch's download in a process of its
    own."""
    if len(argv) < 3 or argv[0] != "fetch":
        print("usage: python -m cache_format.remote fetch URL LOCAL KEY...", file=sys.stderr)
        return 2
    try:
        fetch(argv[1], Path(argv[2]), argv[3:])
    except CacheFormatError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


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
    if late <= 0:
        return None
    return f"its writer's lease ({rec.get('holder', '?')}) expired {late:.0f} s ago"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
