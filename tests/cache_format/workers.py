"""Functions run in spawned writer processes by the store tests (importable by the child)."""

from __future__ import annotations

import os
import signal

from cache_format import Manifest, ShardWriter
from tests.helpers import make_sample, sample_length


def write_part(path: str, manifest: dict, writer_id: int, ids: list[int]) -> None:
    m = Manifest.from_dict(manifest)
    with ShardWriter(path, writer_id=writer_id) as w:
        for i in ids:
            if i not in w.committed:
                w.add(i, **make_sample(i, sample_length(i, m.max_len), m))


def write_then_die(path: str, manifest: dict, ids: list[int], die_after: int) -> None:
    """Write `die_after` samples, then SIGKILL ourselves without closing (mid-shard)."""
    m = Manifest.from_dict(manifest)
    w = ShardWriter(path, writer_id=0)
    for n, i in enumerate(ids):
        if n == die_after:
            os.kill(os.getpid(), signal.SIGKILL)
        w.add(i, **make_sample(i, sample_length(i, m.max_len), m))
