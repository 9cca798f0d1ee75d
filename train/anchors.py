"""Anchor sampling and block construction (pure functions; randomness only via a Generator).

An anchor p is a supervised position whose successor is supervised too. Its block is
[token p, MASK x (B-1)] at positions p..p+B-1, and slot k predicts token p+k (same-position
labels; SpecForge PR #473 fixed the shifted variant). Slot 0 is the anchor itself: no loss.
"""

from __future__ import annotations

import torch

__all__ = ["IGNORE", "build_blocks", "previous_tokens", "sample_anchors"]

IGNORE = -100


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int,
                   generator: torch.Generator) -> torch.Tensor:
    """loss_mask [L] -> sorted distinct anchors [n], n = min(num_anchors, #valid), uniform at
    random."""
    m = loss_mask.bool()
    valid = torch.nonzero(m[:-1] & m[1:]).flatten()  # p with p and p+1 supervised
    if len(valid) <= num_anchors:
        return valid
    pick = torch.randperm(len(valid), generator=generator)[:num_anchors]
    return valid[pick].sort().values


def build_blocks(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor,
                 block_size: int,
                 mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(block ids, positions, labels), each [n * block_size], for the anchors of one sequence.

    labels[b*B + k] = input_ids[p+k] when k >= 1, p+k < L and loss_mask[p+k]; else IGNORE.
    """
    n, length = len(anchors), len(input_ids)
    k = torch.arange(block_size)
    pos = anchors[:, None] + k[None]  # [n, B]
    ids = torch.full((n, block_size), mask_token_id, dtype=torch.long)
    ids[:, 0] = input_ids[anchors]
    inside = pos < length
    safe = pos.clamp(max=length - 1)
    labels = torch.where(inside & loss_mask[safe].bool() & (k[None] >= 1), input_ids[safe], IGNORE)
    return ids.flatten(), pos.flatten(), labels.flatten()


def previous_tokens(block_ids: torch.Tensor, labels: torch.Tensor, block_size: int) -> torch.Tensor:
    """block_ids, labels [..., n * block_size] (build_blocks) -> [..., n * block_size]: the true
    token before each slot, what a Markov head reads (train.markov_head): slot 1's is the anchor's
    token, slot k's the label of slot k - 1; 0 where that label is IGNORE (its slot has none either)
    and at slot 0 (no loss)."""
    ids = block_ids.reshape(*block_ids.shape[:-1], -1, block_size)  # [..., n, B]
    lab = labels.reshape(ids.shape)
    # [..., n, B]
    prev = torch.cat([torch.zeros_like(ids[..., :1]), ids[..., :1], lab[..., 1:-1]], -1)
    return prev.clamp(min=0).reshape(block_ids.shape)
