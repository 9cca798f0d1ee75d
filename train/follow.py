"""Training from a store that stage one is still writing (`--follow`): waiting for the store to
appear, and the one set of committed samples that every rank plans an epoch from."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cache_format import CacheFormatError, StoreReader
from cache_format.layout import FROZEN_FILE
from cache_format.lock import writer_gone
from cache_format.remote import is_url, lease_gone, object_sizes

__all__ = ["StoreView", "WriterWatch", "agree_view", "view_of", "wait_for_store"]


@dataclass(frozen=True)
class StoreView:
    """The samples an epoch is planned from."""

    sample_ids: np.ndarray  # [n] int64, sorted
    finalized: bool  # the store was finalized when these were read: nothing more will come


class WriterWatch:
    """Gives up on a store whose writer is gone: a follower waiting for samples or for the finalize
    that will never come stops with one line after `timeout` seconds (0 = waits forever). While it
    waits, it says what for (with `announce`): once when the writer is found gone, then every
    minute."""

    SAY_EVERY = 60.0

    def __init__(self, root: str | Path, timeout: float, announce: bool = True) -> None:
        self.root, self.timeout, self.announce = root, timeout, announce
        self.since, self.said = None, None

    def check(self) -> None:
        gone = lease_gone if is_url(self.root) else writer_gone
        why = gone(str(self.root)) if self.timeout else None
        if why is None:
            self.since = None
            return
        now = time.time()
        self.since = self.since or now
        if self.announce and (self.said is None or now - self.said >= self.SAY_EVERY):
            print(f"{self.root}: not finalized and {why}; waiting for it to come back, "
                  f"{max(0.0, self.timeout - (now - self.since)):.0f} s left (--follow-timeout)",
                  flush=True)
            self.said = now
        if now - self.since > self.timeout:
            raise ValueError(f"{self.root}: the store is not finalized and {why}; gave up after "
                             f"{self.timeout:g} s (--follow-timeout). Rerun the extraction to "
                             "finish it, then train")


def view_of(reader: StoreReader) -> StoreView:
    """What this process's reader holds now (a finalized store, or one rank)."""
    return StoreView(np.sort(reader.sample_ids), reader.finalized)


def wait_for_store(root: str | Path, *, announce: bool, poll_s: float = 1.0,
                   watch: WriterWatch | None = None) -> None:
    """Block until stage one has created the store and saved the frozen target parts (the last
    things it writes before any sample), so `make extract` and `make train --follow` can start
    together. `root` may be a URL: then both must be on the object server."""
    def there() -> bool:
        if is_url(root):
            try:
                have = object_sizes(str(root))
            except CacheFormatError:
                # not reachable yet, or nothing there: the watch decides when to give up
                return False
            return "zarr.json" in have and FROZEN_FILE in have
        return (Path(root) / "zarr.json").exists() and (Path(root) / FROZEN_FILE).exists()

    said = False
    while not there():
        if announce and not said:
            print(f"waiting for stage one to create {root} ...", flush=True)
            said = True
        if watch is not None:
            watch.check()
        time.sleep(poll_s)


def agree_view(reader: StoreReader, *, rank: int, wait_final: bool, share: Callable[[list], list],
               poll_s: float = 0.5, watch: WriterWatch | None = None) -> StoreView:
    """Rank 0's view of the store, once every rank's reader holds all of it.

    Ranks poll the store at different moments. Plans built from different committed sets give the
    ranks different steps, and DDP then hangs in an all-reduce that one rank never reaches. So rank
    0 refreshes (for the last epoch it first waits for the store to be finalized), `share` hands its
    view to every rank (dist.broadcast_object_list; the identity on one rank), and every other rank
    refreshes until its reader holds each of those samples. A rank that has seen more than rank 0
    plans from rank 0's set all the same.
    """
    if rank == 0:
        while True:
            # read before the refresh: a finalized store's last shards are then seen
            final = reader.finalized
            reader.refresh()
            if final or not wait_final:
                break
            if watch is not None:
                watch.check()
            time.sleep(poll_s)
        mine: list = [np.sort(reader.sample_ids), final]
    else:
        reader.refresh()
        mine = [None, None]
    ids, final = share(mine)
    while not np.isin(ids, reader.sample_ids).all():
        time.sleep(poll_s)
        reader.refresh()
    return StoreView(ids, bool(final))
