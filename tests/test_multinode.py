"""Two torchrun launchers on one machine (--nnodes 2, rendezvous on 127.0.0.1, gloo) produce the
same store and the same training result as one node."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from extract.config import ExtractConfig
from extract.regenerate.local_server import free_port
from extract.run import run as extract
from tests.helpers import assert_same_content, content, tiny_target_dir, write_chats
from train.checkpoint import latest_checkpoint, load_checkpoint
from train.config import TrainConfig
from train.trainer import train

ROOT = Path(__file__).resolve().parents[1]


def _two_nodes(module_args: list[str], node_env: list[dict[str, str]] | None = None) -> None:
    port = free_port()
    envs = [dict(os.environ, PYTHONPATH=str(ROOT), **(node_env[i] if node_env else {})) for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "dc-test",
                               *module_args], cwd=ROOT, env=envs[i], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(2)]
    outs = [p.communicate(timeout=400)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]



def _store_on_server(tmp_path, object_server, chats: int, rows_per_shard: int) -> tuple[Path, str]:
    """A tiny target's store of `chats` conversations, written locally and pushed to the object server."""
    from cache_format.mirror import Mirror

    target = tiny_target_dir(tmp_path / "t", "qwen3")
    data = write_chats(tmp_path / "d.jsonl", chats, cyclic=True)
    local = tmp_path / "one.zarr"
    extract(ExtractConfig(store=str(local), target=target, data=data, layers=(0, 2, 4), max_len=256, min_supervised=4,
                          token_budget=512, rows_per_shard=rows_per_shard))
    url = object_server()
    Mirror(local, url).push()
    return local, url


def _data_files(store: Path) -> set[str]:
    """The shard files (hidden states and tokens) of a store or of a node's cached copy of one."""
    from cache_format.remote import _is_data

    return {k for k in (p.relative_to(store).as_posix() for p in store.rglob("*") if p.is_file()) if _is_data(k)}


def _cached_copy(cache: Path) -> Path:
    (copy,) = [d for d in cache.iterdir() if d.is_dir()]
    return copy

@pytest.mark.slow
def test_two_nodes_extract_and_train_equal_one_node(tmp_path):
    target = tiny_target_dir(tmp_path / "t", "qwen3")
    data = write_chats(tmp_path / "d.jsonl", 30, cyclic=True)
    one, two = tmp_path / "one.zarr", tmp_path / "two.zarr"
    common = dict(target=target, data=data, layers=(0, 2, 4), max_len=256, min_supervised=4, token_budget=512,
                  rows_per_shard=64)
    extract(ExtractConfig(store=str(one), **common))
    _two_nodes(["-m", "extract", "--store", str(two), "--target", target, "--data", data, "--layers", "0,2,4",
                "--max-len", "256", "--min-supervised", "4", "--token-budget", "512", "--rows-per-shard", "64"])
    assert {p.stem for p in (two / "commits").glob("w*.jsonl")} == {f"w{i:05d}" for i in range(6)}  # 2 ranks x 3 writers
    assert_same_content(content(one), content(two), exact=False)

    targs = dict(num_layers=1, block_size=4, num_anchors=16, epochs=50, token_budget=512, lr=3e-3, log_every=5,
                 workers=0, seed=3, max_steps=10)
    train(TrainConfig(store=str(one), out=str(tmp_path / "r1"), grad_accum=2, **targs))
    _two_nodes(["-m", "train", "--store", str(one), "--out", str(tmp_path / "r2"), "--num-layers", "1",
                "--block-size", "4", "--num-anchors", "16", "--epochs", "50", "--token-budget", "512", "--lr", "3e-3",
                "--log-every", "5", "--workers", "0", "--seed", "3", "--max-steps", "10"])
    wa, _, _ = load_checkpoint(latest_checkpoint(tmp_path / "r1"))
    wb, _, _ = load_checkpoint(latest_checkpoint(tmp_path / "r2"))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-3, atol=1e-4)


@pytest.mark.slow
def test_two_nodes_train_from_object_storage_each_into_its_own_cache(tmp_path, object_server):
    """No shared filesystem: the store lives on the object server; each node copies its metadata and
    fetches only the shards of the samples it reads, into a cache of its own; the weights equal one
    node's trained from the local store."""
    local, url = _store_on_server(tmp_path, object_server, 60, rows_per_shard=32)
    targs = dict(num_layers=1, block_size=4, num_anchors=16, epochs=50, token_budget=512, lr=3e-3, log_every=1,
                 workers=0, seed=3, max_steps=2)
    train(TrainConfig(store=str(local), out=str(tmp_path / "r1"), grad_accum=2, **targs))
    caches = [tmp_path / "node0-cache", tmp_path / "node1-cache"]
    _two_nodes(["-m", "train", "--store", url, "--out", str(tmp_path / "r2"), "--num-layers", "1", "--block-size", "4",
                "--num-anchors", "16", "--epochs", "50", "--token-budget", "512", "--lr", "3e-3", "--log-every", "1",
                "--workers", "0", "--seed", "3", "--max-steps", "2"],
               node_env=[{"DRAFTCACHE_STORE_CACHE": str(c)} for c in caches])
    wa, _, _ = load_checkpoint(latest_checkpoint(tmp_path / "r1"))
    wb, _, _ = load_checkpoint(latest_checkpoint(tmp_path / "r2"))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-3, atol=1e-4)
    store_data = _data_files(local)
    for c in caches:
        fetched = _data_files(_cached_copy(c))
        assert fetched and fetched < store_data, (len(fetched), len(store_data))  # only what its samples needed


@pytest.mark.slow
def test_node_affine_epochs_fetch_each_nodes_share_only(tmp_path, object_server):
    """With --node-affine each node trains on a fixed share of the shards over every epoch, so over
    several epochs each node's cache holds its share (plus the neighbours its samples run into), not
    the whole store."""
    local, url = _store_on_server(tmp_path, object_server, 80, rows_per_shard=1024)
    caches = [tmp_path / "node0-cache", tmp_path / "node1-cache"]
    _two_nodes(["-m", "train", "--store", url, "--out", str(tmp_path / "r"), "--num-layers", "1", "--block-size", "4",
                "--num-anchors", "16", "--epochs", "4", "--token-budget", "256", "--log-every", "1", "--workers", "0",
                "--node-affine"],
               node_env=[{"DRAFTCACHE_STORE_CACHE": str(c)} for c in caches])
    store_data, fetched = _data_files(local), [_data_files(_cached_copy(c)) for c in caches]
    assert fetched[0] | fetched[1] == store_data  # four epochs read every share
    for f in fetched:  # about half the store each: its own run of shards
        assert 0 < len(f) <= 0.6 * len(store_data), ([len(x) for x in fetched], len(store_data))
    shared = fetched[0] & fetched[1]
    assert len(shared) <= 2 * 4, sorted(shared)  # where the runs meet: a shard or two (x 4 arrays), not the store
