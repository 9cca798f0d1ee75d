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
from extract.local_server import free_port
from extract.run import run as extract
from tests.helpers import assert_same_content, content, tiny_target_dir, write_chats
from train.checkpoint import latest_checkpoint, load_checkpoint
from train.config import TrainConfig
from train.trainer import train

ROOT = Path(__file__).resolve().parents[1]


def _two_nodes(module_args: list[str]) -> None:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "dc-test",
                               *module_args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=400)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]


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
