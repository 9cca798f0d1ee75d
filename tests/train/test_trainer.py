"""Stage two end to end on a tiny store: learning, resume equivalence, DDP equivalence, refusals."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from extract.config import ExtractConfig
from extract.run import run as extract
from tests.helpers import metric_rows, tiny_target_dir, write_chats
from train.checkpoint import best_checkpoint, latest_checkpoint, load_checkpoint
from train.config import TrainConfig
from train.trainer import train

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    target = tiny_target_dir(d / "t", "qwen3")
    data = write_chats(d / "chats.jsonl", 24, cyclic=True)
    path = d / "s.zarr"
    extract(ExtractConfig(store=str(path), target=target, data=data, layers=(0, 2, 4), max_len=256,
                          min_supervised=4, token_budget=1024, rows_per_shard=256))
    return str(path)


def _cfg(store, out, **kw):
    args = dict(store=store, out=str(out), num_layers=1, block_size=4, num_anchors=16, epochs=200, token_budget=512,
                lr=3e-3, warmup=0.05, log_every=5, workers=0, seed=3)
    args.update(kw)
    return TrainConfig(**args)


def _kill_after(run, step):
    """Leave `run` as a run killed just after its step-`step` checkpoint: the later step-N go."""
    for ck in (Path(run) / "checkpoints").glob("step-*"):
        if int(ck.name[5:]) > step:
            shutil.rmtree(ck)


def test_loss_falls_well_below_start(store, tmp_path):
    train(_cfg(store, tmp_path / "r", max_steps=300))
    rows = metric_rows(tmp_path / "r")
    assert rows[-1]["loss"] < 0.5 * rows[0]["loss"], (rows[0]["loss"], rows[-1]["loss"])
    assert rows[-1]["sim_tau"] > rows[0]["sim_tau"]
    assert {"step", "epoch", "loss", "lr", "acc", "sim_tau", "positions_per_s", "data_wait_frac"} <= set(rows[-1])
    assert len(rows[-1]["acc"]) == 3 and (tmp_path / "r" / "loss.png").exists() and (tmp_path / "r" / "sim_tau.png").exists()


def test_resume_continues_identically(store, tmp_path):
    # budget 256: ~12 steps an epoch, so the next epoch's workers start mid-epoch (AHEAD_STEPS before its end)
    full = tmp_path / "full"
    train(_cfg(store, full, max_steps=30, checkpoint_every=10, workers=2, token_budget=256))
    part = tmp_path / "part"
    train(_cfg(store, part, max_steps=30, checkpoint_every=10, token_budget=256))
    # cut the second run back to its step-10 checkpoint, as if killed there, and resume
    _kill_after(part, 10)
    # the rows logged after step 10 are dropped on resume (plus a torn line), so each step is logged once
    with open(part / "metrics.jsonl", "a") as f:
        f.write('{"step": 3')
    train(_cfg(store, part, max_steps=30, checkpoint_every=10, resume=True, token_budget=256))
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
    train(_cfg(store, tmp_path / "full", **kw))
    part = tmp_path / "part"
    train(_cfg(store, part, **kw))
    _kill_after(part, 10)
    train(_cfg(store, part, resume=True, **kw))
    a, b = metric_rows(tmp_path / "full"), metric_rows(part)
    assert [r.get("loss") for r in a] == [r.get("loss") for r in b]
    assert a[-2]["loss"] < a[0]["loss"] and "val_decode_tau" in a[-1]
    wa = load_checkpoint(latest_checkpoint(tmp_path / "full"))[0]
    wb = load_checkpoint(latest_checkpoint(part))[0]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    with pytest.raises(ValueError, match="position_weights"):
        _cfg(store, tmp_path / "x", position_weights="flat")
    with pytest.raises(ValueError, match="visit_weight"):
        _cfg(store, tmp_path / "x", visit_weight=float("inf"))
    with pytest.raises(ValueError, match="divergence must be one of"):
        _cfg(store, tmp_path / "x", divergence="js")


def test_a_diverged_run_stops_naming_the_step_and_saves_nothing_after_it(store, tmp_path):
    out = tmp_path / "d"
    with pytest.raises(ValueError, match=r"diverged at step \d+"):
        train(_cfg(store, out, max_steps=40, lr=1e35, clip=1e30, checkpoint_every=1, keep_checkpoints=50))
    from safetensors.torch import load_file

    for ck in (out / "checkpoints").glob("step-*"):  # whatever was saved is finite
        assert all(torch.isfinite(v).all() for v in load_file(str(ck / "model.safetensors")).values()), ck.name
    for bad in (dict(keep_checkpoints=0), dict(keep_checkpoints=-1), dict(lr=float("inf")), dict(clip=float("nan"))):
        with pytest.raises(ValueError, match="keep_checkpoints|lr and clip"):
            _cfg(store, tmp_path / "x", **bad)


def test_a_checkpoint_missing_a_tensor_is_refused_on_resume(store, tmp_path):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "m"
    train(_cfg(store, out, max_steps=10, checkpoint_every=10))
    ck = latest_checkpoint(out)
    w = load_file(str(ck / "model.safetensors"))
    w.pop(sorted(w)[0])
    save_file(w, str(ck / "model.safetensors"))
    (ck / "checksums.json").unlink()  # as a checkpoint put together by hand: the strict load is the check
    with pytest.raises(ValueError, match="do not fit this drafter"):
        train(_cfg(store, out, max_steps=10, checkpoint_every=10, resume=True))


def test_resume_refuses_another_store_at_the_same_path(store, tmp_path):
    import dataclasses

    out, moved = tmp_path / "i", tmp_path / "moved.zarr"
    shutil.copytree(store, moved)
    train(_cfg(str(moved), out, max_steps=10, checkpoint_every=10))
    # the same content under another path resumes (identity is content, not path) ...
    from cache_format.layout import MANIFEST_KEY, read_root_attrs, update_root_attrs
    from cache_format.schema import Manifest

    train(_cfg(store, out, max_steps=10, checkpoint_every=5, resume=True))
    # ... a store replaced at the path by another dataset does not
    m = Manifest.from_dict(read_root_attrs(moved)[MANIFEST_KEY])
    other = dataclasses.replace(m, dataset=dataclasses.replace(m.dataset, sha256="f" * 64))
    update_root_attrs(moved, **{MANIFEST_KEY: other.to_dict()})
    from cache_format.checksums import record_checksums

    record_checksums(moved, other, finalized=True)  # a sound store in its own right, of another dataset
    with pytest.raises(ValueError, match="not the store it was trained on"):
        train(_cfg(str(moved), out, max_steps=10, checkpoint_every=5, resume=True, verify_shards="off"))


def test_resume_refuses_a_changed_schedule_and_a_damaged_checkpoint_in_one_line(store, tmp_path):
    out = tmp_path / "s"
    train(_cfg(store, out, max_steps=10, checkpoint_every=5))
    with pytest.raises(ValueError, match="schedule spans 10 steps, these options make it 20"):
        train(_cfg(store, out, max_steps=20, checkpoint_every=5, resume=True))
    ck = latest_checkpoint(out)
    data = (ck / "optimizer.pt").read_bytes()
    (ck / "optimizer.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"optimizer.pt: checksum mismatch"):
        train(_cfg(store, out, max_steps=10, checkpoint_every=5, resume=True))
    (ck / "checksums.json").unlink()  # without the list, the load itself names the truncated file
    with pytest.raises(ValueError, match=r"optimizer.pt: damaged or truncated") as e:
        train(_cfg(store, out, max_steps=10, checkpoint_every=5, resume=True))
    assert "\n" not in str(e.value)


def test_a_flipped_byte_in_a_checkpoint_is_refused_and_an_earlier_one_can_be_named(store, tmp_path):
    kw = dict(max_steps=10, checkpoint_every=5, keep_checkpoints=10)
    train(_cfg(store, tmp_path / "a", **kw))
    out = tmp_path / "b"
    train(_cfg(store, out, **kw))
    w = out / "checkpoints" / "step-10" / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-3] ^= 0x01  # inside the last tensor's data: the file still parses
    w.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"step-10/model.safetensors: checksum mismatch .*--resume-from"):
        train(_cfg(store, out, resume=True, **kw))
    train(_cfg(store, out, resume=True, resume_from=str(out / "checkpoints" / "step-5"), **kw))
    assert (out / "checkpoints" / "step-10.superseded").is_dir()  # set aside, not deleted
    wa = load_checkpoint(latest_checkpoint(tmp_path / "a"))[0]
    wb = load_checkpoint(latest_checkpoint(out))[0]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)  # redone from step 5: the uninterrupted run's weights
    with pytest.raises(ValueError, match="pass --resume too"):
        _cfg(store, out, resume_from=str(out / "checkpoints" / "step-5"))


def test_a_second_run_into_the_same_out_is_refused(store, tmp_path):
    from cache_format.lock import StoreLock

    out = tmp_path / "o"
    with StoreLock(out, what="run directory"):  # as a first run holds it for its life
        with pytest.raises(ValueError, match="another run is writing this run directory"):
            train(_cfg(store, out, max_steps=2))
    train(_cfg(store, out, max_steps=2))  # free again: the refused run left nothing behind


def test_time_limit_stops_at_a_logged_step_with_a_checkpoint_and_resume_finishes(store, tmp_path):
    out = tmp_path / "t"
    res = train(_cfg(store, out, max_steps=20, time_limit=1e-6, val_samples=4, val_every=3))  # past it at row one
    assert res["stopped_by_time"] and res["steps"] == 5
    step_row, val_row = metric_rows(out)[-2:]  # the closing validation is labelled with its step's epoch
    assert val_row["step"] == step_row["step"] == 5 and val_row["epoch"] == step_row["epoch"] == 0
    _, _, saved = load_checkpoint(latest_checkpoint(out))
    assert saved["step"] == 5
    res = train(_cfg(store, out, max_steps=20, resume=True, val_samples=4, val_every=3))
    assert not res["stopped_by_time"] and res["steps"] == 20
    assert [r["step"] for r in metric_rows(out) if "loss" in r] == [5, 10, 15, 20]


def test_tensorboard_events_carry_the_metric_rows_and_a_resume_purges_past_its_checkpoint(store, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "tb"
    train(_cfg(store, out, max_steps=15, checkpoint_every=10, tensorboard=True))
    _kill_after(out, 10)
    train(_cfg(store, out, max_steps=15, checkpoint_every=10, tensorboard=True, resume=True))
    ev = EventAccumulator(str(out / "tensorboard"))
    ev.Reload()
    rows = [r for r in metric_rows(out) if "loss" in r]
    got = [(e.step, e.value) for e in ev.Scalars("loss")]
    assert [s for s, _ in got] == [r["step"] for r in rows] == [5, 10, 15]  # step 15 once, though logged twice
    assert [v for _, v in got] == pytest.approx([r["loss"] for r in rows])
    assert [e.value for e in ev.Scalars("acc/1")] == pytest.approx([r["acc"][0] for r in rows])


def test_logging_flags_name_the_missing_package(store, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("wandb", "tensorboard") else real(name, *a))
    for flag in ("wandb", "tensorboard"):
        with pytest.raises(ValueError, match=f"--{flag} needs the {flag} package: pip install {flag}"):
            _cfg(store, tmp_path / "x", **{flag: True})


def test_refusals(store, tmp_path):
    with pytest.raises(ValueError, match=r"layer ids \[7\] are not stored"):
        train(_cfg(store, tmp_path / "a", layers=(0, 7)))
    train(_cfg(store, tmp_path / "b", max_steps=2))
    with pytest.raises(ValueError, match="earlier run: pass --resume"):  # eval would pick the old run's step-2
        train(_cfg(store, tmp_path / "b", max_steps=1))
    with pytest.raises(ValueError, match="config differs.*num_layers"):
        train(_cfg(store, tmp_path / "b", max_steps=4, num_layers=2, resume=True))
    # too few micro-batches for one step: refused, not "trained 0 steps"
    with pytest.raises(ValueError, match="fewer micro-batches of --token-budget"):
        train(_cfg(store, tmp_path / "d", grad_accum=10_000))
    # an unfinalized store is refused without --follow
    meta = Path(store) / "zarr.json"
    doc = json.loads(meta.read_text())
    doc["attributes"]["draftcache_state"]["finalized"] = False
    old = meta.read_text()
    meta.write_text(json.dumps(doc))
    try:
        with pytest.raises(ValueError, match="not finalized"):
            train(_cfg(store, tmp_path / "c"))
    finally:
        meta.write_text(old)


@pytest.mark.slow
# bf16: gradients rounded to 8 mantissa bits; under Adam a rounded tiny gradient can move a weight by
# up to 2 x lr (3e-3) a step (the exact mean is checked by test_bf16_gradient_reduce_...)
@pytest.mark.parametrize("reduce,rtol,atol", [("fp32", 1e-3, 1e-4), ("bf16", 2e-2, 1e-2)])
def test_two_rank_ddp_matches_one_rank_same_global_batch(store, tmp_path, reduce, rtol, atol):
    one = tmp_path / "one"
    train(_cfg(store, one, max_steps=10, grad_accum=2))
    two = tmp_path / "two"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    args = ["--store", store, "--out", str(two), "--num-layers", "1", "--block-size", "4", "--num-anchors", "16",
            "--epochs", "200", "--token-budget", "512", "--lr", "3e-3", "--warmup", "0.05", "--log-every", "5",
            "--workers", "0", "--seed", "3", "--max-steps", "10", "--grad-reduce", reduce]
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "train", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    for x, y in zip(metric_rows(one), metric_rows(two)):
        assert x["loss"] == pytest.approx(y["loss"], rel=rtol)
    wa, _, _ = load_checkpoint(latest_checkpoint(one))
    wb, _, _ = load_checkpoint(latest_checkpoint(two))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=rtol, atol=atol)


@pytest.mark.slow
def test_follow_mode_trains_while_stage_one_writes(tmp_path):
    # both stages start together (as `make extract & make train --follow`): the trainer waits for
    # the store to exist, trains on committed shards, and its last epoch sees the finalized store
    path = tmp_path / "s.zarr"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    writer = subprocess.Popen([sys.executable, "-m", "tests.train.follow_writer", str(path), "60", "4"], cwd=ROOT, env=env)
    try:
        res = train(TrainConfig(store=str(path), out=str(tmp_path / "run"), num_layers=1, block_size=4, num_anchors=8,
                                epochs=3, token_budget=128, log_every=1, workers=0, follow=True))
    finally:
        writer.wait(60)
    assert writer.returncode == 0
    assert res["finalized"] and res["samples_last_epoch"] == 60  # the last epoch saw the whole store
    rows = metric_rows(tmp_path / "run")
    assert rows and rows[0]["epoch"] == 0 and rows[-1]["epoch"] == 2


def test_two_rank_follow_mode_agrees_on_the_growing_store(tmp_path):
    # the agreed view end to end (2 gloo ranks, DataLoader workers, next epoch planned ahead): both ranks
    # finish, the last epoch on the finalized store. Whether unagreed ranks would diverge here depends
    # on timing, so the race itself is tested in test_follow.py against a scripted reader.
    path = tmp_path / "s.zarr"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    writer = subprocess.Popen([sys.executable, "-m", "tests.train.follow_writer", str(path), "60", "4"], cwd=ROOT, env=env)
    args = ["--store", str(path), "--out", str(tmp_path / "run"), "--num-layers", "1", "--block-size", "4",
            "--num-anchors", "8", "--epochs", "3", "--token-budget", "128", "--log-every", "1", "--workers", "1",
            "--follow"]
    try:
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            "-m", "train", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    finally:
        writer.wait(60)
    assert writer.returncode == 0 and p.returncode == 0, p.stderr[-3000:]
    rows = metric_rows(tmp_path / "run")
    assert rows[0]["epoch"] == 0 and rows[-1]["epoch"] == 2


@pytest.mark.slow
def test_compiled_layers_train_like_eager(store, tmp_path):
    # --compile fuses the layers with inductor (CPU here): same losses, and checkpoints keep the eager names
    train(_cfg(store, tmp_path / "eager", max_steps=6, checkpoint_every=6, log_every=1))
    train(_cfg(store, tmp_path / "comp", max_steps=6, checkpoint_every=6, log_every=1, compile=True))
    a, b = metric_rows(tmp_path / "eager"), metric_rows(tmp_path / "comp")
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) < 1e-3 * abs(x["loss"]), (x["loss"], y["loss"])
    wa = load_checkpoint(latest_checkpoint(tmp_path / "eager"))[0]
    wb = load_checkpoint(latest_checkpoint(tmp_path / "comp"))[0]
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("loss,divergence", [("ce", "kl"), ("mix", "kl"), ("mix", "tv")])
def test_held_out_samples_are_scored_and_improve(store, tmp_path, loss, divergence):
    # mix also runs the KL and TV paths end to end: bf16 teacher states from the store, float32 on CPU
    train(_cfg(store, tmp_path / "v", max_steps=60, val_samples=4, val_every=20, loss=loss, divergence=divergence))
    rows = metric_rows(tmp_path / "v")
    val = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in val] == [20, 40, 60]
    assert val[-1]["val_loss"] < val[0]["val_loss"] and len(val[-1]["val_acc"]) == 3
    assert all("loss" in r for r in rows if "val_loss" not in r)  # training rows are unchanged
    assert all(1.0 <= r["val_decode_tau"] <= 4 for r in val)  # at most block_size (4); agreement: test_eval
    top = max(val, key=lambda r: r["val_decode_tau"])  # the first of equal scores: only a gain replaces the best
    state = json.loads((best_checkpoint(tmp_path / "v") / "state.json").read_text())
    assert (state["step"], state["val_decode_tau"]) == (top["step"], top["val_decode_tau"])
    with pytest.raises(ValueError, match="follow"):
        _cfg(store, tmp_path / "w", val_samples=4, follow=True)


def test_validation_time_is_not_in_the_training_rate(store, tmp_path, monkeypatch):
    # a slow held-out pass (1.5 s, ~10x a row of 5 tiny steps) must not show as slow training in the next row
    import time

    import train.trainer as trainer

    scored = trainer.evaluate_holdout

    def slow(*args, **kwargs):
        time.sleep(1.5)
        return scored(*args, **kwargs)

    monkeypatch.setattr(trainer, "evaluate_holdout", slow)
    train(_cfg(store, tmp_path / "v", max_steps=15, val_samples=4, val_every=10))
    rate = {r["step"]: r["positions_per_s"] for r in metric_rows(tmp_path / "v") if "positions_per_s" in r}
    assert rate[15] > 0.3 * rate[10], rate  # without the exclusion: ~0.1


def test_bf16_gradient_reduce_is_on_the_wire_only_when_asked():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "tests.train.ddp_reduce_probe"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got == {"fp32": 1 + 2 ** -10, "bf16": 1.0}


def test_cli_maps_one_to_one_onto_the_config():
    import dataclasses

    from train.__main__ import main

    # every field an option, and beyond them only the config-file pair
    assert {p.name for p in main.params} == {f.name for f in dataclasses.fields(TrainConfig)} | {"config", "print_config"}


def test_the_best_held_out_checkpoint_is_kept_and_survives_a_resume(store, tmp_path, monkeypatch):
    # scripted scores: the best comes at step 20; after a resume, scores below it must not replace it
    import train.trainer as trainer

    scored, scores = trainer.evaluate_holdout, iter([1.2, 1.5, 1.4, 1.3, 1.1])

    def scripted(*args, **kwargs):
        return {**scored(*args, **kwargs), "val_decode_tau": next(scores)}

    monkeypatch.setattr(trainer, "evaluate_holdout", scripted)
    out = tmp_path / "b"
    train(_cfg(store, out, max_steps=50, val_samples=4, val_every=10, checkpoint_every=10, keep_checkpoints=10))
    best = best_checkpoint(out)
    assert best.name == "best-20"
    wb, _, sb = load_checkpoint(best)
    ws, _, _ = load_checkpoint(out / "checkpoints" / "step-20")
    assert sb["val_decode_tau"] == 1.5 and sb["step"] == 20 and "drafter" in sb
    for k in ws:
        torch.testing.assert_close(wb[k], ws[k], rtol=0, atol=0)
    # cut back to step 30, as if killed there, and resume: a fresh best score (-inf) would keep best-50
    _kill_after(out, 30)
    scores = iter([1.45, 1.49])
    train(_cfg(store, out, max_steps=50, val_samples=4, val_every=10, checkpoint_every=10, keep_checkpoints=10,
               resume=True))
    assert best_checkpoint(out).name == "best-20"


def test_patience_stops_after_evaluations_without_a_new_best(store, tmp_path, monkeypatch):
    import train.trainer as trainer

    scored, scores = trainer.evaluate_holdout, iter([1.2, 1.5, 1.4, 1.3, 1.1, 1.0])

    def scripted(*args, **kwargs):
        return {**scored(*args, **kwargs), "val_decode_tau": next(scores)}

    monkeypatch.setattr(trainer, "evaluate_holdout", scripted)
    out = tmp_path / "p"
    res = train(_cfg(store, out, max_steps=60, val_samples=4, val_every=10, patience=2))
    assert res["steps"] == 40 and res["stopped_early"]  # 1.4 at 30 and 1.3 at 40: two without a gain
    assert [r["step"] for r in metric_rows(out) if "val_loss" in r] == [10, 20, 30, 40]
    assert best_checkpoint(out).name == "best-20" and latest_checkpoint(out).name == "step-40"
    with pytest.raises(ValueError, match="patience"):
        _cfg(store, out, patience=2)  # nothing held out to be patient about


def test_the_last_steps_are_logged_when_the_epochs_end_between_log_rows(store, tmp_path):
    """Epochs end the run before --max-steps and off a --log-every step: a row still covers the tail."""
    res = train(_cfg(store, tmp_path / "r", epochs=1, max_steps=1000, log_every=1000))
    assert 0 < res["steps"] < 1000 and [r["step"] for r in metric_rows(tmp_path / "r")] == [res["steps"]]
    n = res["steps"]
    res = train(_cfg(store, tmp_path / "r2", epochs=2, max_steps=1000, log_every=n + 1))
    assert [r["step"] for r in metric_rows(tmp_path / "r2")] == [n + 1, res["steps"]] and res["steps"] > n + 1


def test_damaged_run_directory_files_resume_or_fail_in_one_line_naming_the_file(store, tmp_path):
    """Each kind of run-directory file damaged, then --resume: the record files (metrics, TensorBoard
    events, the resolved config, the lock's holder record) never stop a run; a damaged best checkpoint
    is one line naming it."""
    from click.testing import CliRunner

    from train.__main__ import main as train_main

    out = tmp_path / "r"
    kw = dict(max_steps=10, checkpoint_every=5, val_samples=4, val_every=5, tensorboard=True)
    train(_cfg(store, out, **kw))
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


def test_follow_mode_trains_from_object_storage_while_stage_one_mirrors(tmp_path, object_server, monkeypatch):
    """train --follow on a URL: the trainer waits for the store to appear on the object server, trains
    on what the writer's mirror has pushed, and its last epoch sees the finalized store."""
    monkeypatch.setenv("DRAFTCACHE_STORE_CACHE", str(tmp_path / "cache"))
    url = object_server()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    writer = subprocess.Popen([sys.executable, "-m", "tests.train.follow_writer", url, "60", "4", str(tmp_path / "stage")],
                              cwd=ROOT, env=env)
    try:
        res = train(TrainConfig(store=url, out=str(tmp_path / "run"), num_layers=1, block_size=4, num_anchors=8,
                                epochs=3, token_budget=128, log_every=1, workers=1, follow=True))
    finally:
        writer.wait(60)
    assert writer.returncode == 0
    assert res["finalized"] and res["samples_last_epoch"] == 60
    rows = metric_rows(tmp_path / "run")
    assert rows and rows[0]["epoch"] == 0 and rows[-1]["epoch"] == 2


def test_a_checkpoint_older_than_a_config_field_resumes_as_its_default(tmp_path):
    """A field added since the checkpoint was written counts as its default; a real change is refused."""
    from train.start import check_resume

    cfg = TrainConfig(store=str(tmp_path / "s"), out=str(tmp_path / "r"))
    saved = {"store_identity": "x", "config": {k: v for k, v in cfg.to_dict().items() if k != "node_affine"}}
    check_resume(cfg, saved, "x")
    with pytest.raises(ValueError, match="node_affine: checkpoint has False, now True"):
        check_resume(dataclasses.replace(cfg, node_affine=True), saved, "x")
