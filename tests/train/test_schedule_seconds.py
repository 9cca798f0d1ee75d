"""--schedule-seconds and --time-limit over a fake clock: the cosine fitted to the seconds, a run made
in several processes planned as one, and held-out passes planned at a steady one's cost."""

from __future__ import annotations

import pytest

from tests.helpers import metric_rows, train_cfg, trainer_clock
from train.checkpoint import latest_checkpoint, load_checkpoint
from train.step import fitted_steps
from train.trainer import train


def held_out_clock(monkeypatch, now: list[float], *, cost: float, compile_s: float,
                   first_full_s: float = 0.0) -> list[int]:
    """Each held-out evaluation moves the fake clock `cost` seconds, and a process's first one
    (a new drafter's) `compile_s` more, what a process's first pass pays once; the first whole pass
    (not the warm-up's one micro-batch) `first_full_s` more, one-time costs the warm-up does not
    take; returns the batches each evaluation read."""
    import train.trainer as trainer

    real, seen, limits = trainer.evaluate_holdout, set(), []

    def timed(model, *args, **kwargs):
        first_full = kwargs.get("limit", 0) == 0 and 0 not in limits
        now[0] += cost + (compile_s if id(model) not in seen else 0.0) + (first_full_s if first_full else 0.0)
        seen.add(id(model))
        limits.append(kwargs.get("limit", 0))
        return real(model, *args, **kwargs)

    monkeypatch.setattr(trainer, "evaluate_holdout", timed)
    return limits


def test_schedule_seconds_fit_the_cosine_to_the_seconds_and_end_it_there(store, tmp_path, monkeypatch):
    # a clock that moves only in training steps, 1 s each: the first row (step 5, its steps hold the
    # compilation) marks the rate, the second (step 10) plans 10 + (60 - 10) / 1 = 60 steps of the 1,000
    # --max-steps allows; the run ends there with the cosine at 0, well before the time limit
    trainer_clock(monkeypatch, slow="forward_backward", cost=1.0)
    res = train(train_cfg(store, tmp_path / "s", max_steps=1000, schedule_seconds=60))
    rows = [r for r in metric_rows(tmp_path / "s") if "loss" in r]
    assert res["steps"] == 60 and not res["stopped_by_time"]
    assert [r.get("planned_steps") for r in rows[:3]] == [1000, 60, 60]
    assert rows[-1]["step"] == 60 and rows[-1]["lr"] < 1e-6 < rows[-2]["lr"]


def test_schedule_seconds_plans_each_held_out_pass_at_a_steady_ones_cost(store, tmp_path, monkeypatch):
    # steps 1 s, held-out passes 1 s, a process's first pass 10 s more: the first held-out micro-batch
    # runs before the first row, so the passes are planned at 1 s (not the compiling pass's 11) and
    # the plan made once one is timed holds to the end, which falls at the seconds' end
    now = trainer_clock(monkeypatch, slow="forward_backward", cost=1.0)
    limits = held_out_clock(monkeypatch, now, cost=1.0, compile_s=10.0)
    res = train(train_cfg(store, tmp_path / "s", max_steps=1000, schedule_seconds=120, val_samples=4,
                          val_every=10))
    assert limits[0] == 1 and set(limits[1:]) == {0}
    rows = [r for r in metric_rows(tmp_path / "s") if "loss" in r]
    later = {r["planned_steps"] for r in rows if r["step"] > 10}
    # 11 s before the first step; then each step 1 s and each of the passes at 10, 20, ... 1 s
    assert later == {res["steps"]} and res["steps"] == fitted_steps(0, 120 - 11 - 1, 1.0, pause_s=1.0,
                                                                     pause_every=10, cap=1000)
    assert rows[-1]["elapsed_s"] > 120 - 11


def test_a_first_pass_slower_than_the_rest_moves_the_plan_once(store, tmp_path, monkeypatch):
    # the first whole pass 5 s more than the steady 1 s (one-time costs the warm-up micro-batch does
    # not take): the passes are planned at the latest one's seconds, so the plan moves at the second
    # pass and then holds; planned at the longest, it crept up at every pass to come
    now = trainer_clock(monkeypatch, slow="forward_backward", cost=1.0)
    held_out_clock(monkeypatch, now, cost=1.0, compile_s=10.0, first_full_s=5.0)
    res = train(train_cfg(store, tmp_path / "s", max_steps=1000, schedule_seconds=150, val_samples=4,
                          val_every=10))
    rows = [r for r in metric_rows(tmp_path / "s") if "loss" in r]
    assert {r["planned_steps"] for r in rows if r["step"] > 20} == {res["steps"]}
    # 11 s before the first step, the first pass 6 s, the others 1 s; room for the longest is kept
    assert res["steps"] == fitted_steps(10, 150 - 11 - 10 - 6 - 6, 1.0, pause_s=1.0, pause_every=10, cap=1000)


def test_a_resumed_run_plans_its_passes_from_its_checkpoint(store, tmp_path, monkeypatch):
    # the run above cut by --time-limit: the checkpoint keeps the pass's seconds, so the resumed
    # process plans its passes from its first rows on; its plan never moves at its own first pass
    now = trainer_clock(monkeypatch, slow="forward_backward", cost=1.0)
    held_out_clock(monkeypatch, now, cost=1.0, compile_s=10.0)
    kw = dict(max_steps=1000, val_samples=4, val_every=10, checkpoint_every=10)
    first = train(train_cfg(store, tmp_path / "c", schedule_seconds=120, time_limit=50, **kw))
    assert first["stopped_by_time"]
    assert load_checkpoint(latest_checkpoint(tmp_path / "c"))[2]["pause_seconds"] == pytest.approx(1.0)
    res = train(train_cfg(store, tmp_path / "c", schedule_seconds=80, resume=True, **kw))
    rows = [r for r in metric_rows(tmp_path / "c") if "loss" in r and r["step"] > first["steps"]]
    # its first row follows the checkpoint's plan; from its second on, one plan to the end
    assert {r["planned_steps"] for r in rows[1:]} == {res["steps"]}


def test_a_resumed_schedule_seconds_run_follows_its_plan_not_the_cap(store, tmp_path, monkeypatch):
    # the 60-step plan of the test above, cut by --time-limit 30 and resumed with the seconds left: the
    # resumed process starts on the checkpoint's plan (not on the 1,000 steps --max-steps allows, which
    # would raise the lr of its first rows), so its rows read as those of one uninterrupted run
    trainer_clock(monkeypatch, slow="forward_backward", cost=1.0)
    whole = tmp_path / "whole"
    train(train_cfg(store, whole, max_steps=1000, schedule_seconds=60))
    cut = tmp_path / "cut"
    first = train(train_cfg(store, cut, max_steps=1000, schedule_seconds=60, time_limit=30, checkpoint_every=5))
    assert first["stopped_by_time"] and first["steps"] < 60
    assert load_checkpoint(latest_checkpoint(cut))[2]["planned_steps"] == 60
    res = train(train_cfg(store, cut, max_steps=1000, schedule_seconds=60 - first["steps"], resume=True))
    assert res["steps"] == 60
    lr = {r["step"]: r["lr"] for r in metric_rows(whole) if "loss" in r}
    rows = [r for r in metric_rows(cut) if "loss" in r and r["step"] > first["steps"]]
    assert rows and all(r["planned_steps"] == 60 for r in rows)
    for r in rows:
        assert r["lr"] == pytest.approx(lr[r["step"]], rel=1e-6, abs=1e-9), r["step"]
