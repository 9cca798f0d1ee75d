"""Reading the per-writer done-logs (JSON lines, appended and fsync'd after each shard write)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from cache_format.errors import CacheFormatError

__all__ = ["committed_rows", "cut_torn_line", "parse_commit_lines", "read_commit_log"]


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
    entries = parse_commit_lines(data[:cut], str(path))
    if repair:
        cut_torn_line(path, data, start)
    return entries, start + cut


def cut_torn_line(path: str | os.PathLike, data: bytes, start: int = 0) -> None:
    """Cut a last line without its newline (a crash mid-append) off the append-only file `path`,
    whose bytes from `start` are `data`, so the next append starts on a line of its own (the
    stores' done-logs and regeneration outputs alike)."""
    cut = data.rfind(b"\n") + 1
    if cut < len(data):
        with open(path, "r+b") as f:
            f.truncate(start + cut)


def parse_commit_lines(data: bytes, where: str) -> list[dict[str, Any]]:
    """The entries of whole done-log lines `data` (a file's, or a snapshot of one); a line that is
    not JSON is one CacheFormatError naming `where` and the entry."""
    entries = []
    for lineno, line in enumerate(data.splitlines(), 1):
        if line.strip():
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:
                raise CacheFormatError(f"{where}: done-log entry {lineno} is corrupt") from None
    return entries


def committed_rows(entries: list[dict[str, Any]]) -> dict[int, int]:
    """{bucket: rows} the committed samples of one writer's entries fill. A shard's entry may hold
    more rows (a sample that continues into a later shard is not committed yet); a resuming writer
    keeps exactly these."""
    rows: dict[int, int] = {}
    for e in entries:
        for _, length in e["samples"]:
            rows[e["bucket"]] = rows.get(e["bucket"], 0) + int(length)
    return rows

