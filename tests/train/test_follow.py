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
