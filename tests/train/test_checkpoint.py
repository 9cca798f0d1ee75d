"""Checkpoint directories: rotation, the best-so-far copy, and which one eval/export pick."""

from __future__ import annotations

import pytest
import torch

from train.checkpoint import (
    best_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    resolve_checkpoint,
    save_best,
    save_checkpoint,
)


def _model(value: float) -> torch.nn.Module:
    m = torch.nn.Linear(2, 2)
    torch.nn.init.constant_(m.weight, value)
    return m


def _save(run, step, value, keep=2):
    m = _model(value)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return save_checkpoint(run, step, model=m, optimizer=opt, scheduler=sched, state={"step": step}, keep=keep)


def test_rotation_keeps_the_newest_and_never_touches_best(tmp_path):
    save_best(tmp_path, 10, model=_model(10.0), state={"step": 10, "val_sim_tau": 2.0})
    for s in (10, 20, 30):
        _save(tmp_path, s, float(s))
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["best-10", "step-20", "step-30"]
    assert latest_checkpoint(tmp_path).name == "step-30"


def test_a_new_best_replaces_the_old_only_once_complete(tmp_path, monkeypatch):
    save_best(tmp_path, 10, model=_model(1.0), state={"step": 10, "val_sim_tau": 1.5})
    # a failure while the next best is written (a full disk): the old best is still the answer
    import train.checkpoint as ck

    def crash(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ck, "save_file", crash)
    with pytest.raises(ValueError, match=r"could not be written: .*best-20: disk full; the earlier checkpoints are untouched"):
        save_best(tmp_path, 20, model=_model(2.0), state={"step": 20, "val_sim_tau": 1.7})
    monkeypatch.undo()
    assert not (tmp_path / "checkpoints" / "best-20.partial").exists()  # a failed write cleans up after itself
    assert best_checkpoint(tmp_path).name == "best-10"
    save_best(tmp_path, 30, model=_model(3.0), state={"step": 30, "val_sim_tau": 1.8})
    assert best_checkpoint(tmp_path).name == "best-30"
    assert not (tmp_path / "checkpoints" / "best-10").exists()
    weights, opt, state = load_checkpoint(best_checkpoint(tmp_path))
    assert float(weights["weight"][0, 0]) == 3.0 and opt == {} and state["val_sim_tau"] == 1.8


def test_resolve_prefers_best_then_latest_and_names_the_run_when_empty(tmp_path):
    with pytest.raises(ValueError, match=str(tmp_path)):
        resolve_checkpoint(tmp_path)
    _save(tmp_path, 10, 1.0)
    _save(tmp_path, 20, 2.0)
    assert resolve_checkpoint(tmp_path).name == "step-20"  # no validation ran: the newest
    assert resolve_checkpoint(tmp_path, "latest").name == "step-20"
    with pytest.raises(ValueError, match="best"):
        resolve_checkpoint(tmp_path, "best")
    save_best(tmp_path, 10, model=_model(1.0), state={"step": 10, "val_sim_tau": 1.5})
    assert resolve_checkpoint(tmp_path).name == "best-10"
    assert resolve_checkpoint(tmp_path, "best").name == "best-10"
    assert resolve_checkpoint(tmp_path, "latest").name == "step-20"
    assert resolve_checkpoint(tmp_path, str(tmp_path / "checkpoints" / "step-20")).name == "step-20"
