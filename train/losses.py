"""Position-decayed cross-entropy (and optional forward KL) over the frozen lm_head, in chunks.

Slot k >= 1 of a block has weight exp(-(k-1)/gamma) (DFlash Eq. 4; gamma = 7 for block 16); the
loss is sum(w * loss) / sum(w) over supervised slots. Logits for all draft positions never exist
at once: rows go through lm_head in chunks under activation checkpointing.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from train.anchors import IGNORE

__all__ = ["LossOut", "acceptance_from_acc", "decay_weights", "draft_loss"]


def decay_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[B] weights: slot 0 gets 0, slot k >= 1 gets exp(-(k-1)/gamma)."""
    k = torch.arange(block_size, dtype=torch.float32)
    return torch.where(k >= 1, torch.exp(-(k - 1) / gamma), torch.zeros(()))


def acceptance_from_acc(acc: list[float]) -> float:
    """Teacher-forced expected acceptance 1 + sum_k prod_{i<=k} acc_i (bonus token included)."""
    tau, run = 1.0, 1.0
    for a in acc:
        run *= a
        tau += run
    return tau


class LossOut(dict):
    """loss (scalar, differentiable), weight_sum, correct[B], count[B] (per block slot)."""


def _chunk_terms(h, lm_head, labels, w, teacher, kl_weight):
    logits = (h @ lm_head.T).float()  # [c, V]
    ce = F.cross_entropy(logits, labels, reduction="none")
    loss = ce * (1 - kl_weight) if kl_weight < 1 else torch.zeros_like(ce)
    if kl_weight > 0:
        t_logp = F.log_softmax((teacher @ lm_head.T).float(), dim=-1)
        kl = (t_logp.exp() * (t_logp - F.log_softmax(logits, dim=-1))).sum(-1)
        loss = loss + kl_weight * kl
    return (loss * w).sum(), (logits.argmax(-1) == labels)


def draft_loss(hidden: torch.Tensor, labels: torch.Tensor, lm_head: torch.Tensor, *, block_size: int,
               gamma: float, teacher: torch.Tensor | None = None, kl_weight: float = 0.0,
               chunk: int = 2048, recompute: bool = True) -> LossOut:
    """hidden [B, Q, H] drafter output, labels [B, Q] (IGNORE = no loss); teacher [B, Q, H] or None.

    teacher is the target's final (post-norm) state at position p+k-1 for slot k: its lm_head
    distribution is the soft label for token p+k. `recompute` checkpoints each chunk (its logits
    are rebuilt in backward: one more lm_head matmul, far less memory); without it every chunk's
    logits stay alive until backward.
    """
    b, q, h = hidden.shape
    if lm_head.dtype != hidden.dtype and not torch.is_autocast_enabled(hidden.device.type):
        lm_head = lm_head.to(hidden.dtype)  # CPU float32 training over a bf16 store
    slot = torch.arange(q, device=hidden.device) % block_size
    w_all = decay_weights(block_size, gamma).to(hidden.device)[slot].expand(b, q)
    keep = labels != IGNORE
    rows, lab, w, s = hidden[keep], labels[keep], w_all[keep], slot.expand(b, q)[keep]
    # the store's teacher states are bf16; on CPU the drafter trains in float32 (no autocast)
    tea = teacher[keep].to(rows.dtype) if teacher is not None else None
    if kl_weight > 0 and tea is None:
        raise ValueError("KL loss needs the stored final hidden state (extract with --last-hidden)")
    total = hidden.new_zeros((), dtype=torch.float32)
    hits = []
    for i in range(0, len(rows), chunk):
        sl = slice(i, i + chunk)
        args = (rows[sl], lm_head, lab[sl], w[sl], tea[sl] if tea is not None else None, kl_weight)
        if torch.is_grad_enabled() and recompute:
            part, hit = checkpoint(_chunk_terms, *args, use_reentrant=False)
        else:
            part, hit = _chunk_terms(*args)
        total = total + part
        hits.append(hit)
    hit = torch.cat(hits) if hits else torch.zeros(0, dtype=torch.bool, device=hidden.device)
    wsum = w.sum()
    correct = torch.zeros(block_size, device=hidden.device).index_add_(0, s, hit.float())
    count = torch.zeros(block_size, device=hidden.device).index_add_(0, s, torch.ones_like(hit, dtype=torch.float32))
    loss = total / wsum.clamp(min=1e-12)
    return LossOut(loss=loss, weight_sum=wsum.detach(), correct=correct.detach(), count=count.detach())


def default_gamma(block_size: int) -> float:
    """gamma = 7 for block 16, 5 for 10, 4 for 8 (DFlash paper); interpolated elsewhere."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, 7.0 * math.log(block_size) / math.log(16)))
