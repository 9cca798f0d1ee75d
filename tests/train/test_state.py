import pytest

from train.state import TrainState


def test_the_first_stop_reason_is_the_one_reported():
    s = TrainState(step=10, epoch=1, in_epoch=3)
    assert s.stop == ""
    s.stopping("time limit")
    s.stopping("steps")  # the same step also ended the schedule: the time limit came first
    assert s.stop == "time limit"


def test_an_unknown_stop_reason_is_refused():
    with pytest.raises(ValueError, match="unknown stop reason"):
        TrainState().stopping("tired")
