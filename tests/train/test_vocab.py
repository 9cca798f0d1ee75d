"""The draft vocabulary: its choice, the counts it is chosen from, and the loss over it, each
against a naive loop; a drafter trained with one decodes losslessly through its export."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cache_format import StoreReader
from tests.helpers import make_manifest, write_store
from train.anchors import IGNORE
from train.losses import decay_weights, draft_loss
from train.vocab import (
    OUT_OF_VOCAB,
    answer_token_counts,
    coverage,
    draft_labels,
    draft_vocab,
    target_to_draft,
)


def test_draft_vocab_takes_the_most_frequent_ids_lower_id_first_on_ties():
    counts = np.array([5, 0, 9, 5, 1, 9, 0, 5])
    for n in range(1, len(counts) + 1):
        # naive: walk the ids by (count desc, id asc), keep the first n, report them in id order
        naive = sorted(sorted(range(len(counts)), key=lambda i: (-counts[i], i))[:n])
        assert draft_vocab(counts, n).tolist() == naive
    ids = draft_vocab(counts, 3)  # 2, 5 and 0 (the lowest of the three 5s)
    assert ids.tolist() == [0, 2, 5] and coverage(counts, ids) == pytest.approx(23 / 34)
    for bad in (0, 9):
        with pytest.raises(ValueError, match="draft vocabulary size must be in 1..8"):
            draft_vocab(counts, bad)


def test_labels_map_to_draft_indices_or_out_of_vocabulary():
    ids = torch.tensor([1, 4, 6])
    t2d = target_to_draft(ids, 8)
    assert t2d.tolist() == [-1, 0, -1, -1, 1, -1, 2, -1]
    labels = torch.tensor([[IGNORE, 4, 3, 6], [1, IGNORE, 0, 7]])
    naive = [[IGNORE if x == IGNORE else (ids.tolist().index(x) if x in ids.tolist() else OUT_OF_VOCAB) for x in row]
             for row in labels.tolist()]
    assert draft_labels(labels, t2d, IGNORE).tolist() == naive


def test_answer_token_counts_equal_a_loop_over_the_training_samples(tmp_path):
    m = make_manifest()
    write_store(tmp_path / "s.zarr", range(40), m)
    reader = StoreReader(tmp_path / "s.zarr")
    rng = np.random.default_rng(0)
    train_rows = rng.random(len(reader)) < 0.7  # a held-out share left out
    naive = np.zeros(m.target.vocab_size, dtype=np.int64)
    for row, sid in enumerate(reader.sample_ids):
        if train_rows[row]:
            s = reader.get(int(sid))
            for tok, on in zip(s.input_ids.tolist(), s.loss_mask.tolist()):
                naive[tok] += on
    got = answer_token_counts(reader, train_rows, m.target.vocab_size)
    assert got.sum() > 100 and np.array_equal(got, naive)


@pytest.mark.parametrize("backward", ["fused", "keep"])
def test_loss_over_a_draft_vocabulary_equals_a_loop_over_its_rows(backward):
    """Rows whose label the draft vocabulary lacks carry no loss or gradient and count as misses;
    the rest are cross-entropy over the draft vocabulary's rows of the lm_head."""
    g = torch.Generator().manual_seed(0)
    b, bs, h, v = 2, 4, 8, 30
    ids = torch.tensor([0, 3, 4, 9, 12, 17, 20, 29])
    head = torch.randn(v, h, generator=g)
    hidden = torch.randn(b, 3 * bs, h, generator=g).requires_grad_(True)
    labels = torch.randint(0, v, (b, 3 * bs), generator=g)
    labels[:, ::bs] = IGNORE  # the anchor slots
    labels[0, 5] = 3  # one surely in the draft vocabulary, one surely not
    labels[1, 6] = 5
    out = draft_loss(hidden, draft_labels(labels, target_to_draft(ids, v), IGNORE), head[ids], block_size=bs,
                     gamma=2.0, chunk=5, backward=backward)
    out["loss"].backward()
    w = decay_weights(bs, 2.0)
    num = den = 0.0
    correct, count = torch.zeros(bs), torch.zeros(bs)
    ref_h = hidden.detach().clone().requires_grad_(True)
    for i in range(b):
        for q in range(3 * bs):
            lab, k = int(labels[i, q]), q % bs
            if lab == IGNORE:
                continue
            count[k] += 1
            if lab not in ids.tolist():
                continue  # out of the draft vocabulary: a miss, no loss
            logits = ref_h[i, q] @ head[ids].T
            target = ids.tolist().index(lab)
            num = num - w[k] * F.log_softmax(logits, -1)[target]
            den += float(w[k])
            correct[k] += float(logits.argmax() == target)
    (num / den).backward()
    assert out["loss"].item() == pytest.approx(float(num.detach()) / den, rel=1e-5)
    assert torch.allclose(hidden.grad, ref_h.grad, atol=1e-6)
    assert float(hidden.grad[1, 6].abs().sum()) == 0.0
    assert torch.equal(out["correct"], correct) and torch.equal(out["count"], count)
