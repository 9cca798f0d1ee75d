"""Object storage under injected faults: a store pushed, read, inspected and verified through a proxy that
throttles, fails, drops, stalls, truncates and reorders (tests/cache_format/fault_proxy.py) is the store
the writer made, and inspect and verify print what they print without faults."""

from __future__ import annotations

import os
import subprocess
import sys

import obstore
import pytest

from cache_format import CacheFormatError, StoreReader
from cache_format.mirror import Mirror
from cache_format.remote import open_bucket
from tests.cache_format.fault_proxy import KINDS, FaultProxy
from tests.helpers import (
    assert_sample_equal,
    make_manifest,
    make_sample,
    sample_length,
    write_store,
)

N = 24


def _cli(command: str, url: str, cache) -> subprocess.CompletedProcess:
    env = {**os.environ, "DRAFTCACHE_STORE_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-m", "cache_format", command, url], capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.fixture
def store_and_url(tmp_path, object_server):
    m = make_manifest()
    local = tmp_path / "s.zarr"
    write_store(local, range(N), m)
    return m, local, object_server()


def test_push_read_inspect_and_verify_survive_every_kind_of_fault(tmp_path, store_and_url, monkeypatch):
    m, local, url = store_and_url
    with FaultProxy(os.environ["AWS_ENDPOINT_URL"], every=4, stall_s=0.2) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        Mirror(local, url).push()
        monkeypatch.setenv("DRAFTCACHE_STORE_CACHE", str(tmp_path / "cache_faulty"))
        reader = StoreReader(url)
        assert sorted(reader.sample_ids) == list(range(N))
        for sid in range(N):  # every sample fetched through the faults, checked against its checksum
            assert_sample_equal(reader.get(sid), make_sample(sid, sample_length(sid, m.max_len), m))
        faulty = {c: _cli(c, url, tmp_path / f"cli_faulty_{c}") for c in ("inspect", "verify")}
        injected = dict(proxy.injected)
        proxy.faulty = False
        clean = {c: _cli(c, url, tmp_path / f"cli_clean_{c}") for c in ("inspect", "verify")}
    for c in ("inspect", "verify"):
        assert faulty[c].returncode == clean[c].returncode == 0, faulty[c].stderr[-500:]
        assert faulty[c].stdout == clean[c].stdout  # the same figures, faults or not
    assert set(injected) == set(KINDS), injected  # every kind met at least once
    assert sum(injected.values()) >= 100, injected
    print(f"faults injected and survived: {sum(injected.values())} {injected}")


def test_a_read_through_faults_of_a_damaged_object_is_still_refused(tmp_path, store_and_url, monkeypatch):
    """Retries must not launder damage: a shard damaged on the server is refused in one line, faults or not."""
    m, local, url = store_and_url
    Mirror(local, url).push()
    bucket = open_bucket(url)
    key = next(k["path"] for batch in obstore.list(bucket) for k in batch if "/hidden/c/" in k["path"])
    data = bytearray(obstore.get(bucket, key).bytes())
    data[len(data) // 2] ^= 0xFF
    obstore.put(bucket, key, bytes(data))
    with FaultProxy(os.environ["AWS_ENDPOINT_URL"], every=2, stall_s=0.1) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        monkeypatch.setenv("DRAFTCACHE_STORE_CACHE", str(tmp_path / "cache"))
        reader = StoreReader(url)
        with pytest.raises(CacheFormatError) as e:
            for sid in range(N):
                reader.get(sid)
        assert "\n" not in str(e.value) and "checksum" in str(e.value).lower(), str(e.value)
        assert sum(proxy.injected.values()) > 0
