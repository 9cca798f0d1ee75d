"""Shared test helpers: small manifests and random samples (no model, no download)."""

from __future__ import annotations

import torch

from cache_format import DatasetInfo, Manifest, ShardWriter, TargetInfo, create_store, finalize_store

H, N_LAYERS, VOCAB = 8, 4, 100


def make_manifest(**kw) -> Manifest:
    args = dict(
        target=TargetInfo(name="tiny", sha256="0" * 64, num_layers=N_LAYERS, hidden_size=H, vocab_size=VOCAB),
        tokenizer_sha256="tok", layer_ids=(0, 2), last_hidden=True,
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
