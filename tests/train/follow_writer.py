"""A slow stage-one stand-in for the follow-mode test: creates the store after a pause (the
trainer is already waiting), commits in bursts, then finalizes."""

from __future__ import annotations

import sys
import time

from cache_format import ShardWriter, finalize_store
from cache_format.layout import read_manifest
from tests.helpers import make_sample


def create(path: str) -> None:
    import torch

    from cache_format import TargetInfo, create_store, write_frozen
    from tests.helpers import make_manifest

    cfg = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "intermediate_size": 16}
    m = make_manifest(target=TargetInfo(name="tiny", sha256="0", num_layers=4, hidden_size=8, vocab_size=100,
                                        config=cfg), rows_per_shard=64)
    create_store(path, m)
    g = torch.Generator().manual_seed(0)
    write_frozen(path, {"embed_tokens.weight": torch.randn(100, 8, generator=g),
                        "lm_head.weight": torch.randn(100, 8, generator=g), "norm.weight": torch.ones(8)})


def write(path: str, total: int, bursts: int) -> None:
    time.sleep(2.0)
    create(path)
    m = read_manifest(path)
    with ShardWriter(path, writer_id=0) as w:
        for i in range(total):
            w.add(i, **make_sample(i, 24, m))
            if (i + 1) % (total // bursts) == 0:
                w.flush()  # commit what is there: a follower can train on it
                time.sleep(1.5)
    finalize_store(path, m)


if __name__ == "__main__":
    path, total, bursts = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if "://" in path:  # a store on object storage: written in a stage directory, mirrored as extraction does
        from cache_format.mirror import writing_to

        stage = sys.argv[4]
        with writing_to(path, stage, ttl=1.2) as mirror:
            mirror.arm()
            write(stage, total, bursts)
    else:
        write(path, total, bursts)
