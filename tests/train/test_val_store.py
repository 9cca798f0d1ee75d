"""--val-store: held-out evaluations read every sample of a second store (prompts in the served
format, kept out of training), checked against the training store before the first step."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from extract.config import ExtractConfig
from extract.run import run as extract
from tests.helpers import metric_rows, tiny_target_dir, train_cfg, write_chats
from train.checkpoint import best_checkpoint
from train.trainer import train


def _extract(target, data, path, layers=(0, 2, 4)) -> str:
    extract(ExtractConfig(store=str(path), target=target, data=data, layers=layers, max_len=256, min_supervised=4,
                          token_budget=1024, rows_per_shard=256))
    return str(path)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """(target, training store, its chats, a validation store of other chats)."""
    d = tmp_path_factory.mktemp("val")
    target = tiny_target_dir(d / "t", "qwen3")
    chats = write_chats(d / "train.jsonl", 24, cyclic=True)
    other = write_chats(d / "val.jsonl", 7, seed=5, cyclic=True)
    return target, _extract(target, chats, d / "train.zarr"), chats, _extract(target, other, d / "val.zarr")


def test_every_sample_of_the_val_store_is_scored_and_keeps_the_best(stores, tmp_path, monkeypatch):
    import train.trainer as trainer
    from cache_format import StoreReader

    _, store, _, val = stores
    seen = []
    scored = trainer.evaluate_holdout

    def spy(model, ds, *args, **kwargs):
        seen.append((ds.store, sorted(sid for micro in ds.micro for sid in micro)))
        return scored(model, ds, *args, **kwargs)

    monkeypatch.setattr(trainer, "evaluate_holdout", spy)
    train(train_cfg(store, tmp_path / "v", max_steps=30, val_store=val, val_every=10))
    want = (str(StoreReader(val).root), sorted(StoreReader(val).sample_ids.tolist()))
    assert seen == [want] * 3  # steps 10, 20, 30: all of the val store, nothing of the training store
    rows = [r for r in metric_rows(tmp_path / "v") if "val_loss" in r]
    assert [r["step"] for r in rows] == [10, 20, 30] and rows[-1]["val_loss"] < rows[0]["val_loss"]
    top = max(rows, key=lambda r: r["val_decode_tau"])
    state = json.loads((best_checkpoint(tmp_path / "v") / "state.json").read_text())
    assert (state["step"], state["val_decode_tau"]) == (top["step"], top["val_decode_tau"])
    assert state["config"]["val_store"] == val


def test_a_val_store_that_does_not_fit_the_training_store_is_one_line(stores, tmp_path):
    target, store, _, val = stores
    other_taps = _extract(target, write_chats(tmp_path / "o.jsonl", 4, seed=9), tmp_path / "o.zarr", layers=(0, 2))
    with pytest.raises(ValueError, match=r"--val-store .*o\.zarr: its tapped layers \(\[0, 2\]\) differ from the "):
        train(train_cfg(store, tmp_path / "a", max_steps=2, val_store=other_taps))
    with pytest.raises(ValueError, match=r"24 of its prompts are in the training store too"):  # itself, say
        train(train_cfg(store, tmp_path / "b", max_steps=2, val_store=store))
    damaged = tmp_path / "damaged.zarr"
    shutil.copytree(val, damaged)
    weights = bytearray((damaged / "frozen.safetensors").read_bytes())
    weights[len(weights) // 2] ^= 1
    (damaged / "frozen.safetensors").write_bytes(bytes(weights))
    with pytest.raises(ValueError, match=r"damaged\.zarr/frozen\.safetensors: .*the store is damaged"):
        train(train_cfg(store, tmp_path / "e", max_steps=2, val_store=str(damaged)))
    torn = tmp_path / "torn.zarr"  # a damaged shard: named before step 1, not at the first evaluation
    shutil.copytree(val, torn)
    chunk = max((f for f in torn.rglob("*") if f.is_file() and "hidden" in f.parts and f.name != "zarr.json"),
                key=lambda f: f.stat().st_size)
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"--val-store .*torn\.zarr: .*shard \d+: .*the store is damaged"):
        train(train_cfg(store, tmp_path / "f", max_steps=2, val_store=str(torn)))
    assert not (tmp_path / "f" / "metrics.jsonl").exists() or not metric_rows(tmp_path / "f")
    with pytest.raises(ValueError, match="not both"):
        train_cfg(store, tmp_path / "c", val_samples=4, val_store=val)
    train_cfg(store, tmp_path / "d", patience=2, val_store=val)  # patience needs a held-out set: this is one


def test_a_val_store_of_the_evaluations_prompts_is_scored_per_domain(stores, tmp_path):
    from cache_format import StoreReader
    from chat.prompts import validation_prompts
    from train.start import domain_groups

    target, store, _, _ = stores
    chat = [m for name, m in validation_prompts() if name.startswith("chat/")][:3]
    with open(tmp_path / "v.jsonl", "w") as f:  # held-out chat prompts (lines 0, 2, 4) among chats of no domain
        for i, line in enumerate(open(write_chats(tmp_path / "o.jsonl", 3, seed=11, cyclic=True))):
            f.write(json.dumps({"messages": chat[i] + [{"role": "assistant", "content": "alpha beta gamma delta"}]})
                    + "\n" + line)
    val = _extract(target, str(tmp_path / "v.jsonl"), tmp_path / "v.zarr")
    r = StoreReader(val)
    groups = domain_groups(r, np.ones(len(r.sample_ids), dtype=bool))
    assert list(groups) == ["chat"] and sorted(groups["chat"].tolist()) == [0, 2, 4]
    assert domain_groups(r, r.sample_ids >= 3)["chat"].tolist() == [4]
    train(train_cfg(store, tmp_path / "run", max_steps=10, val_store=val, val_every=10))
    row = [r for r in metric_rows(tmp_path / "run") if "val_loss" in r][-1]
    assert list(row["val_decode_tau_96_by_domain"]) == ["chat"] and row["val_decode_tau_96_by_domain"]["chat"] >= 1
    # a held-out set of no evaluation prompt (the training store's own samples) has no per-domain row
    train(train_cfg(store, tmp_path / "own", max_steps=10, val_samples=4, val_every=10))
    assert all("val_decode_tau_96_by_domain" not in r for r in metric_rows(tmp_path / "own"))
