"""--store s3://... through a staging directory: nothing reaches the URL before the stage is checked
against the run, so a refused run leaves the URL as it was."""

from __future__ import annotations

import dataclasses

import obstore
import pytest

from cache_format import CacheFormatError, StoreReader
from cache_format.remote import open_bucket
from extract.run import run
from tests.helpers import extract_cfg, write_chats


def _keys(url: str) -> list[str]:
    return sorted(o["path"] for b in obstore.list(open_bucket(url)) for o in b)


def test_a_stage_left_by_another_stores_run_is_refused_before_anything_is_pushed(tmp_path, llama, object_server,
                                                                                 monkeypatch):
    monkeypatch.setenv("DRAFTCACHE_STORE_CACHE", str(tmp_path / "cache"))
    stage = tmp_path / "stage"
    run(extract_cfg(stage, llama, write_chats(tmp_path / "a.jsonl", 8, seed=1)))  # another store, finalized
    url = object_server()
    cfg = dataclasses.replace(extract_cfg(url, llama, write_chats(tmp_path / "b.jsonl", 8, seed=2)),
                              stage_dir=str(stage), lease_ttl=1.2)  # a push every 0.2 s, were one allowed
    with pytest.raises((ValueError, CacheFormatError)):
        run(cfg)
    assert all(k.startswith("lease") or k.endswith(".lease") for k in _keys(url)), _keys(url)
    # the same URL then takes a fresh stage and the new data, as if nothing had happened
    run(dataclasses.replace(cfg, stage_dir=str(tmp_path / "fresh")))
    assert StoreReader(url).finalized and len(StoreReader(url)) > 0


def test_a_store_directory_removed_mid_run_is_named_not_zarrs_missing_node(tmp_path, monkeypatch):
    import shutil

    from click.testing import CliRunner
    from zarr.errors import GroupNotFoundError

    import extract.run
    from extract.__main__ import main

    store = tmp_path / "s.zarr"

    def removed_meanwhile(cfg, **kw):  # the run's store goes away under it; zarr then finds no group
        store.mkdir()
        (store / "zarr.json").write_text("{}")
        shutil.rmtree(store)
        raise GroupNotFoundError(str(store), "")

    monkeypatch.setattr(extract.run, "run", removed_meanwhile)
    out = CliRunner().invoke(main, ["--store", str(store), "--data", "x.jsonl"])
    assert out.exit_code == 2
    assert out.output.startswith(f"error: {store}: the store's directory was removed while this run wrote it")
    assert len(out.output.strip().splitlines()) == 1
