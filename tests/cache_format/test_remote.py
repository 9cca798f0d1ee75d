"""Stores on object storage, against a real S3-compatible server (moto's server mode, its own process):
commit order, one writer by lease, reads that fetch only what they need, checksums on every fetch."""

from __future__ import annotations

import json
import time

import obstore
import pytest

from cache_format import CacheFormatError, StoreReader
from cache_format.layout import commit_log_path
from cache_format.mirror import Lease, Mirror
from cache_format.remote import LEASE_KEY, open_bucket, pull
from tests.helpers import (
    assert_sample_equal,
    make_manifest,
    make_sample,
    sample_length,
    write_store,
)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTCACHE_STORE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _data_files(root) -> set[str]:
    from cache_format.remote import _is_data

    return {k for k in (p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) if _is_data(k)}


def _pushed(tmp_path, object_server, n: int):
    """A finalized store of n samples written locally and pushed: (manifest, local path, URL)."""
    m = make_manifest()
    local = tmp_path / "s.zarr"
    write_store(local, range(n), m)
    url = object_server()
    Mirror(local, url).push()
    return m, local, url


def test_a_pushed_store_reads_back_by_url_fetching_only_the_shards_it_reads(tmp_path, object_server, cache):
    m, local, url = _pushed(tmp_path, object_server, 60)
    reader = StoreReader(url)
    assert reader.url == url and reader.verify_shards and sorted(reader.sample_ids) == list(range(60))
    assert not _data_files(reader.root)  # opening copied the metadata only
    got = reader.get(7)
    assert_sample_equal(got, make_sample(7, sample_length(7, m.max_len), m))
    fetched = _data_files(reader.root)
    assert fetched and fetched < _data_files(local)  # the shards of sample 7, not the store
    for sid in range(60):
        assert_sample_equal(reader.get(sid), make_sample(sid, sample_length(sid, m.max_len), m))
    assert _data_files(reader.root) == _data_files(local)


def test_a_reader_never_meets_a_commit_without_its_shard(tmp_path, object_server, cache):
    """Pushed mid-write: every done-log line on the server names shards the server holds whole, though the
    writer commits more between the push's log snapshot and its uploads."""
    m = make_manifest()
    local = tmp_path / "s.zarr"
    write_store(local, range(30), m, finalize=False)
    url = object_server()
    mirror = Mirror(local, url)
    real_put = mirror._put

    def put_and_commit_more(key, data=None):  # a commit lands while the push is under way
        real_put(key, data)
        if "/c/" in key and not getattr(put_and_commit_more, "done", False):
            put_and_commit_more.done = True
            from cache_format import ShardWriter

            with ShardWriter(local, writer_id=1) as w:
                for i in range(100, 140):
                    w.add(i, **make_sample(i, sample_length(i, m.max_len), m))

    mirror._put = put_and_commit_more
    mirror.push()
    reader = StoreReader(url)
    assert reader.url and not reader.finalized
    for sid in reader.sample_ids:  # every committed sample on the server reads back, checked
        assert_sample_equal(reader.get(int(sid)), make_sample(int(sid), sample_length(int(sid), m.max_len), m))
    assert (commit_log_path(local, 1)).exists()
    mirror._put = real_put
    mirror.push()  # the next push brings the later commits
    assert len(StoreReader(url)) == 70


