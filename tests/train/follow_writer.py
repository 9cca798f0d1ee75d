"""A slow stage-one stand-in for the follow-mode test: commits in bursts, then finalizes."""

from __future__ import annotations

import sys
import time

from cache_format import ShardWriter, finalize_store
from cache_format.layout import read_manifest
from tests.helpers import make_sample

if __name__ == "__main__":
    path, total, bursts = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    m = read_manifest(path)
    with ShardWriter(path, writer_id=0) as w:
        for i in range(total):
            w.add(i, **make_sample(i, 24, m))
            if (i + 1) % (total // bursts) == 0:
                w.flush()  # commit what is there: a follower can train on it
                time.sleep(1.5)
    finalize_store(path, m)
