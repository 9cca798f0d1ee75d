"""What a failed write says: the cause named (no space left, a file-size limit, permissions, a
quota) with the file, in one line, in place of the library's own words (torch's checkpoint writer
reports a full disk as "unexpected pos ...", a size limit reaches Python as "[Errno 27] File too
large")."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

__all__ = ["WRITE_LIMITS", "write_failure"]

# the errnos of a write that ran into a limit (room, size, quota, a read-only mount), not a failed
# read
WRITE_LIMITS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS)

# below this much free space a write that failed without an errno (torch's zip writer) failed for
# room
LOW_SPACE = 64 * 2**20

_CAUSES = {
    errno.ENOSPC: "no space left on its device",
    errno.EFBIG: "file too large for a file-size limit (ulimit -f) or the file system",
    errno.EDQUOT: "disk quota exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
}


def _os_error(e: BaseException) -> OSError | None:
    """The OSError in e's chain of causes, if any."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError) and e.errno is not None:
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _free(path: Path) -> int | None:
    """Free bytes on the device of path (or of its nearest existing parent); None if unknown."""
    for p in (path, *path.parents):
        if p.exists():
            try:
                return shutil.disk_usage(p).free
            except OSError:
                return None
    return None


def write_failure(e: BaseException, path: str | os.PathLike) -> str:
    """One line for a failed write of `path`: '{path}: {cause}', the cause from the errno in e's
    chain, or from the free space left where e carries none; else e's own first line."""
    path = Path(path)
    err = _os_error(e)
    free = _free(path)
    room = f" ({free / 2**20:,.0f} MiB free)" if free is not None else ""
    if err is not None and err.errno in _CAUSES:
        return f"{path}: {_CAUSES[err.errno]}" + (room if err.errno == errno.ENOSPC else "")
    if free is not None and free < LOW_SPACE:
        return f"{path}: {_CAUSES[errno.ENOSPC]}{room}"
    text = " ".join(str(e).split())[:200] or type(e).__name__
    return f"{path}: {text}"