def test_a_damaged_object_is_refused_in_one_line(tmp_path, object_server, cache):
    _, local, url = _pushed(tmp_path, object_server, 20)
    bucket = open_bucket(url)
    key = sorted(k for k in _data_files(local) if "/hidden/" in k)[0]
    data = bytearray((local / key).read_bytes())
    data[len(data) // 2] ^= 0xFF
    obstore.put(bucket, key, bytes(data))
    reader = StoreReader(url)
    with pytest.raises(CacheFormatError) as e:
        for sid in range(20):
            reader.get(sid)
    assert "shard" in str(e.value) and url in str(e.value) and "\n" not in str(e.value)


def test_one_writer_per_store_by_lease_and_a_dead_writers_lease_expires(object_server):
    url = object_server()
    first = Lease(url, ttl=2.0).acquire()
    with pytest.raises(CacheFormatError, match=r"being written by .*:\d+ \(its lease runs \d+ s more\)") as e:
        Lease(url, ttl=2.0).acquire(wait=0.2)
    assert "\n" not in str(e.value)
    first.renew()  # alive: renewing keeps it
    # a writer killed with -9 renews no more: its lease expires and the next writer takes it over
    second = Lease(url, ttl=2.0).acquire(wait=5.0)
    rec = json.loads(bytes(obstore.get(open_bucket(url), LEASE_KEY).bytes()))
    assert rec["holder"] == second.holder and rec["expires"] > time.time()
    with pytest.raises(CacheFormatError, match="taken by another writer"):
        first.renew()  # the old holder finds out at its next renewal
    second.release()
    Lease(url, ttl=2.0).acquire(wait=0).release()  # released: free at once


def test_a_writer_resumes_from_the_server_on_an_empty_staging_directory(tmp_path, object_server):
    m = make_manifest()
    url = object_server()
    first = tmp_path / "first.zarr"
    write_store(first, range(25), m, finalize=False)
    Mirror(first, url).push()
    again = pull(url, tmp_path / "elsewhere.zarr", data=True)  # another machine's staging directory
    assert _data_files(again) == _data_files(first)
    assert (again / "commits").is_dir() and StoreReader(again).sample_ids.tolist() == StoreReader(first).sample_ids.tolist()


def test_pushed_complete_shards_leave_the_staging_directory_and_writing_goes_on(tmp_path, object_server, cache):
    """With evict, the stage keeps the tail shards and metadata only; the writer goes on writing there,
    and the server holds every sample."""
    from cache_format import ShardWriter
    from cache_format.index import finalize_store

    m = make_manifest()
    local = tmp_path / "s.zarr"
    write_store(local, range(40), m, finalize=False)
    url = object_server()
    mirror = Mirror(local, url, evict=True)
    everything = _data_files(local)
    mirror.push()
    left = _data_files(local)
    assert left < everything  # complete shards went
    reader = StoreReader(local)
    tails = {k for k in everything for key, e in ((g, e) for g, d in reader.index.shards.items() for e in d.values())
             if e["rows"] < m.rows_per_shard and k.startswith(f"{key}/") and f"/c/{e['shard']}" in k}
    assert tails and tails <= left
    with ShardWriter(local, writer_id=0) as w:  # the writer resumes on the thinned stage
        for i in range(40, 70):
            w.add(i, **make_sample(i, sample_length(i, m.max_len), m))
    finalize_store(local, m)
    mirror.push()
    remote = StoreReader(url)
    assert remote.finalized and sorted(remote.sample_ids.tolist()) == list(range(70))
    for sid in range(70):
        assert_sample_equal(remote.get(sid), make_sample(sid, sample_length(sid, m.max_len), m))


def test_only_shards_whose_every_row_is_committed_are_settled(tmp_path):
    """A shard whose entry says it is full is not settled while a sample that began in it is not
    committed: a resuming writer reads it back and rewrites it, so the mirror must not evict it
    (the race a kill -9 and resume on the same stage directory met)."""
    from cache_format.layout import group_key, shard_keys, token_arrays
    from cache_format.mirror import _settled_shards

    m = make_manifest()
    r, arrays = m.rows_per_shard, token_arrays(make_manifest())

    def keys(writer, bucket, shards):
        return {k for s in shards for k in shard_keys(arrays, group_key(writer, bucket), s)}

    def log(*entries):
        return "".join(json.dumps({"bucket": b, "shard": s, "rows": n, "samples": smp}) + "\n"
                       for b, s, n, smp in entries).encode()

    # writer 0, bucket 1: sample 0 fills half of shard 0, sample 1 runs through shards 0 and 1 into 2
    open_sample = log((1, 0, r, [[0, r // 2]]), (1, 1, r, []))
    assert _settled_shards(m, {"commits/w00000.jsonl": open_sample}) == []
    closed = open_sample + log((1, 2, 3, [[1, r // 2 + r + 3]]))
    assert set(_settled_shards(m, {"commits/w00000.jsonl": closed})) == keys(0, 1, [0, 1])
    # writer 3, bucket 0: committed rows end exactly on a shard boundary
    exact = log((0, 0, r, [[5, r - 4], [6, 4]]))
    both = {"commits/w00000.jsonl": closed, "commits/w00003.jsonl": exact}
    assert set(_settled_shards(m, both)) == keys(0, 1, [0, 1]) | keys(3, 0, [0])


def _read_in_child(root, url, sid, out):
    out.put(StoreReader(root, remote=url).get(sid).input_ids.tolist())


def test_a_worker_forked_after_its_parent_used_the_object_store_still_fetches(tmp_path, object_server, cache):
    """obstore's runtime does not survive a fork (a DataLoader worker would hang): such a child
    downloads through a fresh interpreter."""
    import multiprocessing as mp

    m, local, url = _pushed(tmp_path, object_server, 20)
    parent = StoreReader(url)  # the parent has used obstore
    parent.get(0)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_read_in_child, args=(parent.root, url, 13, q))
    p.start()
    p.join(60)
    assert not p.is_alive() and p.exitcode == 0
    assert q.get(timeout=5) == make_sample(13, sample_length(13, m.max_len), m)["input_ids"].tolist()


def test_a_file_rewritten_within_one_mtime_tick_at_the_same_size_is_uploaded_again(tmp_path, object_server):
    """Every flush renames a new file into place; the mtime clock ticks every few milliseconds, so two
    flushes may share size and mtime: the mirror must still send the second (else the server keeps a
    stale tail shard under a newer done-log)."""
    import os

    url, local = object_server(), tmp_path / "s"
    (local / "w").mkdir(parents=True)
    path = local / "w" / "shard"
    path.write_bytes(b"A" * 64)
    mirror = Mirror(local, url)
    mirror._put("w/shard")
    st = path.stat()
    tmp = local / "w" / "shard.tmp"
    tmp.write_bytes(b"B" * 64)
    os.replace(tmp, path)  # as zarr's LocalStore writes: a new file renamed over the old
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # the same tick of the clock
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    mirror._put("w/shard")
    assert bytes(obstore.get(open_bucket(url), "w/shard").bytes()) == b"B" * 64


class _DropsOnePut:
    """obstore as the mirror sees it, but the first PUT of `key` is acknowledged and not stored."""

    def __init__(self, key: str) -> None:
        self.key, self.dropped = key, False

    def put(self, bucket, key, data, **kw):
        if key == self.key and not self.dropped:
            self.dropped = True
            return {"e_tag": "lost"}
        return obstore.put(bucket, key, data, **kw)

    def __getattr__(self, name):
        return getattr(obstore, name)


def _a_settled_shard(m, local) -> str:
    from cache_format.mirror import _settled_shards

    logs = {f"commits/{p.name}": p.read_bytes() for p in (local / "commits").glob("*.jsonl")}
    return sorted(_settled_shards(m, logs))[0]


def test_a_shard_the_server_does_not_show_stays_staged_and_is_sent_again(tmp_path, object_server, monkeypatch):
    """Eviction deletes the one copy, so it first asks the server (HEAD): an upload acknowledged but
    not stored keeps its file in the stage and goes up again at the next push."""
    import cache_format.mirror as mirror_mod

    m = make_manifest()
    local = tmp_path / "s.zarr"
    write_store(local, range(40), m, finalize=False)
    key, url = _a_settled_shard(m, local), object_server()
    monkeypatch.setattr(mirror_mod, "obstore", _DropsOnePut(key))
    mirror = Mirror(local, url, evict=True)
    mirror.push()
    assert (local / key).exists() and key not in {o["path"] for b in obstore.list(open_bucket(url)) for o in b}
    data = (local / key).read_bytes()
    mirror.push()
    assert not (local / key).exists() and bytes(obstore.get(open_bucket(url), key).bytes()) == data


def test_a_run_whose_shard_the_server_lost_never_goes_up_as_finalized(tmp_path, object_server):
    """The last push lists the server: a lost shard still staged is sent again; one gone from the stage
    too is one line naming it, and the root on the server does not say finalized."""
    from cache_format.index import finalize_store
    from cache_format.layout import STATE_KEY

    m = make_manifest()
    for evict in (False, True):
        local, url = tmp_path / f"s{evict}.zarr", object_server()
        write_store(local, range(40), m, finalize=False)
        key = _a_settled_shard(m, local)
        mirror = Mirror(local, url, evict=evict)
        mirror.push()
        obstore.delete(open_bucket(url), key)  # lost on the server after it was there
        finalize_store(local, m)
        if not evict:
            mirror.push(final=True)
            assert StoreReader(url).finalized and obstore.head(open_bucket(url), key)["size"] > 0
            continue
        with pytest.raises(CacheFormatError, match=f"{url}/{key}: committed by commits/w00000.jsonl but missing"):
            mirror.push(final=True)
        root = json.loads(bytes(obstore.get(open_bucket(url), "zarr.json").bytes()))
        assert not root["attributes"].get(STATE_KEY, {}).get("finalized")


def test_a_resume_refuses_a_store_whose_committed_shard_is_lost(tmp_path, object_server):
    from cache_format.mirror import writing_to

    m = make_manifest()
    local, url = tmp_path / "s.zarr", object_server()
    write_store(local, range(40), m, finalize=False)
    key = _a_settled_shard(m, local)
    Mirror(local, url).push()
    obstore.delete(open_bucket(url), key)
    with pytest.raises(CacheFormatError, match=f"{url}/{key}: committed by .* missing from the object store"):
        with writing_to(url, tmp_path / "elsewhere", ttl=2):
            pass
    Lease(url, ttl=2).acquire(wait=0).release()  # the refused resume gave its lease back


def test_a_rerun_on_the_same_stage_resumes_a_writer_whose_commits_never_went_up(tmp_path, object_server):
    """Killed before its first push, a writer's done-log and shards exist only in the stage: a rerun on
    that stage resumes them (they go up with the next push), not a store that lost them."""
    from cache_format import ShardWriter
    from cache_format.mirror import writing_to

    m = make_manifest()
    local, url = tmp_path / "s.zarr", object_server()
    write_store(local, range(20), m, finalize=False)
    Mirror(local, url).push()
    with ShardWriter(local, writer_id=1) as w:  # committed after the last push, never sent
        for i in range(20, 60):
            w.add(i, **make_sample(i, sample_length(i, m.max_len), m))
    assert _a_settled_shard(m, local).startswith("w00000/")  # writer 1's shards are settled too
    with writing_to(url, local, ttl=2) as mirror:
        mirror.arm()  # the stage checked (extraction arms it once its store is created or checked)
    remote = {o["path"] for b in obstore.list(open_bucket(url)) for o in b}
    assert "commits/w00001.jsonl" in remote and any(k.startswith("w00001/") for k in remote)


def test_a_missing_bucket_is_named_with_the_servers_reason(object_server):
    url = object_server()  # the server is up; a bucket of another name was never made
    missing = "s3://no-such-bucket-here/store"
    assert url != missing
    with pytest.raises(CacheFormatError) as got:
        Lease(missing, ttl=2).acquire(wait=0)
    msg = str(got.value)
    assert msg.startswith(f"{missing}: cannot take the writing lease (NoSuchBucket: The specified bucket does not exist")
    assert "\n" not in msg and "Debug source" not in msg
