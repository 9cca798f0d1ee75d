"""Stage two end to end on a tiny store: learning, resume equivalence, DDP equivalence, refusals."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import kill_after, metric_rows, train_cfg
from train.checkpoint import best_checkpoint, latest_checkpoint, load_checkpoint
from train.config import TrainConfig
from train.model import compile_options
from train.trainer import train

ROOT = Path(__file__).resolve().parents[2]


def test_loss_falls_well_below_start(store, tmp_path):
    train(train_cfg(store, tmp_path / "r", max_steps=300))
    rows = metric_rows(tmp_path / "r")
    assert rows[-1]["loss"] < 0.5 * rows[0]["loss"], (rows[0]["loss"], rows[-1]["loss"])
    assert rows[-1]["sim_tau"] > rows[0]["sim_tau"]
    assert {"step", "epoch", "loss", "lr", "acc", "sim_tau", "positions_per_s", "data_wait_frac",
            "elapsed_s"} <= set(rows[-1])
    # the process's wall clock, one per row, only grows
    walls = [r["elapsed_s"] for r in rows]
    assert walls == sorted(walls) and walls[0] > 0
    assert len(rows[-1]["acc"]) == 3 and (tmp_path / "r" / "loss.png").exists() and (tmp_path / "r" / "sim_tau.png").exists()


def test_tensorboard_events_carry_the_metric_rows_and_a_resume_purges_past_its_checkpoint(store, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "tb"
    train(train_cfg(store, out, max_steps=15, checkpoint_every=10, tensorboard=True))
    kill_after(out, 10)
    train(train_cfg(store, out, max_steps=15, checkpoint_every=10, tensorboard=True, resume=True))
    ev = EventAccumulator(str(out / "tensorboard"))
    ev.Reload()
    rows = [r for r in metric_rows(out) if "loss" in r]
    got = [(e.step, e.value) for e in ev.Scalars("loss")]
    assert [s for s, _ in got] == [r["step"] for r in rows] == [5, 10, 15]  # step 15 once, though logged twice
    assert [v for _, v in got] == pytest.approx([r["loss"] for r in rows])
    assert [e.value for e in ev.Scalars("acc/1")] == pytest.approx([r["acc"][0] for r in rows])


def test_tensorboard_carries_each_domain_of_a_held_out_row(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from train.metrics import MetricsLog

    log = MetricsLog(tmp_path, True, tensorboard=True)
    log.write({"step": 10, "epoch": 0, "val_decode_tau_96": 2.5, "val_decode_tau_96_by_domain": {"math": 3.0, "chat": 2.0}})
    log.close()
    ev = EventAccumulator(str(tmp_path / "tensorboard"))
    ev.Reload()
    assert [(e.step, e.value) for e in ev.Scalars("val_decode_tau_96_by_domain/chat")] == [(10, 2.0)]
    assert [e.value for e in ev.Scalars("val_decode_tau_96_by_domain/math")] == [3.0]


def test_logging_flags_name_the_missing_package(store, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("wandb", "tensorboard") else real(name, *a))
    for flag in ("wandb", "tensorboard"):
        with pytest.raises(ValueError, match=f"--{flag} needs the {flag} package: pip install {flag}"):
            train_cfg(store, tmp_path / "x", **{flag: True})


def test_refusals(store, tmp_path):
    with pytest.raises(ValueError, match=r"layer ids \[7\] are not stored"):
        train(train_cfg(store, tmp_path / "a", layers=(0, 7)))
    train(train_cfg(store, tmp_path / "b", max_steps=2))
    with pytest.raises(ValueError, match="earlier run: pass --resume"):  # eval would pick the old run's step-2
        train(train_cfg(store, tmp_path / "b", max_steps=1))
    with pytest.raises(ValueError, match="config differs.*num_layers"):
        train(train_cfg(store, tmp_path / "b", max_steps=4, num_layers=2, resume=True))
    # too few micro-batches for one step: refused, not "trained 0 steps"
    with pytest.raises(ValueError, match="fewer micro-batches of --token-budget"):
        train(train_cfg(store, tmp_path / "d", grad_accum=10_000))
    with pytest.raises(ValueError, match="fewer micro-batches of --token-budget"):  # --max-steps skips no check
        train(train_cfg(store, tmp_path / "d2", grad_accum=10_000, max_steps=5))
    assert not (tmp_path / "d2" / "checkpoints").exists() or not any((tmp_path / "d2" / "checkpoints").iterdir())
    # an unfinalized store is refused without --follow
    meta = Path(store) / "zarr.json"
    doc = json.loads(meta.read_text())
    doc["attributes"]["draftcache_state"]["finalized"] = False
    old = meta.read_text()
    meta.write_text(json.dumps(doc))
    try:
        with pytest.raises(ValueError, match="not finalized"):
            train(train_cfg(store, tmp_path / "c"))
    finally:
        meta.write_text(old)


@pytest.mark.slow
# bf16: gradients rounded to 8 mantissa bits; under Adam a rounded tiny gradient can move a weight by
# up to 2 x lr (3e-3) a step (the exact mean is checked by test_bf16_gradient_reduce_...)
@pytest.mark.parametrize("reduce,rtol,atol", [("fp32", 1e-3, 1e-4), ("bf16", 2e-2, 1e-2)])
def test_two_rank_ddp_matches_one_rank_same_global_batch(store, tmp_path, reduce, rtol, atol):
    one = tmp_path / "one"
    train(train_cfg(store, one, max_steps=10, grad_accum=2))
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
    train(train_cfg(store, tmp_path / "eager", max_steps=6, checkpoint_every=6, log_every=1))
    train(train_cfg(store, tmp_path / "comp", max_steps=6, checkpoint_every=6, log_every=1, compile=True))
    # --compile-scope model: the whole training forward as one graph
    train(train_cfg(store, tmp_path / "whole", max_steps=6, checkpoint_every=6, log_every=1, compile=True,
                    compile_scope="model"))
    a = metric_rows(tmp_path / "eager")
    wa = load_checkpoint(latest_checkpoint(tmp_path / "eager"))[0]
    for run in ("comp", "whole"):
        b = metric_rows(tmp_path / run)
        assert [r["step"] for r in a] == [r["step"] for r in b]
        for x, y in zip(a, b):
            assert abs(x["loss"] - y["loss"]) < 1e-3 * abs(x["loss"]), (run, x["loss"], y["loss"])
        wb = load_checkpoint(latest_checkpoint(tmp_path / run))[0]
        assert wa.keys() == wb.keys()
        for k in wa:
            torch.testing.assert_close(wa[k], wb[k], rtol=1e-3, atol=1e-4)


def test_compile_mode_reaches_every_drafter_layer(store, tmp_path, monkeypatch):
    # --compile-mode reaches each layer's torch.compile as its options (recorded here, not compiled: the
    # modes' kernels are a GPU matter, timed by bench train --compile-mode)
    seen = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: seen.append((type(self).__name__, kw)))
    train(train_cfg(store, tmp_path / "m", max_steps=2, compile=True, compile_mode="max-autotune-no-cudagraphs"))
    assert len(seen) == train_cfg(store, tmp_path / "x").num_layers
    autotune = {"dynamic": True, "options": compile_options("max-autotune-no-cudagraphs")}
    assert autotune["options"]["max_autotune"] is True
    assert all(kw == autotune for _, kw in seen), seen
    seen.clear()
    train(train_cfg(store, tmp_path / "w", max_steps=2, compile=True, compile_scope="model"))
    assert seen == [("DFlashDrafter", {"dynamic": True, "options": compile_options("default")})]
    with pytest.raises(ValueError, match="compile_scope model needs --compile"):
        train_cfg(store, tmp_path / "x", compile_scope="model")
    with pytest.raises(ValueError, match="compile_mode max-autotune-no-cudagraphs needs --compile"):
        train_cfg(store, tmp_path / "x", compile_mode="max-autotune-no-cudagraphs")
    with pytest.raises(ValueError, match="compile_mode must be one of"):
        train_cfg(store, tmp_path / "x", compile=True, compile_mode="reduce-overhead")


@pytest.mark.parametrize("loss,divergence,penalty", [("ce", "kl", 0.0), ("mix", "kl", 0.0), ("mix", "tv", 0.1)])
def test_held_out_samples_are_scored_and_improve(store, tmp_path, loss, divergence, penalty):
    # mix also runs the KL and TV paths end to end: bf16 teacher states from the store, float32 on CPU;
    # the last case adds the confidence penalty
    train(train_cfg(store, tmp_path / "v", max_steps=60, val_samples=4, val_every=20, loss=loss, divergence=divergence,
                    confidence_penalty=penalty))
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
        train_cfg(store, tmp_path / "w", val_samples=4, follow=True)


def test_validation_time_is_not_in_the_training_rate(store, tmp_path, monkeypatch):
    # a slow held-out pass (1.5 s, ~10x a row of 5 tiny steps) must not show as slow training in the next row
    import time

    import train.trainer as trainer

    scored = trainer.evaluate_holdout

    def slow(*args, **kwargs):
        time.sleep(1.5)
        return scored(*args, **kwargs)

    monkeypatch.setattr(trainer, "evaluate_holdout", slow)
    train(train_cfg(store, tmp_path / "v", max_steps=15, val_samples=4, val_every=10))
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

    from train.__main__ import main

    # every field an option, and beyond them only the config-file pair
    assert {p.name for p in main.params} == {f.name for f in dataclasses.fields(TrainConfig)} | {"config", "print_config"}


def test_patience_stops_after_evaluations_without_a_new_best(store, tmp_path, monkeypatch):
    import train.trainer as trainer

    scored, scores = trainer.evaluate_holdout, iter([1.2, 1.5, 1.4, 1.3, 1.1, 1.0])

    def scripted(*args, **kwargs):
        return {**scored(*args, **kwargs), "val_decode_tau": next(scores)}

    monkeypatch.setattr(trainer, "evaluate_holdout", scripted)
    out = tmp_path / "p"
    res = train(train_cfg(store, out, max_steps=60, val_samples=4, val_every=10, patience=2))
    assert res["steps"] == 40 and res["stopped_early"]  # 1.4 at 30 and 1.3 at 40: two without a gain
    assert [r["step"] for r in metric_rows(out) if "val_loss" in r] == [10, 20, 30, 40]
    assert best_checkpoint(out).name == "best-20" and latest_checkpoint(out).name == "step-40"
    with pytest.raises(ValueError, match="patience"):
        train_cfg(store, out, patience=2)  # nothing held out to be patient about


def test_with_trees_scored_the_best_checkpoint_goes_by_the_trees_replayed_tau(store, tmp_path, monkeypatch):
    import train.trainer as trainer

    scored, chain, tree = trainer.evaluate_holdout, iter([1.2, 1.5, 1.1]), iter([2.0, 1.9, 2.4])

    def scripted(*args, **kwargs):  # the chain's best is step 20, the tree's step 30
        row = scored(*args, **kwargs)
        assert row["val_tree_budget"] == 8 and row["val_tree_tau_96"] >= 1.0
        return {**row, "val_decode_tau": next(chain), "val_tree_tau_96": next(tree)}

    monkeypatch.setattr(trainer, "evaluate_holdout", scripted)
    out = tmp_path / "t"
    train(train_cfg(store, out, max_steps=30, val_samples=4, val_every=10, val_tree_budget=8))
    assert best_checkpoint(out).name == "best-30"
    assert all("val_tree_tau" in r for r in metric_rows(out) if "val_loss" in r)
    with pytest.raises(ValueError, match="val_tree_budget"):
        train_cfg(store, out, val_tree_budget=8)  # nothing held out to replay trees on


def test_the_last_steps_are_logged_when_the_epochs_end_between_log_rows(store, tmp_path):
    """Epochs end the run before --max-steps and off a --log-every step: a row still covers the tail."""
    res = train(train_cfg(store, tmp_path / "r", epochs=1, max_steps=1000, log_every=1000))
    assert 0 < res["steps"] < 1000 and [r["step"] for r in metric_rows(tmp_path / "r")] == [res["steps"]]
    n = res["steps"]
    res = train(train_cfg(store, tmp_path / "r2", epochs=2, max_steps=1000, log_every=n + 1))
    assert [r["step"] for r in metric_rows(tmp_path / "r2")] == [n + 1, res["steps"]] and res["steps"] > n + 1


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


@pytest.mark.parametrize("compiled", [False, True])
def test_a_compiled_runs_held_out_pass_reuses_the_training_graph(store, tmp_path, monkeypatch, compiled):
    # the trainer asks evaluate_holdout for the steps' graph (tests/train/test_shapes.py) exactly when
    # it compiled the drafter: an eager drafter would only keep autograd's tensors for nothing
    import train.trainer as trainer
    from train.model import DFlashDrafter

    monkeypatch.setattr(DFlashDrafter, "compile_layers", lambda self, *a: None)  # the flag, not inductor
    real, asked = trainer.evaluate_holdout, []
    monkeypatch.setattr(trainer, "evaluate_holdout",
                        lambda *a, **k: asked.append(k["training_graph"]) or real(*a, **k))
    train(train_cfg(store, tmp_path / "r", max_steps=4, val_samples=4, val_every=2, compile=compiled))
    assert asked and set(asked) == {compiled}
