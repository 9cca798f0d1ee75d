"""The pure batch plans: epoch plan over ranks, and the held-out split."""

from __future__ import annotations

import numpy as np
import pytest

from train.data import _micro_batches, holdout_mask, node_shares, plan_epoch, plan_holdout


def _store(n=237, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.permutation(10 * n)[:n]  # sparse, unordered ids, as several writers produce
    lengths = rng.integers(5, 400, n)
    buckets = np.digitize(lengths, [128, 256])
    return ids, lengths, buckets


@pytest.mark.parametrize("ranks,accum", [(1, 1), (2, 1), (3, 2), (8, 1)])
def test_plan_epoch_properties(ranks, accum):
    ids, lengths, buckets = _store()
    by_id = {int(i): (int(n), int(b)) for i, n, b in zip(ids, lengths, buckets)}
    steps = plan_epoch(ids, lengths, buckets, token_budget=1024, seed=3, epoch=1, ranks=ranks, grad_accum=accum)
    assert steps == plan_epoch(ids, lengths, buckets, token_budget=1024, seed=3, epoch=1, ranks=ranks, grad_accum=accum)
    seen = []
    for step in steps:
        assert len(step) == ranks * accum  # every rank gets its micro-batches every step
        for mb in step:
            assert len({by_id[s][1] for s in mb}) == 1  # one length bucket per micro-batch
            assert len(mb) == 1 or len(mb) * max(by_id[s][0] for s in mb) <= 1024
            seen += mb
    assert len(seen) == len(set(seen))  # no sample twice in an epoch
    # only the last partial step is dropped: fewer than ranks*accum micro-batches' worth
    full = plan_epoch(ids, lengths, buckets, token_budget=1024, seed=3, epoch=1, ranks=1, grad_accum=1)
    assert len(full) - len(steps) * ranks * accum < ranks * accum
    other = plan_epoch(ids, lengths, buckets, token_budget=1024, seed=3, epoch=2, ranks=ranks, grad_accum=accum)
    assert other != steps  # reshuffled every epoch


def test_node_shares_cut_the_shards_into_runs_of_equal_tokens_like_a_loop():
    rng = np.random.default_rng(4)
    home = rng.integers(0, 40, 500) + (rng.integers(0, 3, 500) << 32)  # 3 groups x 40 shards
    lengths = rng.integers(5, 400, 500)
    got = node_shares(home, lengths, 3)
    total, seen, owner = int(lengths.sum()), 0, {}
    for code in sorted(set(home.tolist())):  # the oracle: walk the shards, each to the third its middle is in
        t = int(lengths[home == code].sum())
        owner[code] = min(2, int((seen + t / 2) * 3 // total))
        seen += t
    assert got.tolist() == [owner[c] for c in home.tolist()]
    runs = [owner[c] for c in sorted(owner)]
    assert runs == sorted(runs) and set(runs) == {0, 1, 2}  # contiguous runs of shards
    per_node = [int(lengths[got == k].sum()) for k in range(3)]
    biggest = max(int(lengths[home == c].sum()) for c in owner)
    assert max(per_node) - min(per_node) <= 2 * biggest  # balanced to within a shard at each cut


@pytest.mark.parametrize("nodes,ranks,accum", [(2, 2, 1), (2, 4, 2), (3, 3, 1)])
def test_node_affine_plan_keeps_each_node_in_its_share(nodes, ranks, accum):
    ids, lengths, buckets = _store(600)
    home = np.random.default_rng(1).integers(0, 30, len(ids))
    node_of = node_shares(home, lengths, nodes)
    share = {int(i): int(k) for i, k in zip(ids, node_of)}
    kw = dict(token_budget=1024, seed=3, ranks=ranks, grad_accum=accum, node_of=node_of, nodes=nodes)
    steps = plan_epoch(ids, lengths, buckets, epoch=1, **kw)
    per_node = ranks // nodes * accum
    seen = []
    for step in steps:
        assert len(step) == ranks * accum
        for j, mb in enumerate(step):  # micro-batch j belongs to rank j // accum, on node j // per_node
            assert {share[s] for s in mb} == {j // per_node}
            assert len(mb) == 1 or len(mb) * max(lengths[ids == s][0] for s in mb) <= 1024
        seen += [s for mb in step for s in mb]
    assert len(seen) == len(set(seen))
    # the oracle: each share's micro-batches in turn from one generator, then step by step, node by node,
    # until the share that runs out first
    g, order = np.random.default_rng([3, 1]), np.argsort(ids, kind="stable")
    i2, l2, b2, n2 = ids[order], lengths[order], buckets[order], node_of[order]
    shares = [_micro_batches(i2[n2 == k], l2[n2 == k], b2[n2 == k], 1024, g) for k in range(nodes)]
    want = []
    while all(len(m) >= (len(want) + 1) * per_node for m in shares):
        s = len(want)
        want.append([mb for k in range(nodes) for mb in shares[k][s * per_node:(s + 1) * per_node]])
    assert steps == want
    assert plan_epoch(ids, lengths, buckets, epoch=2, **kw) != steps  # reshuffled within the shares
    with pytest.raises(ValueError, match="do not split"):
        plan_epoch(ids, lengths, buckets, epoch=1, **{**kw, "ranks": nodes + 1})


def test_holdout_is_seeded_exact_and_order_free():
    ids, lengths, buckets = _store()
    m = holdout_mask(ids, 20, seed=5)
    assert m.sum() == 20 and np.array_equal(m, holdout_mask(ids, 20, seed=5))
    assert not np.array_equal(m, holdout_mask(ids, 20, seed=6))
    perm = np.random.default_rng(1).permutation(len(ids))
    assert set(ids[perm][holdout_mask(ids[perm], 20, seed=5)]) == set(ids[m])  # same samples in any order
    with pytest.raises(ValueError):
        holdout_mask(ids, len(ids), seed=0)
    # the held-out samples are split over ranks, each exactly once, none dropped
    for ranks in (1, 2, 3, 7):
        got = [s for r in range(ranks) for mb in plan_holdout(ids[m], lengths[m], buckets[m], token_budget=512,
                                                               ranks=ranks, rank=r) for s in mb]
        assert sorted(got) == sorted(ids[m].tolist())


def test_plan_depends_on_the_sample_set_not_the_index_order():
    ids, lengths, buckets = _store()
    perm = np.random.default_rng(2).permutation(len(ids))
    a = plan_epoch(ids, lengths, buckets, token_budget=1024, seed=1, epoch=0, ranks=2, grad_accum=1)
    b = plan_epoch(ids[perm], lengths[perm], buckets[perm], token_budget=1024, seed=1, epoch=0, ranks=2, grad_accum=1)
    assert a == b


def _grouped_oracle(keys: np.ndarray, n: int, seed: int) -> set[int]:
    """Row indices held out: whole prompts in the seeded order of the sorted distinct keys, until >= n rows."""
    distinct = sorted(set(keys.tolist()))
    order = np.random.default_rng([seed, 7]).permutation(len(distinct))
    rows: set[int] = set()
    for g in order:
        if len(rows) >= n:
            break
        rows |= {i for i, k in enumerate(keys.tolist()) if k == distinct[g]}
    return rows


@pytest.mark.parametrize("n", [1, 7, 20, 60])
def test_holdout_by_prompt_takes_whole_prompts_like_the_loop(n):
    ids, _, _ = _store()
    rng = np.random.default_rng(4)
    keys = rng.integers(0, 50, len(ids)) * 1_000_003  # ~50 prompts, 1-12 responses each
    m = holdout_mask(ids, n, seed=5, prompt_keys=keys)
    assert set(np.flatnonzero(m).tolist()) == _grouped_oracle(keys, n, 5)
    assert not set(keys[m]) & set(keys[~m])  # no prompt on both sides
    biggest = np.unique(keys, return_counts=True)[1].max()
    assert n <= m.sum() < n + biggest
    perm = rng.permutation(len(ids))
    assert set(ids[perm][holdout_mask(ids[perm], n, seed=5, prompt_keys=keys[perm])]) == set(ids[m])
    with pytest.raises(ValueError, match="prompt"):
        holdout_mask(ids, n, seed=5, prompt_keys=np.zeros(len(ids), np.int64))  # one prompt: nothing to train on


@pytest.mark.parametrize("compression,dtype", [("none", "fp8_e4m3"), ("blosc-zstd1", "fp8_e4m3"), ("none", "mxfp4")])
def test_quantized_batches_stay_quantized_until_to_device_and_then_equal_the_host_decode(tmp_path, compression,
                                                                                         dtype):
    # the workers hand the stored bits and scales on; after to_device the taps must be bit for bit
    # what collating the reader's own dequantized samples gives (same anchors: same generator seed)
    import torch

    from cache_format import StoreReader, TargetInfo
    from tests.helpers import make_manifest, write_store
    from train.data import BatchDataset, CollateSettings, collate, to_device

    # mxfp4 blocks are 32 values: a hidden size of 64 (two blocks a tap)
    target = TargetInfo(name="tiny", sha256="0" * 64, num_layers=4, hidden_size=64, vocab_size=100)
    m = make_manifest(dtype=dtype, compression=compression, **({"target": target} if dtype == "mxfp4" else {}))
    write_store(tmp_path / "s.zarr", range(12), m)
    micro = [[0, 5, 7], [3], [11, 2]]
    kw = dict(tap_index=[1], num_stored_taps=2, num_anchors=4, block_size=4, mask_token_id=99, with_last_hidden=True)
    settings = CollateSettings(**{**kw, "tap_index": (1,)})
    ds = BatchDataset(str(tmp_path / "s.zarr"), micro, [0, 1, 2], settings, seed=3, epoch=1)
    reader = StoreReader(tmp_path / "s.zarr")
    for i, ids in enumerate(micro):
        item = ds[i]
        per_tap = 1 if dtype == "fp8_e4m3" else m.target.hidden_size // 32
        assert item["hidden"].dtype == torch.uint8 and item["hidden_scale"].shape == (*item["hidden"].shape[:2], per_tap)
        got = to_device(item, torch.device("cpu"))
        g = torch.Generator().manual_seed((3 * 1_000_003 + 1) * 1_000_003 + i)
        want = collate(reader.get_batch(ids), generator=g, **kw)
        assert "hidden_scale" not in got and got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def test_collate_lists_the_labelled_rows_the_loss_gathers(tmp_path):
    import torch

    from cache_format import StoreReader
    from tests.helpers import make_manifest, write_store
    from train.data import collate

    write_store(tmp_path / "s.zarr", range(6), make_manifest())
    reader = StoreReader(tmp_path / "s.zarr")
    kw = dict(tap_index=[0], num_stored_taps=2, num_anchors=5, block_size=4, mask_token_id=99, with_last_hidden=False)
    for ids in ([0, 3, 5], [1], [2, 4]):
        b = collate(reader.get_batch(ids), generator=torch.Generator().manual_seed(0), **kw)
        flat = b["labels"].flatten()
        # the loop: every position whose label is not IGNORE, in row-major order
        want = [i for i in range(len(flat)) if flat[i] != -100]
        assert b["labelled"].dtype == torch.long and b["labelled"].tolist() == want and want
