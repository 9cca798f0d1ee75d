"""One view of a growing store for all ranks (train.follow.agree_view), against a scripted reader."""

from __future__ import annotations

import numpy as np

from train.follow import agree_view


class ScriptedReader:
    """A reader whose store grows by one scripted state per refresh: (sample ids, finalized)."""

    def __init__(self, states: list[tuple[list[int], bool]]) -> None:
        self.states, self.at, self.refreshes = states, 0, 0

    def refresh(self) -> int:
        self.refreshes += 1
        self.at = min(self.at + 1, len(self.states) - 1)
        return 0

    @property
    def sample_ids(self) -> np.ndarray:
        return np.array(self.states[self.at][0], dtype=np.int64)

    @property
    def finalized(self) -> bool:
        return self.states[self.at][1]


def _solo(mine: list) -> list:
    return mine


def test_rank0_shares_what_it_holds_sorted():
    r = ScriptedReader([([], False), ([5, 1, 3], False), ([5, 1, 3, 9], False)])
    v = agree_view(r, rank=0, wait_final=False, share=_solo, poll_s=0)
    assert v.sample_ids.tolist() == [1, 3, 5] and not v.finalized and r.refreshes == 1


def test_rank0_waits_for_the_finalized_store_and_its_last_shards():
    # finalized is read before the refresh: the state that says "finalized" also brings the last samples
    r = ScriptedReader([([], False), ([1], False), ([1, 2], False), ([1, 2, 3], True)])
    v = agree_view(r, rank=0, wait_final=True, share=_solo, poll_s=0)
    assert v.sample_ids.tolist() == [1, 2, 3] and v.finalized


def test_a_lagging_rank_waits_until_it_holds_rank0s_samples():
    r = ScriptedReader([([], False), ([2], False), ([2, 4], False), ([2, 4, 7], False), ([2, 4, 7, 8], False)])
    v = agree_view(r, rank=1, wait_final=False, share=lambda mine: [np.array([2, 4, 7]), False], poll_s=0)
    assert v.sample_ids.tolist() == [2, 4, 7] and r.refreshes == 3  # not before the reader held sample 7


def test_a_rank_that_saw_more_plans_from_rank0s_set():
    r = ScriptedReader([([1, 2, 3], False), ([1, 2, 3, 4, 5], True)])
    v = agree_view(r, rank=1, wait_final=True, share=lambda mine: [np.array([1, 2, 3]), False], poll_s=0)
    assert v.sample_ids.tolist() == [1, 2, 3] and not v.finalized and r.refreshes == 1


def _dead_pid() -> int:
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_follower_gives_up_on_a_store_whose_writer_is_gone(tmp_path, capsys):
    import json
    import socket
    import time

    import pytest

    from cache_format.lock import lock_path, writer_gone
    from train.follow import WriterWatch

    store = tmp_path / "s.zarr"
    store.mkdir()
    assert writer_gone(store) is None  # no writer record: nothing is known
    rec = {"pid": _dead_pid(), "host": socket.gethostname(), "rank": 0, "since": "then"}
    lock_path(store).write_text(json.dumps(rec))
    assert "is gone" in writer_gone(store)
    r = ScriptedReader([([1, 2], False)])  # never finalized
    t0 = time.time()
    with pytest.raises(ValueError, match=r"writer \(pid \d+ .*\) is gone; gave up after 0.5 s"):
        agree_view(r, rank=0, wait_final=True, share=_solo, poll_s=0.05, watch=WriterWatch(store, 0.5))
    assert time.time() - t0 < 10
    said = [x for x in capsys.readouterr().out.splitlines() if "waiting for it to come back" in x]
    assert len(said) == 1 and "is gone" in said[0] and "s left (--follow-timeout)" in said[0]  # once, not per poll
    lock_path(store).write_text(json.dumps({**rec, "pid": __import__("os").getpid()}))  # a live writer
    assert writer_gone(store) is None
    lock_path(store).write_text(json.dumps({**rec, "host": "elsewhere"}))  # another host: not known here
    assert writer_gone(store) is None
