"""Reading the per-writer done-logs (JSON lines, appended and fsync'd after each shard write)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from cache_format.errors import CacheFormatError

__all__ = ["read_commit_log"]


def read_commit_log(path: str | os.PathLike, *, repair: bool = False,
                    start: int = 0) -> tuple[list[dict[str, Any]], int]:
    """(entries, end offset) of a done-log from byte `start`.

    Only lines ending in a newline count: a torn last line (a crash mid-append, or an append in
    progress seen by a follower) is not yet a commit. With `repair` (only the owning writer may
    do this) the torn tail is cut off the file, so the next append starts on a clean line.
    """
    path = Path(path)
    if not path.exists():
        return [], start
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read()
    cut = data.rfind(b"\n") + 1
    entries = []
    for lineno, line in enumerate(data[:cut].splitlines(), 1):
        if line.strip():
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:
                raise CacheFormatError(f"{path}: done-log entry {lineno} is corrupt") from None
    if repair and cut < len(data):
        with open(path, "r+b") as f:
            f.truncate(start + cut)
    return entries, start + cut
