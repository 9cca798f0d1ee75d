"""Checkpoints and resume: bit-identical continuation, refusals of the wrong store, schedule or a
damaged checkpoint in one line, time limits, the best held-out checkpoint."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from tests.helpers import kill_after, metric_rows, train_cfg, trainer_clock
from train.checkpoint import best_checkpoint, latest_checkpoint, load_checkpoint
from train.config import TrainConfig
from train.trainer import Trainer, train


def test_resume_continues_identically(store, tmp_path):
    # budget 256: ~12 steps an epoch, so the next epoch's workers start mid-epoch (AHEAD_STEPS before its end)
    full = tmp_path / "full"
    train(train_cfg(store, full, max_steps=30, checkpoint_every=10, workers=2, token_budget=256))
    part = tmp_path / "part"
    train(train_cfg(store, part, max_steps=30, checkpoint_every=10, token_budget=256))
    # cut the second run back to its step-10 checkpoint, as if killed there, and resume
    kill_after(part, 10)
    # the rows logged after step 10 are dropped on resume (plus a torn line), so each step is logged once
    with open(part / "metrics.jsonl", "a") as f:
        f.write('{"step": 3')
    train(train_cfg(store, part, max_steps=30, checkpoint_every=10, resume=True, token_budget=256))
    a, b = metric_rows(full), metric_rows(part)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-4), (x["step"], x["loss"], y["loss"])
    wa, _, sa = load_checkpoint(latest_checkpoint(full))
    wb, _, sb = load_checkpoint(latest_checkpoint(part))
    assert sa["step"] == sb["step"] == 30
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)


def test_decode_aware_weights_train_and_resume_bit_identically(store, tmp_path):
    # the weights come from each step's own predictions: a resume must draw the same ones
    kw = dict(max_steps=20, checkpoint_every=10, position_weights="reach", visit_weight=1.0, val_samples=4,
              val_every=10)
    train(train_cfg(store, tmp_path / "full", **kw))
    part = tmp_path / "part"
    train(train_cfg(store, part, **kw))
    kill_after(part, 10)
    train(train_cfg(store, part, resume=True, **kw))
    a, b = metric_rows(tmp_path / "full"), metric_rows(part)
    assert [r.get("loss") for r in a] == [r.get("loss") for r in b]
    assert a[-2]["loss"] < a[0]["loss"] and "val_decode_tau" in a[-1]
    wa = load_checkpoint(latest_checkpoint(tmp_path / "full"))[0]
    wb = load_checkpoint(latest_checkpoint(part))[0]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    with pytest.raises(ValueError, match="position_weights"):
        train_cfg(store, tmp_path / "x", position_weights="flat")
    with pytest.raises(ValueError, match="visit_weight"):
        train_cfg(store, tmp_path / "x", visit_weight=float("inf"))
    with pytest.raises(ValueError, match="divergence must be one of"):
        train_cfg(store, tmp_path / "x", divergence="js")


def test_a_diverged_run_stops_naming_the_step_and_saves_nothing_after_it(store, tmp_path):
    out = tmp_path / "d"
    with pytest.raises(ValueError, match=r"diverged at step \d+"):
        train(train_cfg(store, out, max_steps=40, lr=1e35, clip=1e30, checkpoint_every=1, keep_checkpoints=50))
    from safetensors.torch import load_file

    for ck in (out / "checkpoints").glob("step-*"):  # whatever was saved is finite
        assert all(torch.isfinite(v).all() for v in load_file(str(ck / "model.safetensors")).values()), ck.name
    for bad in (dict(keep_checkpoints=0), dict(keep_checkpoints=-1), dict(lr=float("inf")), dict(clip=float("nan"))):
        with pytest.raises(ValueError, match="keep_checkpoints|lr must|clip must|lr and clip"):
            train_cfg(store, tmp_path / "x", **bad)


def test_a_checkpoint_missing_a_tensor_is_refused_on_resume(store, tmp_path):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "m"
    train(train_cfg(store, out, max_steps=10, checkpoint_every=10))
    ck = latest_checkpoint(out)
    w = load_file(str(ck / "model.safetensors"))
    w.pop(sorted(w)[0])
    save_file(w, str(ck / "model.safetensors"))
    (ck / "checksums.json").unlink()  # as a checkpoint put together by hand: the strict load is the check
    with pytest.raises(ValueError, match="do not fit this drafter"):
        train(train_cfg(store, out, max_steps=10, checkpoint_every=10, resume=True))


def test_resume_refuses_another_store_at_the_same_path(store, tmp_path):
    import dataclasses

    out, moved = tmp_path / "i", tmp_path / "moved.zarr"
    shutil.copytree(store, moved)
    train(train_cfg(str(moved), out, max_steps=10, checkpoint_every=10))
    # the same content under another path resumes (identity is content, not path) ...
    from cache_format.layout import MANIFEST_KEY, read_root_attrs, update_root_attrs
    from cache_format.schema import Manifest

    train(train_cfg(store, out, max_steps=10, checkpoint_every=5, resume=True))
    # ... a store replaced at the path by another dataset does not
    m = Manifest.from_dict(read_root_attrs(moved)[MANIFEST_KEY])
    other = dataclasses.replace(m, dataset=dataclasses.replace(m.dataset, sha256="f" * 64))
    update_root_attrs(moved, **{MANIFEST_KEY: other.to_dict()})
    from cache_format.checksums import record_checksums

    record_checksums(moved, other, finalized=True)  # a sound store in its own right, of another dataset
    with pytest.raises(ValueError, match="not the store it was trained on"):
        train(train_cfg(str(moved), out, max_steps=10, checkpoint_every=5, resume=True, verify_shards="off"))


def test_resume_refuses_a_changed_schedule_and_a_damaged_checkpoint_in_one_line(store, tmp_path):
    out = tmp_path / "s"
    train(train_cfg(store, out, max_steps=10, checkpoint_every=5))
    with pytest.raises(ValueError, match="schedule spans 10 steps, these options make it 20"):
        train(train_cfg(store, out, max_steps=20, checkpoint_every=5, resume=True))
    ck = latest_checkpoint(out)
    data = (ck / "optimizer.pt").read_bytes()
    (ck / "optimizer.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"optimizer.pt: checksum mismatch"):
        train(train_cfg(store, out, max_steps=10, checkpoint_every=5, resume=True))
    (ck / "checksums.json").unlink()  # without the list, the load itself names the truncated file
    with pytest.raises(ValueError, match=r"optimizer.pt: damaged or truncated") as e:
        train(train_cfg(store, out, max_steps=10, checkpoint_every=5, resume=True))
    assert "\n" not in str(e.value)


def test_a_flipped_byte_in_a_checkpoint_is_refused_and_an_earlier_one_can_be_named(store, tmp_path):
    kw = dict(max_steps=10, checkpoint_every=5, keep_checkpoints=10)
    train(train_cfg(store, tmp_path / "a", **kw))
    out = tmp_path / "b"
    train(train_cfg(store, out, **kw))
    w = out / "checkpoints" / "step-10" / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-3] ^= 0x01  # inside the last tensor's data: the file still parses
    w.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"step-10/model.safetensors: checksum mismatch .*--resume-from"):
        train(train_cfg(store, out, resume=True, **kw))
    train(train_cfg(store, out, resume=True, resume_from=str(out / "checkpoints" / "step-5"), **kw))
    assert (out / "checkpoints" / "step-10.superseded").is_dir()  # set aside, not deleted
    wa = load_checkpoint(latest_checkpoint(tmp_path / "a"))[0]
    wb = load_checkpoint(latest_checkpoint(out))[0]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)  # redone from step 5: the uninterrupted run's weights
    with pytest.raises(ValueError, match="pass --resume too"):
        train_cfg(store, out, resume_from=str(out / "checkpoints" / "step-5"))


def test_a_second_run_into_the_same_out_is_refused(store, tmp_path):
    from cache_format.lock import WriterLock

    out = tmp_path / "o"
    with WriterLock(out, what="run directory"):  # as a first run holds it for its life
        with pytest.raises(ValueError, match="another run is writing this run directory"):
            train(train_cfg(store, out, max_steps=2))
    train(train_cfg(store, out, max_steps=2))  # free again: the refused run left nothing behind


def test_time_limit_stops_at_a_logged_step_with_a_checkpoint_and_resume_finishes(store, tmp_path):
    out = tmp_path / "t"
    res = train(train_cfg(store, out, max_steps=20, time_limit=1e-6, val_samples=4, val_every=3))  # past it at row one
    assert res["stopped_by_time"] and res["steps"] == 5
    step_row, val_row = metric_rows(out)[-2:]  # the closing validation is labelled with its step's epoch
    assert val_row["step"] == step_row["step"] == 5 and val_row["epoch"] == step_row["epoch"] == 0
    _, _, saved = load_checkpoint(latest_checkpoint(out))
    assert saved["step"] == 5
    res = train(train_cfg(store, out, max_steps=20, resume=True, val_samples=4, val_every=3))
    assert not res["stopped_by_time"] and res["steps"] == 20
    assert [r["step"] for r in metric_rows(out) if "loss" in r] == [5, 10, 15, 20]


def test_time_limit_keeps_room_for_the_closing_held_out_pass(store, tmp_path, monkeypatch):
    # a clock that moves 0.01 s a reading and 100 s a held-out pass: with a 150 s limit, the pass at
    # step 3 leaves 50 s, too little for another pass, so the run stops at its next row (step 5), not at
    # step 10 (past the limit only after a second pass)
    import train.trainer as trainer

    scored = trainer.evaluate_holdout
    trainer_clock(monkeypatch, tick=0.01, slow="evaluate_holdout", cost=100.0)
    res = train(train_cfg(store, tmp_path / "t", max_steps=20, time_limit=150, val_samples=4, val_every=3))
    assert res["stopped_by_time"] and res["steps"] == 5
    monkeypatch.setattr(trainer, "evaluate_holdout", scored)  # no pass slower than the limit's room
    res = train(train_cfg(store, tmp_path / "u", max_steps=20, time_limit=150, val_samples=4, val_every=3))
    assert not res["stopped_by_time"] and res["steps"] == 20


def test_the_best_held_out_checkpoint_is_kept_and_survives_a_resume(store, tmp_path, monkeypatch):
    # scripted scores: the best comes at step 20; after a resume, scores below it must not replace it
    import train.trainer as trainer

    scored, scores = trainer.evaluate_holdout, iter([1.2, 1.5, 1.4, 1.3, 1.1])

    def scripted(*args, **kwargs):
        return {**scored(*args, **kwargs), "val_decode_tau": next(scores)}

    monkeypatch.setattr(trainer, "evaluate_holdout", scripted)
    out = tmp_path / "b"
    train(train_cfg(store, out, max_steps=50, val_samples=4, val_every=10, checkpoint_every=10, keep_checkpoints=10))
    best = best_checkpoint(out)
    assert best.name == "best-20"
    wb, _, sb = load_checkpoint(best)
    ws, _, _ = load_checkpoint(out / "checkpoints" / "step-20")
    assert sb["val_decode_tau"] == 1.5 and sb["step"] == 20 and "drafter" in sb
    for k in ws:
        torch.testing.assert_close(wb[k], ws[k], rtol=0, atol=0)
    # cut back to step 30, as if killed there, and resume: a fresh best score (-inf) would keep best-50
    kill_after(out, 30)
    scores = iter([1.45, 1.49])
    train(train_cfg(store, out, max_steps=50, val_samples=4, val_every=10, checkpoint_every=10, keep_checkpoints=10,
               resume=True))
    assert best_checkpoint(out).name == "best-20"


def test_damaged_run_directory_files_resume_or_fail_in_one_line_naming_the_file(store, tmp_path):
    """Each kind of run-directory file damaged, then --resume: the record files (metrics, TensorBoard
    events, the resolved config, the lock's holder record) never stop a run; a damaged best checkpoint
    is one line naming it."""
    from click.testing import CliRunner

    from train.__main__ import main as train_main

    out = tmp_path / "r"
    kw = dict(max_steps=10, checkpoint_every=5, val_samples=4, val_every=5, tensorboard=True)
    train(train_cfg(store, out, **kw))
    shutil.rmtree(out / "checkpoints" / "step-10")  # as if killed after step 5's checkpoint
    with open(out / "metrics.jsonl", "ab") as f:
        f.write(b'\xff\xfe not utf-8\n{"step": "x"}\n[1, 2]\n{"step": 3, "loss": ')  # and a torn last line
    (out / "config.toml").write_bytes(b"\x00garbage = = \n")
    (out / "RUN.lock").write_bytes(b"\xff{not json")
    for ev in (out / "tensorboard").rglob("events.*"):
        ev.write_bytes(b"\x00" * 17)
    args = ["--store", store, "--out", str(out), "--num-layers", "1", "--block-size", "4", "--num-anchors", "16",
            "--epochs", "200", "--token-budget", "512", "--lr", "3e-3", "--warmup", "0.05", "--log-every", "5",
            "--workers", "0", "--seed", "3", "--max-steps", "10", "--checkpoint-every", "5", "--val-samples", "4",
            "--val-every", "5", "--tensorboard", "--resume"]
    res = CliRunner().invoke(train_main, args)
    assert res.exit_code == 0 and "trained 10 steps" in res.output, res.output
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in rows}) == [5, 10] and (out / "loss.png").is_file()
    (best,) = (out / "checkpoints").glob("best-*")
    (best / "state.json").write_text('{"step": ')
    res = CliRunner().invoke(train_main, args)
    assert res.exit_code == 2 and f"{best.name}/state.json" in res.output and "Traceback" not in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1


def test_a_checkpoint_older_than_a_config_field_resumes_as_its_default(tmp_path):
    """A field added since the checkpoint was written counts as its default; a real change is refused."""
    from train.start import check_resume

    cfg = TrainConfig(store=str(tmp_path / "s"), out=str(tmp_path / "r"))
    saved = {"store_identity": "x", "config": {k: v for k, v in cfg.to_dict().items() if k != "node_affine"}}
    check_resume(cfg, saved, "x")
    with pytest.raises(ValueError, match="node_affine: checkpoint has False, now True"):
        check_resume(dataclasses.replace(cfg, node_affine=True), saved, "x")


def test_building_a_trainer_touches_no_checkpoint_and_resume_refuses_a_used_run(store, tmp_path):
    out = tmp_path / "r"
    train(train_cfg(store, out, max_steps=4, checkpoint_every=2, token_budget=256))
    files = lambda: {str(p.relative_to(out)): p.stat().st_mtime_ns for p in out.rglob("*")}
    before = files()
    trainer = Trainer(train_cfg(store, out, max_steps=4, token_budget=256))  # no --resume
    assert files() == before  # the constructor neither refused the used run nor wrote into it
    with pytest.raises(ValueError, match="holds checkpoints of an earlier run: pass --resume"):
        trainer.resume()
    assert files() == before
