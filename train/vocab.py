"""The draft vocabulary: the tokens a drafter may propose, when not the target's whole vocabulary.

At hidden 576 (SmolLM2) the drafter's own layers are cheap and the vocabulary is the step: every
drafted position pays a 49,152-wide lm_head matmul forward, its gradient matmul and a softmax over
49,152 floats (half the step's device time, docs/benchmarks/2026-12-02_decode-aware_h200.md). A
draft vocabulary of the N most frequent answer tokens of the training data cuts that work to N/V.
A token outside it can never be drafted, so a decode loses at most the blocks where the target
emits one; `coverage` (the share of training answer tokens inside) says how much that is. EAGLE-3
drafters and speculators' DFlash trainer use the same idea (a 32K draft vocabulary for a 128K-152K
target).

Pure functions (counts in, ids out) beside the one that counts a store's answer tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from cache_format.reader import StoreReader

__all__ = ["OUT_OF_VOCAB", "answer_token_counts", "coverage", "draft_labels", "draft_vocab",
           "target_to_draft"]

# A label the draft vocabulary cannot produce: the row keeps its place (it counts as a miss in the
# acceptance figures) but carries no loss (train.losses.draft_loss).
OUT_OF_VOCAB = -1


def draft_vocab(counts: np.ndarray, n: int) -> torch.Tensor:
    """counts [V] (answer tokens per id) -> [n] long: the n most frequent ids (ties: lower id
    first), in ascending id order."""
    if not 0 < n <= len(counts):
        raise ValueError(f"draft vocabulary size must be in 1..{len(counts)} (the target's "
                         f"vocabulary), got {n}")
    # by count desc, then id asc
    order = np.lexsort((np.arange(len(counts)), -counts.astype(np.int64)))
    return torch.from_numpy(np.sort(order[:n]).astype(np.int64))


def coverage(counts: np.ndarray, ids: torch.Tensor) -> float:
    """Share of the counted answer tokens that the draft vocabulary `ids` holds."""
    total = int(counts.sum())
    return float(counts[ids.numpy()].sum()) / total if total else 1.0


def target_to_draft(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] long: each target id's index in the draft vocabulary `ids` [n], OUT_OF_VOCAB where
    absent."""
    t2d = torch.full((vocab_size,), OUT_OF_VOCAB, dtype=torch.long)
    t2d[ids] = torch.arange(len(ids))
    return t2d


def draft_labels(labels: torch.Tensor, t2d: torch.Tensor, ignore: int) -> torch.Tensor:
    """labels [...] target ids (or `ignore`) -> draft indices, `ignore` kept, OUT_OF_VOCAB where the
    draft vocabulary lacks the token."""
    keep = labels != ignore
    return torch.where(keep, t2d.to(labels.device)[labels.clamp(min=0)], labels)


def answer_token_counts(reader: StoreReader, train_rows: np.ndarray, vocab_size: int) -> np.ndarray:
    """[V] int64: how often each id is an answer token (loss_mask 1) of the samples at the index
    rows marked in train_rows (bool [rows]); token arrays only, read one length group at a time."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    idx = reader.index
    for g, key in enumerate(idx.groups):
        rows = np.flatnonzero((idx.group == g) & train_rows)
        if not len(rows):
            continue
        arrays = reader.group_tokens(key)
        ids, mask = arrays["input_ids"], arrays["loss_mask"]
        keep = np.zeros(len(ids), dtype=bool)
        for r in rows:
            keep[int(idx.start[r]):int(idx.start[r] + idx.length[r])] = True
        keep &= mask.astype(bool)
        counts += np.bincount(ids[keep].astype(np.int64), minlength=vocab_size)[:vocab_size]
    return counts
