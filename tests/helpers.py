"""Shared test helpers: small manifests and random samples (no model, no download)."""

from __future__ import annotations

import torch

from bench.common import tiny_target_dir, tiny_tokenizer, write_chats  # noqa: F401 - one home: the benches build the same tiny targets and data
from cache_format import (
    DatasetInfo,
    Manifest,
    ShardWriter,
    StoreReader,
    TargetInfo,
    create_store,
    finalize_store,
)
from extract.config import ExtractConfig

H, N_LAYERS, VOCAB = 8, 4, 100


def make_manifest(**kw) -> Manifest:
    args = dict(
        target=TargetInfo(name="tiny", sha256="0" * 64, num_layers=N_LAYERS, hidden_size=H, vocab_size=VOCAB),
        tokenizer_sha256="tok", layer_ids=(0, 2), mask_token_id=VOCAB - 1, last_hidden=True,
        dataset=DatasetInfo(path="data.jsonl", sha256="d" * 64, num_records=1000),
        max_len=128, bucket_bounds=(16, 48, 128), rows_per_shard=32, rows_per_chunk=8,
    )
    args.update(kw)
    return Manifest(**args)


def make_sample(sample_id: int, length: int, m: Manifest) -> dict[str, torch.Tensor]:
    """Deterministic random sample for `sample_id` (so any process can rebuild the reference)."""
    g = torch.Generator().manual_seed(1000 + sample_id)
    out = {
        "input_ids": torch.randint(0, m.target.vocab_size, (length,), generator=g),
        "loss_mask": torch.randint(0, 2, (length,), generator=g),
        "hidden": torch.randn(length, m.row_width, generator=g) * 3,
    }
    if m.last_hidden:
        out["last_hidden"] = torch.randn(length, m.target.hidden_size, generator=g)
    return out


def sample_length(sample_id: int, max_len: int = 128) -> int:
    return 2 + (sample_id * 7919) % (max_len - 2)


def write_store(path, ids, m: Manifest, *, writer_id: int = 0, finalize: bool = True) -> None:
    create_store(path, m)
    with ShardWriter(path, writer_id=writer_id) as w:
        for i in ids:
            w.add(i, **make_sample(i, sample_length(i, m.max_len), m))
    if finalize:
        finalize_store(path, m)


def assert_sample_equal(got, ref: dict[str, torch.Tensor]) -> None:
    assert torch.equal(got.input_ids, ref["input_ids"].long())
    assert torch.equal(got.loss_mask.long(), ref["loss_mask"].long())
    assert torch.equal(got.hidden, ref["hidden"].bfloat16())
    if "last_hidden" in ref:
        assert torch.equal(got.last_hidden, ref["last_hidden"].bfloat16())


def extract_cfg(store, target, data, **kw):
    """The stage-one config the extraction tests share (three taps, small shards), overridden by kw."""
    args = dict(store=str(store), target=target, data=data, layers=(0, 2, 4), max_len=256, min_supervised=4,
                token_budget=512, rows_per_shard=64)
    args.update(kw)
    return ExtractConfig(**args)


def content(path) -> dict[int, tuple]:
    """Every sample of a store: id -> (input_ids, loss_mask, hidden, last_hidden)."""
    r = StoreReader(path)
    return {s.sample_id: (s.input_ids, s.loss_mask, s.hidden, s.last_hidden) for s in r.get_batch(r.sample_ids)}


def assert_same_content(a, b, exact=True):
    """Two stores' content() hold the same samples, bit for bit (exact) or within bf16 rounding."""
    assert sorted(a) == sorted(b)
    for sid in a:
        for x, y in zip(a[sid], b[sid]):
            if exact or not x.is_floating_point():
                assert torch.equal(x, y), sid
            else:  # another batch shape may round a bf16 value the other way
                torch.testing.assert_close(x.float(), y.float(), atol=2e-2, rtol=2e-2)


def metric_rows(run) -> list[dict]:
    """The rows of a training run's metrics.jsonl, in order."""
    import json
    from pathlib import Path

    return [json.loads(x) for x in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def run_losses(run) -> list[float]:
    """The training rows' losses of a run, in order (held-out rows have val_loss only)."""
    return [r["loss"] for r in metric_rows(run) if "loss" in r]


def train_cfg(store, out, **kw):
    """A TrainConfig for a 1-layer drafter on a tiny store (the trainer tests' defaults), overridden by kw."""
    from train.config import TrainConfig

    args = dict(store=store, out=str(out), num_layers=1, block_size=4, num_anchors=16, epochs=200, token_budget=512,
                lr=3e-3, warmup=0.05, log_every=5, workers=0, seed=3)
    args.update(kw)
    return TrainConfig(**args)


def kill_after(run, step: int) -> None:
    """Leave `run` as a run killed just after its step-`step` checkpoint: the later step-N go."""
    import shutil
    from pathlib import Path

    for ck in (Path(run) / "checkpoints").glob("step-*"):
        if int(ck.name[5:]) > step:
            shutil.rmtree(ck)


def trainer_clock(monkeypatch, *, tick: float = 0.0, slow: str = "", cost: float = 0.0) -> list[float]:
    """A fake clock for train.trainer and train.state: each reading moves it `tick` seconds, each call
    of train.trainer's function `slow` (e.g. evaluate_holdout) `cost` seconds; returns [now]."""
    import types

    import train.state as state
    import train.trainer as trainer

    now = [1000.0]

    def clock():
        now[0] += tick
        return now[0]

    fake = types.SimpleNamespace(time=clock, sleep=lambda s: None)
    monkeypatch.setattr(trainer, "time", fake)
    monkeypatch.setattr(state, "time", fake)
    if slow:
        real = getattr(trainer, slow)

        def costly(*args, **kwargs):
            now[0] += cost
            return real(*args, **kwargs)

        monkeypatch.setattr(trainer, slow, costly)
    return now
