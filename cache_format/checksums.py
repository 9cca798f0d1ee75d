"""checksums.json: a sha256 for every store file that the shard checksums do not cover.

Data shards are covered by the crc32c of their rows (and, for the tail shards, of their files) in
the commit logs. Everything else is listed here: the frozen target weights, the prompt keys, the
tokenizer files, the commit logs themselves, every zarr.json below the root, the finalized index
arrays; and the root zarr.json's manifest and state, hashed as canonical JSON (the file itself is
rewritten when a resumed run clears the final flag).

Written twice: at creation (rank 0, once the frozen weights, prompt keys and tokenizer are in;
`finalized: false`, those files only) and at finalize (everything, `finalized: true`). `verify`
checks every entry and names each missing or changed file; training checks the frozen weights
and the manifest when it opens a store.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from cache_format.errors import CacheFormatError
from cache_format.layout import (
    FROZEN_FILE,
    MANIFEST_KEY,
    PROMPTS_FILE,
    STATE_KEY,
    atomic_write_bytes,
    read_root_attrs,
    token_arrays,
)
from cache_format.schema import Manifest

__all__ = ["CHECKSUMS_FILE", "CREATION_FILES", "check_checksums", "covered_files",
           "record_checksums", "sha256_file"]

CHECKSUMS_FILE = "checksums.json"
# written by rank 0 when the store is made
CREATION_FILES = (FROZEN_FILE, PROMPTS_FILE, "tokenizer/")


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _json_sha256(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True,
                                     separators=(",", ":")).encode()).hexdigest()


def covered_files(root: Path, m: Manifest) -> list[str]:
    """Store-relative paths this file covers: every file but the data shards (crc'd in the commit
    logs), the root zarr.json (its manifest and state are hashed instead) and checksums.json."""
    data_arrays = {a.name for a in token_arrays(m)}
    out = []
    for p in sorted(root.rglob("*")):
        if not p.is_file():
            continue
        rel = p.relative_to(root).as_posix()
        parts = rel.split("/")
        if rel in ("zarr.json", CHECKSUMS_FILE) or p.suffix in (".partial", ".tmp"):
            continue
        shard = len(parts) > 3 and parts[0].startswith("w") and parts[3] == "c"
        if shard and parts[2] in data_arrays:
            continue  # a data shard
        out.append(rel)
    return out


def record_checksums(root: str | os.PathLike, m: Manifest, *, finalized: bool) -> dict[str, Any]:
    """Write checksums.json: at creation (finalized False) the creation files only, else all."""
    root = Path(root)
    files = covered_files(root, m)
    if not finalized:
        files = [f for f in files if f.startswith(CREATION_FILES)]
    attrs = read_root_attrs(root)
    doc = {"finalized": finalized, "manifest_sha256": _json_sha256(attrs[MANIFEST_KEY]),
           "files": {f: sha256_file(root / f) for f in files}}
    if finalized:
        doc["state_sha256"] = _json_sha256(attrs.get(STATE_KEY, {}))
    atomic_write_bytes(root / CHECKSUMS_FILE, json.dumps(doc, indent=1).encode())
    return doc


def check_checksums(root: str | os.PathLike, *,
                    only: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(file, problem) for every listed file that is missing or changed, and for the manifest and
    state; `only`: check just the entries starting with these prefixes (and the manifest)."""
    root = Path(root)
    path = root / CHECKSUMS_FILE
    if not path.is_file():
        return [(CHECKSUMS_FILE,
                 "missing: the store has no checksums (written at creation and finalize)")]
    try:
        doc = json.loads(path.read_text())
        files, manifest_sha = dict(doc["files"]), doc["manifest_sha256"]
    except (ValueError, KeyError, TypeError) as e:
        return [(CHECKSUMS_FILE, f"damaged ({type(e).__name__})")]
    bad = []
    try:
        attrs = read_root_attrs(root)
    except CacheFormatError as e:
        return [("zarr.json", str(e))]
    if _json_sha256(attrs[MANIFEST_KEY]) != manifest_sha:
        bad.append(("zarr.json", "manifest changed since it was written"))
    if not only and doc.get("state_sha256") and _json_sha256(attrs.get(STATE_KEY,
                                                                       {})) != doc["state_sha256"] \
            and attrs.get(STATE_KEY, {}).get("finalized"):
        bad.append(("zarr.json", "finalized state changed since finalize"))
    # a finalized store's list must cover what the store holds: a file on disk it does not name (an
    # emptied or cut list, a file added later) is a problem too, not a silent pass. While a store is
    # written its files appear before they are listed (a follower may look in between).
    try:
        finalized = doc.get("finalized")
        held = covered_files(root, Manifest.from_dict(attrs[MANIFEST_KEY])) if finalized else []
    except CacheFormatError as e:
        return [*bad, ("zarr.json", str(e))]
    for rel in held:
        if rel not in files and (not only or rel.startswith(only)):
            bad.append((rel, f"not covered by {CHECKSUMS_FILE}"))
    for rel, want in sorted(files.items()):
        if only and not rel.startswith(only):
            continue
        p = root / rel
        if not p.is_file():
            bad.append((rel, "missing"))
        elif sha256_file(p) != want:
            bad.append((rel, "checksum mismatch"))
    return bad
