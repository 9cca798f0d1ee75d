"""The packaged GGUF's converted form: a second float32 load reads it and gets exactly what the
conversion gave; incomplete or mismatched entries are not used; `off` writes nothing."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

import target.converted as converted
from target.loader import _from_converted, load_target, packaged_gguf, target_sha256

pytestmark = pytest.mark.slow


def test_second_load_reads_the_conversion_and_equals_it(monkeypatch, tmp_path):
    import gguf

    sha = target_sha256(packaged_gguf())
    monkeypatch.setenv("DRAFTCACHE_TARGET_CACHE", str(tmp_path / "cache"))  # its own: this test converts
    root = converted.cache_root()
    cpu = torch.device("cpu")
    parses, real_reader, real_map = [], gguf.GGUFReader, gguf.get_tensor_name_map

    def counting(*args, **kwargs):
        parses.append(args)
        return real_reader(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counting)
    a = load_target("", device=cpu)  # converts, writes the entry
    assert (root / sha / "draftcache_target.json").is_file() and not list(root.glob(".tmp-*"))
    assert len(parses) == 1  # config, tokenizer and weights from one parse of the file
    assert gguf.GGUFReader is counting and gguf.get_tensor_name_map is real_map  # the module gets its own back

    seen = []
    real = converted.read_entry
    monkeypatch.setattr("target.loader.read_entry", lambda s: seen.append(s) or real(s))
    b = load_target("", device=cpu)
    assert seen == [sha]
    assert b.info == a.info and b.tokenizer_sha256 == a.tokenizer_sha256
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    assert (a.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            == b.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))

    # a record whose tokenizer hash differs is not used (the GGUF is converted again)
    mark = root / sha / "draftcache_target.json"
    good = mark.read_text()
    mark.write_text(json.dumps({**json.loads(good), "tokenizer_sha256": "0" * 64}))
    assert _from_converted(Path(packaged_gguf()), sha, cpu) is None
    mark.write_text(good)
    assert _from_converted(Path(packaged_gguf()), sha, cpu) is not None


def test_a_conversion_in_progress_holds_off_the_next_load(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTCACHE_TARGET_CACHE", str(tmp_path))
    order = []

    def second():
        with converted.entry_lock("ab"):
            order.append("second")

    with converted.entry_lock("ab"):
        other = threading.Thread(target=second)
        other.start()
        other.join(0.3)
        order.append("first done")
    other.join(5)
    assert order == ["first done", "second"]
    with converted.entry_lock("cd"):  # another GGUF: another lock, no wait
        pass


def test_incomplete_entries_and_off(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTCACHE_TARGET_CACHE", str(tmp_path))
    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "model.safetensors").write_bytes(b"half")  # no record: a crashed write
    assert converted.read_entry("ab") is None
    (tmp_path / "cd").mkdir()
    (tmp_path / "cd" / "draftcache_target.json").write_text(json.dumps({"gguf_sha256": "other"}))
    assert converted.read_entry("cd") is None  # the record must name this GGUF
    monkeypatch.setenv("DRAFTCACHE_TARGET_CACHE", "off")
    assert converted.cache_root() is None and converted.read_entry("ab") is None
    converted.write_entry("ef", torch.nn.Linear(1, 1), None, {}, "")  # off: nothing written, nothing touched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ab", "cd"]
