import pytest

from train.state import HeldOut, TrainState


def test_the_first_stop_reason_is_the_one_reported():
    s = TrainState(step=10, epoch=1, in_epoch=3)
    assert s.stop == ""
    s.stopping("time limit")
    s.stopping("steps")  # the same step also ended the schedule: the time limit came first
    assert s.stop == "time limit"


def test_an_unknown_stop_reason_is_refused():
    with pytest.raises(ValueError, match="unknown stop reason"):
        TrainState().stopping("tired")


def test_held_out_counts_evaluations_since_the_best_as_a_loop_does():
    scores = [0.5, 0.4, 0.7, 0.7, 0.6, 0.9, 0.1]
    held = HeldOut(ds=None, groups={}, by="val_decode_tau_96")
    best, stale = float("-inf"), 0
    for s in scores:
        new = held.note(s)
        stale += 1  # the loop: a new best resets the count, anything else adds one
        if s > best:
            best, stale = s, 0
        assert new == (stale == 0) and (held.best, held.stale) == (best, stale)
    assert (held.best, held.stale) == (0.9, 1)
