"""Every file of a store is checksummed: damage of each kind (flip, truncate, delete) is named by
verify; training refuses damaged frozen weights, prompt keys and manifest in one line."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from cache_format.audit import verify_store
from cache_format.checksums import CHECKSUMS_FILE, covered_files
from cache_format.reader import StoreReader
from extract.config import ExtractConfig
from extract.run import run as extract
from tests.helpers import tiny_target_dir, write_chats


@pytest.fixture(scope="module")
def sound(tmp_path_factory):
    d = tmp_path_factory.mktemp("ck")
    store = d / "s.zarr"
    extract(ExtractConfig(store=str(store), target=tiny_target_dir(d / "t", "llama"),
                          data=write_chats(d / "c.jsonl", 12, cyclic=True), layers=(0, 2), max_len=256,
                          min_supervised=4, token_budget=1024, rows_per_shard=256))
    return store


def _damage(path: Path, how: str) -> None:
    if how == "delete":
        path.unlink()
    elif how == "truncate":
        path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    else:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x5A
        path.write_bytes(bytes(data))


KINDS = ["frozen.safetensors", "prompts.safetensors", "tokenizer/tokenizer.json", "commits/w00000.jsonl",
         "w00000/b*/zarr.json", "w00000/b*/offsets/c/0", "w00000/b*/input_ids/zarr.json"]


def test_the_covered_files_are_every_file_but_the_data_shards(sound):
    m = StoreReader(sound).manifest
    cov = set(covered_files(sound, m))
    listed = set(json.loads((sound / CHECKSUMS_FILE).read_text())["files"])
    assert cov == listed
    for k in KINDS:
        assert any(Path(c).match(k) for c in cov), k
    everything = {p.relative_to(sound).as_posix() for p in sound.rglob("*") if p.is_file()}
    rest = everything - cov - {"zarr.json", CHECKSUMS_FILE}
    assert rest and all("/c/" in r and "/offsets/" not in r and "/sample_ids/" not in r for r in rest)  # shards


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
@pytest.mark.parametrize("kind", KINDS)
def test_verify_names_each_damaged_file(sound, tmp_path, kind, how):
    store = tmp_path / "s.zarr"
    shutil.copytree(sound, store)
    target = next(p for p in store.glob(kind) if p.is_file())
    rel = target.relative_to(store).as_posix()
    _damage(target, how)
    try:
        res = verify_store(store)
    except ValueError as e:  # the store cannot even be opened: the error names the file
        assert rel.split("/")[0] in str(e) and "\n" not in str(e)
        return
    assert not res["ok"]
    assert {"file": rel, "reason": "missing" if how == "delete" else "checksum mismatch"} in res["bad_files"]


def test_a_changed_manifest_and_a_missing_checksums_file_are_named(sound, tmp_path):
    store = tmp_path / "s.zarr"
    shutil.copytree(sound, store)
    doc = json.loads((store / "zarr.json").read_text())
    doc["attributes"]["draftcache"]["dataset"]["path"] = "elsewhere.jsonl"
    (store / "zarr.json").write_text(json.dumps(doc))
    assert {"file": "zarr.json", "reason": "manifest changed since it was written"} in verify_store(store)["bad_files"]
    (store / CHECKSUMS_FILE).unlink()
    assert verify_store(store)["bad_files"][0]["file"] == CHECKSUMS_FILE


def test_an_emptied_checksum_list_is_named_by_verify_and_refused_by_training(sound, tmp_path):
    from train.config import TrainConfig
    from train.trainer import train

    store = tmp_path / "s.zarr"
    shutil.copytree(sound, store)
    doc = json.loads((store / CHECKSUMS_FILE).read_text())
    doc["files"] = {}
    (store / CHECKSUMS_FILE).write_text(json.dumps(doc))
    bad = verify_store(store)["bad_files"]
    assert {"file": "frozen.safetensors", "reason": f"not covered by {CHECKSUMS_FILE}"} in bad
    assert len(bad) == len(covered_files(store, StoreReader(store).manifest))  # every file is named
    with pytest.raises(ValueError, match="not covered"):
        train(TrainConfig(store=str(store), out=str(tmp_path / "r"), num_layers=1, block_size=4, num_anchors=8,
                          max_steps=2, token_budget=512, workers=0))


@pytest.mark.parametrize("kind", ["frozen.safetensors", "prompts.safetensors"])
def test_training_refuses_damaged_frozen_weights_and_prompt_keys(sound, tmp_path, kind):
    from train.config import TrainConfig
    from train.trainer import train

    store = tmp_path / "s.zarr"
    shutil.copytree(sound, store)
    _damage(store / kind, "flip")
    with pytest.raises(ValueError) as e:
        train(TrainConfig(store=str(store), out=str(tmp_path / "r"), num_layers=1, block_size=4, num_anchors=8,
                          max_steps=2, token_budget=512, workers=0))
    assert str(store / kind) in str(e.value) and "checksum mismatch" in str(e.value) and "\n" not in str(e.value)


def test_training_checks_each_shard_on_first_read(sound, tmp_path):
    """By default (--verify-shards on) a flipped byte in a data shard of a finalized store stops
    training in one line naming the shard (through a DataLoader worker too); off: the same store
    trains (only verify would catch it)."""
    import subprocess
    import sys

    store = tmp_path / "s.zarr"
    shutil.copytree(sound, store)
    shard = next(p for p in sorted(store.glob("w*/b*/hidden/c/*/*")) if p.stat().st_size > 64)
    _damage(shard, "flip")
    common = ["--store", str(store), "--num-layers", "1", "--block-size", "4", "--num-anchors", "8",
              "--max-steps", "3", "--token-budget", "512", "--workers", "1"]
    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "-m", "train", *common, "--out", str(tmp_path / "on")],
                       capture_output=True, text=True, cwd=root, timeout=300)
    errors = [x[x.index("error:"):] for x in re.split(r"[\r\n]", p.stderr) if "error:" in x]  # \r: the progress bar
    assert p.returncode == 2 and len(errors) == 1, p.stderr[-2000:]
    key = shard.relative_to(store).parts[:2]
    assert f"{store / key[0] / key[1]} shard" in errors[0] and "hidden" in errors[0] and "mismatch" in errors[0]
    from train.config import (
        TrainConfig,  # off: the same options in this process (no second start-up)
    )
    from train.trainer import train

    train(TrainConfig(store=str(store), out=str(tmp_path / "off"), num_layers=1, block_size=4, num_anchors=8,
                      max_steps=3, token_budget=512, workers=1, verify_shards="off"))


def test_a_follower_checking_shards_while_the_tail_shard_grows(tmp_path):
    # stage one rewrites a tail shard's file at every flush: a reader holding the older commit entry
    # (train --follow, where shard checks are on) must not call the rewritten file damaged
    from cache_format import ShardWriter, StoreReader, create_store
    from tests.helpers import make_manifest, make_sample

    path, m = tmp_path / "s.zarr", make_manifest(rows_per_shard=64)
    create_store(path, m)
    w = ShardWriter(path, writer_id=0)
    for i in range(3):
        w.add(i, **make_sample(i, 10, m))
    w.flush()
    r = StoreReader(path, verify_shards=True)
    for i in range(3, 6):
        w.add(i, **make_sample(i, 10, m))
    w.flush()  # shard 0 rewritten with 60 rows; r still holds the 30-row entry
    assert [len(s.input_ids) for s in r.get_batch([0, 2])] == [10, 10]
    w.close()


def test_a_shard_is_checked_once_per_run_not_once_per_reader_process(tmp_path, monkeypatch):
    """verified_dir: DataLoader workers are new processes every epoch; with the run's marker directory a
    shard checked by one reader is not checked again by the next, while a damaged shard is still
    refused by a reader whose run has not checked it."""
    import cache_format.reader as reader_mod
    from cache_format import CacheFormatError, StoreReader
    from tests.helpers import make_manifest, write_store

    m = make_manifest()
    store = tmp_path / "s.zarr"
    write_store(store, range(30), m)
    calls = []
    real = reader_mod.check_shard
    monkeypatch.setattr(reader_mod, "check_shard", lambda *a, **k: calls.append(a[1:3]) or real(*a, **k))
    marks = tmp_path / "run" / ".verified-shards"
    first = StoreReader(store, verify_shards=True, verified_dir=marks)
    first.get_batch(first.sample_ids)
    n = len(calls)
    assert n > 0 and len(list(marks.iterdir())) == len(set(calls))
    again = StoreReader(store, verify_shards=True, verified_dir=marks)  # the next epoch's worker
    again.get_batch(again.sample_ids)
    assert len(calls) == n
    key = sorted(again.index.shards)[0]
    hidden = next(p for p in (store / key / "hidden" / "c").rglob("*") if p.is_file())
    data = bytearray(hidden.read_bytes())
    data[len(data) // 3] ^= 0x40
    hidden.write_bytes(bytes(data))
    fresh = StoreReader(store, verify_shards=True, verified_dir=tmp_path / "other-run" / ".verified-shards")
    with pytest.raises(CacheFormatError, match="checksum mismatch"):
        fresh.get_batch(fresh.sample_ids)
