"""verify catches corruption; readers refuse unknown versions; forked workers read correctly; CLI contract."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from cache_format import FORMAT_VERSION, StoreReader, UnknownFormatVersionError
from cache_format.__main__ import cli
from cache_format.audit import verify_store
from tests.helpers import (
    assert_sample_equal,
    make_manifest,
    make_sample,
    sample_length,
    write_store,
)


@pytest.fixture
def store(tmp_path) -> Path:
    path = tmp_path / "s.zarr"
    write_store(path, range(40), make_manifest())
    return path


def _shard_files(store: Path) -> list[Path]:
    return sorted(p for p in store.glob("w*/b*/*/c/**/*") if p.is_file())


@pytest.mark.parametrize("which", [0, 3, -1])
@pytest.mark.parametrize("where", [0.1, 0.5, 0.97])
def test_flipped_byte_is_named(store, which, where):
    files = _shard_files(store)
    victim = files[which]
    data = bytearray(victim.read_bytes())
    data[int(len(data) * where)] ^= 0x10
    victim.write_bytes(bytes(data))
    res = verify_store(store)
    assert not res["ok"]
    group = "/".join(victim.relative_to(store).parts[:2])
    assert any(b["shard"].startswith(group) for b in res["bad_shards"]), res
    out = CliRunner().invoke(cli, ["verify", str(store)])
    assert out.exit_code == 1 and "BAD " + group in out.output


def test_sound_store_verifies_and_inspects(store):
    out = CliRunner().invoke(cli, ["verify", str(store), "--json"])
    assert out.exit_code == 0, out.output
    res = json.loads(out.output)
    assert res["ok"] and res["num_samples"] == 40 and res["duplicate_sample_ids"] == [] and res["bad_shards"] == []
    out = CliRunner().invoke(cli, ["inspect", str(store), "--json"])
    info = json.loads(out.output)
    assert info["num_samples"] == 40 and info["format_version"] == FORMAT_VERSION
    assert info["num_tokens"] == sum(sample_length(i) for i in range(40))
    assert sum(b["num_samples"] for b in info["buckets"]) == 40
    assert {"lo", "hi", "num_samples", "num_tokens"} <= set(info["buckets"][0])
    assert info["shards"]["complete"] > 0 and info["bytes_per_token"] > 0
    assert info["manifest"]["layer_ids"] == [0, 2] and info["manifest"]["hidden_size"] == 8
    assert info["manifest"]["dtype"] == "bfloat16" and info["manifest"]["target"]["name"] == "tiny"
    out = CliRunner().invoke(cli, ["show", str(store), "3"])
    assert out.exit_code == 0 and "sample 3:" in out.output and "L0=" in out.output


def test_unknown_format_version_refused(store):
    meta = store / "zarr.json"
    doc = json.loads(meta.read_text())
    doc["attributes"]["draftcache"]["format_version"] = 99
    meta.write_text(json.dumps(doc))
    with pytest.raises(UnknownFormatVersionError, match="format_version 99 is not supported"):
        StoreReader(store)
    out = CliRunner().invoke(cli, ["inspect", str(store)])
    assert out.exit_code == 2 and "format_version 99" in out.output


def test_not_a_store(tmp_path):
    out = CliRunner().invoke(cli, ["inspect", str(tmp_path)])
    assert out.exit_code == 2 and "not a draftcache store" in out.output


class _DS(torch.utils.data.Dataset):
    def __init__(self, reader):
        self.reader = reader

    def __len__(self):
        return len(self.reader)

    def __getitem__(self, i):
        s = self.reader.get(int(self.reader.sample_ids[i]))
        return s.sample_id, s.hidden.float().sum().item()


def test_forked_dataloader_workers(store):
    r = StoreReader(store)
    r.get(0)  # the parent has used zarr before forking
    dl = torch.utils.data.DataLoader(_DS(r), batch_size=None, num_workers=2,
                                     multiprocessing_context="fork")
    got = dict(dl)
    m = make_manifest()
    assert sorted(got) == list(range(40))
    for i in (0, 17, 39):
        assert got[i] == pytest.approx(make_sample(i, sample_length(i), m)["hidden"].bfloat16().float().sum().item(), rel=1e-5)
    assert_sample_equal(r.get(5), make_sample(5, sample_length(5), m))


def _one_line_refusal(args) -> str:
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2, res.output
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    return lines[0]


@pytest.mark.parametrize("field,value", [("target", "x"), ("layer_ids", 7), ("dataset", None), ("max_len", "long")])
def test_a_damaged_manifest_is_one_line(store, field, value):
    meta = store / "zarr.json"
    doc = json.loads(meta.read_text())
    doc["attributes"]["draftcache"][field] = value
    meta.write_text(json.dumps(doc))
    from cache_format import CacheFormatError

    with pytest.raises(CacheFormatError) as e:
        StoreReader(store)
    assert str(store) in str(e.value) and "\n" not in str(e.value)
    assert "manifest" in _one_line_refusal(["inspect", str(store)])


def test_a_damaged_frozen_file_is_one_line(store):
    from cache_format import CacheFormatError, write_frozen

    write_frozen(store, {"embed_tokens.weight": torch.randn(10, 8), "norm.weight": torch.ones(8)})
    path = store / "frozen.safetensors"
    data = bytearray(path.read_bytes())
    data[3] ^= 0xFF  # the header length
    path.write_bytes(bytes(data))
    with pytest.raises(CacheFormatError) as e:
        StoreReader(store).frozen()
    assert str(path) in str(e.value) and "damaged" in str(e.value) and "\n" not in str(e.value)


def test_a_damaged_tokenizer_is_one_line_in_show(store):
    from tests.helpers import tiny_tokenizer

    tiny_tokenizer().save_pretrained(str(store / "tokenizer"))
    (store / "tokenizer" / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": 3')
    (store / "tokenizer" / "tokenizer_config.json").write_text("{not json")
    line = _one_line_refusal(["show", str(store), "0"])
    assert "tokenizer" in line


def test_verify_says_when_a_store_is_not_finalized(tmp_path):
    from click.testing import CliRunner

    from cache_format.__main__ import cli as main
    from tests.helpers import make_manifest, write_store

    write_store(tmp_path / "s.zarr", range(6), make_manifest(), finalize=False)
    out = CliRunner().invoke(main, ["verify", str(tmp_path / "s.zarr")])
    assert out.exit_code == 0 and "NOT FINALIZED" in out.output
    write_store(tmp_path / "f.zarr", range(6), make_manifest())
    assert "NOT FINALIZED" not in CliRunner().invoke(main, ["verify", str(tmp_path / "f.zarr")]).output


def test_a_manifest_field_of_another_type_and_a_plot_nowhere_are_one_line(tmp_path):
    import json

    from click.testing import CliRunner

    from cache_format.__main__ import cli as main
    from tests.helpers import make_manifest, write_store

    store = tmp_path / "s.zarr"
    write_store(store, range(4), make_manifest())
    out = CliRunner().invoke(main, ["plot", str(store), str(tmp_path / "no" / "such" / "dir" / "p.png")])
    assert out.exit_code != 0 and "cannot write the plot" in out.output and "Traceback" not in out.output
    doc = json.loads((store / "zarr.json").read_text())
    doc["attributes"]["draftcache"]["target"]["hidden_size"] = "8"
    (store / "zarr.json").write_text(json.dumps(doc))
    for cmd in (["inspect", str(store)], ["show", str(store), "0"], ["verify", str(store)]):
        out = CliRunner().invoke(main, cmd)
        assert out.exit_code != 0 and "hidden_size = '8' is a str" in out.output, (cmd, out.output[-500:])
        assert "Traceback" not in out.output, cmd
        assert cmd[0] == "verify" or len(out.output.strip().splitlines()) == 1, cmd  # verify lists each problem
