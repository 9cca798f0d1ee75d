"""Weighted cross-entropy (and optionally a divergence from the target's distribution: forward KL
or total variation) over the frozen lm_head, in chunks.

By default slot k >= 1 of a block has weight exp(-(k-1)/gamma) (DFlash Eq. 4; gamma = 7 for block
16); decode-aware weights (`Weighting`, train.replay) are built from the same forward's hits. The
loss is sum(w * loss) / sum(w) over supervised slots. Logits for all draft positions never exist
at once: rows go through lm_head in chunks, and by default each chunk's gradient is formed in the
forward pass so backward needs neither its logits nor a second lm_head matmul.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from train.anchors import IGNORE
from train.config import CE_KERNELS, DIVERGENCES, LOSS_BACKWARDS, POSITION_WEIGHTS
from train.replay import block_accepts, reach_weights, visit_weights
from train.vocab import OUT_OF_VOCAB

__all__ = ["LossOut", "Weighting", "acceptance_from_acc", "decay_weights", "draft_loss"]


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
    """loss (scalar, differentiable), weight_sum, correct[B], count[B] (per block slot); with
    `replay`, also accepts [b, N] (accepted drafts per block: train.replay.block_accepts)."""


def _loss_rows(logits, labels, t_logits, kl_weight: float, divergence: str = "kl",
               penalty: float = 0.0):
    """From one chunk's logits [c, V] (and the teacher's, or None): per-row loss [c], student
    log-probs [c, V] (float32), its softmax [c, V] where TV or the penalty needed it (else None),
    teacher probs [c, V] (or None), argmax hits [c], the student's entropy [c] (or None). The row
    loss is (1 - w) CE + w D - penalty H, D = KL(teacher || student) or TV = 0.5 sum |student -
    teacher|, H the student's entropy (the confidence penalty of Pereyra et al. 2017, arXiv
    1701.06548)."""
    logp = F.log_softmax(logits.float(), dim=-1)
    loss = -logp.gather(1, labels[:, None])[:, 0] * (1 - kl_weight)
    q = t_p = ent = None
    if penalty > 0:
        q = logp.exp()
        ent = -(q * logp).sum(-1)  # [c]
        loss = loss - penalty * ent
    if t_logits is not None:
        t_logp = F.log_softmax(t_logits.float(), dim=-1)
        t_p = t_logp.exp()
        if divergence == "tv":
            q = logp.exp() if q is None else q
            loss = loss + kl_weight * 0.5 * (q - t_p).abs().sum(-1)
        else:
            loss = loss + kl_weight * (t_p * (t_logp - logp)).sum(-1)
    return loss, logp, q, t_p, logp.argmax(-1) == labels, ent


def _chunk_terms(h, lm_head, labels, teacher, kl_weight, divergence="kl", penalty=0.0):
    t_logits = teacher @ lm_head.T if kl_weight > 0 else None
    loss, _, _, _, hit, _ = _loss_rows(h @ lm_head.T, labels, t_logits, kl_weight, divergence,
                                       penalty)
    return loss, hit


def _head_grad(logits, labels, t_logits, kl_weight: float, divergence: str = "kl",
               penalty: float = 0.0):
    """One chunk's per-row loss [c], d(row loss)/d(logits) [c, V] in the logits' dtype, and hits
    [c]: with q the softmax, d = (1 - w)(q - onehot) + w dD + penalty q (log q + H), where dD = q -
    p_teacher for KL and, for TV, 0.5 q (s - <s, q>) with s = sign(q - p_teacher) (the softmax's
    Jacobian applied to 0.5 s); the last term is -dH/dlogits."""
    loss, logp, q, t_p, hit, ent = _loss_rows(logits, labels, t_logits, kl_weight, divergence,
                                              penalty)
    # [c, V], before q is reused in place
    conf = q * (logp + ent[:, None]) if ent is not None else None
    # the softmax: TV's, or in place of the log-probs (no longer needed)
    d = logp.exp_() if q is None else q
    if t_p is not None and divergence == "tv":
        s = torch.sign(d - t_p)  # [c, V]
        tv = 0.5 * d * (s - (s * d).sum(-1, keepdim=True))
        d.mul_(1 - kl_weight).add_(tv, alpha=kl_weight)
    elif t_p is not None:
        d.sub_(t_p, alpha=kl_weight)
    if conf is not None:
        d.add_(conf, alpha=penalty)
    d[torch.arange(len(d), device=d.device), labels] -= 1 - kl_weight
    return loss, d.to(logits.dtype), hit


@functools.lru_cache(maxsize=1)
def _compiled_head_grad():
    """_head_grad compiled once per process: its casts, softmax and gradient fuse into few passes
    over the [c, V] logits instead of one pass per eager op."""
    return torch.compile(_head_grad, dynamic=True)


def _chunk_grad(ce_kernel: str, compiled: bool):
    """The fused path's per-chunk loss and gradient: ours (compiled or eager) or Liger's kernel."""
    if ce_kernel not in CE_KERNELS:
        raise ValueError(f"ce_kernel must be one of {CE_KERNELS}, got {ce_kernel!r}")
    if ce_kernel == "liger":
        from train.liger_ce import liger_head_grad

        return liger_head_grad
    return _compiled_head_grad() if compiled else _head_grad


class _FusedHeadLoss(torch.autograd.Function):
    """Chunked lm_head + per-row loss whose backward needs no logits. The lm_head is frozen, so the
    gradient with respect to the rows is the one it needs; each chunk forms it in the forward pass,
    right after its softmax (d row loss / d logits: _head_grad), and keeps only that [c, H] result.
    Same FLOPs as keeping the logits, memory of one chunk, no recomputed matmul. The rows' loss
    weights are applied by autograd afterwards (backward scales each row's gradient by its weight),
    so weights built from this very forward's hits cost nothing extra.

    With a Markov head (bias_rows [n, r] against bias_head [V, r], the trainable W2) the logits are
    [rows | bias_rows] @ [lm_head | bias_head].T. W2's gradient, sum_i g_i d_i b_i^T, needs each
    row's weight g_i, known only in backward: each chunk's d [c, V] is kept (the size of the
    logits in their dtype) rather than recomputing the logits and their softmax there."""

    @staticmethod
    def forward(ctx, rows, lm_head, labels, teacher, kl_weight, divergence, penalty,
                chunk, head_grad, bias_rows, bias_head):
        head = bias_head is not None
        # [n, H (+ r)], [V, H (+ r)]; the teacher's logits stay those of lm_head alone
        x, weight, _ = _with_head(rows, lm_head, None, bias_rows, bias_head) if head else \
            (rows, lm_head, None)
        losses, grads, hits, ds = [], [], [], []  # ds: the head's per-chunk d, kept for backward
        for i in range(0, len(rows), chunk):
            sl = slice(i, i + chunk)
            t_logits = teacher[sl] @ lm_head.T if teacher is not None else None  # [c, V]
            part, d, hit = head_grad(x[sl] @ weight.T, labels[sl], t_logits, kl_weight,
                                     divergence, penalty)
            losses.append(part)
            # [c, H (+ r)]; d has the logits' (= lm_head's) dtype
            grads.append((d @ weight).to(x.dtype))
            hits.append(hit)
            if head:
                ds.append(d)
        # the chunks' d stay apart: backward reads them a chunk at a time, so no [n, V] copy
        ctx.save_for_backward(torch.cat(grads) if grads else torch.zeros_like(x),
                              *((bias_rows, *ds) if head else ()))
        ctx.chunk, ctx.h, ctx.vocab = chunk, rows.shape[1], len(weight)
        ctx.w2_dtype = bias_head.dtype if head else None
        loss = torch.cat(losses) if losses else rows.new_zeros(0, dtype=torch.float32)
        hit = torch.cat(hits) if hits else torch.zeros(0, dtype=torch.bool, device=rows.device)
        ctx.mark_non_differentiable(hit)
        return loss, hit

    @staticmethod
    def backward(ctx, g_loss, g_hit):
        grad, *head = ctx.saved_tensors
        gx = grad * g_loss[:, None].to(grad.dtype)  # [n, H (+ r)]
        g_rows, g_bias, g_w2 = gx[:, :ctx.h], None, None
        if ctx.w2_dtype is not None:
            bias_rows, *ds = head
            g_bias = gx[:, ctx.h:]
            # [V, r]: the sum over the rows of g_i d_i b_i^T, a chunk at a time
            g_w2 = bias_rows.new_zeros(ctx.vocab, bias_rows.shape[1], dtype=torch.float32)
            for i, d in zip(range(0, len(bias_rows), ctx.chunk), ds):
                sl = slice(i, i + ctx.chunk)
                scaled = d * g_loss[sl, None].to(d.dtype)  # [c, V]
                g_w2 += (scaled.T @ bias_rows[sl].to(d.dtype)).float()
            g_w2 = g_w2.to(ctx.w2_dtype)
        return g_rows, None, None, None, None, None, None, None, None, g_bias, g_w2


def _row_losses(rows, lm_head, lab, tea, kl_weight, divergence, penalty, chunk, backward, head_grad,
                bias=None):
    """Per-row loss [n] (differentiable) and argmax hits [n] over the chunks. head_grad: the fused
    path's per-chunk loss and gradient (_head_grad or a stand-in). bias: a Markov head's (bias_rows
    [n, r], bias_head [V, r]) or None."""
    grad = torch.is_grad_enabled() and rows.requires_grad
    if bias is not None:  # the head's factors in the dtypes of the rows and lm_head they join; W2
        # never below its own, so that its gradient (the W2 dtype's) is not rounded to autocast's
        bias = bias[0].to(rows.dtype), bias[1].to(torch.promote_types(lm_head.dtype, bias[1].dtype))
    if grad and backward == "fused":
        return _FusedHeadLoss.apply(rows, lm_head, lab, tea if kl_weight > 0 else None, kl_weight,
                                    divergence, penalty, chunk, head_grad, *(bias or (None, None)))
    if bias is not None:
        rows, lm_head, tea = _with_head(rows, lm_head, tea, *bias)
    losses, hits = [], []
    for i in range(0, len(rows), chunk):
        sl = slice(i, i + chunk)
        args = (rows[sl], lm_head, lab[sl], tea[sl] if tea is not None else None, kl_weight,
                divergence, penalty)
        if grad and backward == "recompute":
            part, hit = checkpoint(_chunk_terms, *args, use_reentrant=False)
        else:
            part, hit = _chunk_terms(*args)
        losses.append(part)
        hits.append(hit)
    if not losses:
        return (rows.new_zeros(0, dtype=torch.float32),
                torch.zeros(0, dtype=torch.bool, device=rows.device))
    return torch.cat(losses), torch.cat(hits)


def _with_head(rows, lm_head, tea, bias_rows, bias_head):
    """A Markov head as a wider matmul: [rows | previous token's embedding] [n, H + r] against
    [lm_head | W2] [V, H + r] gives the drafter's logits plus the head's bias in one product per
    chunk; the teacher's rows get zeros (its logits have no head)."""
    rows = torch.cat([rows, bias_rows], -1)
    lm_head = torch.cat([lm_head, bias_head], -1)
    return rows, lm_head, F.pad(tea, (0, bias_head.shape[1])) if tea is not None else None


def draft_loss(hidden: torch.Tensor, labels: torch.Tensor, lm_head: torch.Tensor, *,
               block_size: int, gamma: float, teacher: torch.Tensor | None = None,
               kl_weight: float = 0.0, divergence: str = "kl", confidence_penalty: float = 0.0,
               chunk: int = 2048, backward: str = "fused", compiled: bool = False,
               ce_kernel: str = "torch",
               weighting: Weighting | None = None, anchors: torch.Tensor | None = None,
               spans: torch.Tensor | None = None, replay: bool = False,
               bias_rows: torch.Tensor | None = None, bias_head: torch.Tensor | None = None,
               labelled: torch.Tensor | None = None) -> LossOut:
    """hidden [B, Q, H] drafter output, labels [B, Q] (IGNORE = no loss) indexing lm_head's rows
    (OUT_OF_VOCAB: a token a draft vocabulary lacks, no loss, never a hit); teacher [B, Q, H]/None.

    teacher is the target's final (post-norm) state at position p+k-1 for slot k: its lm_head
    distribution is the soft label for token p+k, weighted kl_weight against CE through
    `divergence` (kl: forward KL, tv: total variation). `confidence_penalty` beta subtracts beta
    times the drafter's entropy from each row's loss (Pereyra et al. 2017), so its runners-up keep
    some probability for a draft tree's siblings. `backward`: "fused" forms each chunk's row
    gradient in the forward pass (no logits kept, no extra matmul), "recompute" checkpoints each
    chunk (one more lm_head matmul in backward), "keep" keeps every chunk's logits (most memory).
    `ce_kernel` "torch" forms the fused path's per-chunk softmax and gradient by ours (compiled
    with `compiled`), "liger" by Liger's kernel (train.liger_ce: plain CE on a GPU).

    The row weights are the position decay exp(-(k-1)/gamma) unless `weighting` asks for
    decode-aware ones, built from this forward's own hits (train.replay): `anchors` and `spans`
    [B, N] are the blocks' anchor positions and response spans, needed for the anchor weights and
    for `replay` (the accepted drafts per block, returned as "accepts").

    bias_rows [B, Q, r], bias_head [V, r]: a Markov head (train.markov_head) adds bias_rows @
    bias_head.T to the logits; "fused" then also keeps each chunk's logit gradient (the size of
    the logits) for the head's W2 gradient in backward.

    labelled [n]: the labelled rows' flat indices as the collate lists them (_labelled_at).
    """
    _check_options(backward, divergence, kl_weight, teacher)
    b, q, h = hidden.shape
    lm_head = _head_dtype(lm_head, hidden)
    slot = torch.arange(q, device=hidden.device) % block_size
    keep = labels != IGNORE
    at = _labelled_at(keep, labelled)  # [n] x 2
    rows, lab, s = hidden[at], labels[at], slot[at[1]]
    in_vocab = lab != OUT_OF_VOCAB  # a label the draft vocabulary lacks (train.vocab): a miss
    tea = teacher[at].to(rows.dtype) if teacher is not None else None  # bf16; f32 on a CPU
    bias = (bias_rows[at], bias_head) if bias_rows is not None else None  # [n, r], [V, r]
    grad_fn = _chunk_grad(ce_kernel, compiled)  # the fused path's per-chunk loss and gradient
    row_loss, hit = _row_losses(rows, lm_head, lab.clamp(min=0), tea, kl_weight, divergence,
                                confidence_penalty, chunk, backward, grad_fn, bias)
    hit = hit & in_vocab
    loss, wsum, dense = _weighted_mean(row_loss, hit, keep, at, in_vocab, weighting or Weighting(),
                                       anchors, spans, block_size=block_size, gamma=gamma,
                                       replay=replay)
    zeros = torch.zeros(block_size, device=hidden.device)  # [block]: hits and rows per slot
    out = LossOut(loss=loss, weight_sum=wsum.detach(),
                  correct=zeros.index_add(0, s, hit.float()).detach(),
                  count=zeros.index_add(0, s, torch.ones_like(hit, dtype=torch.float32)).detach())
    if replay:
        out["accepts"] = block_accepts(dense)
    return out


def _check_options(backward: str, divergence: str, kl_weight: float, teacher) -> None:
    """draft_loss's refusals, one line each."""
    for name, value, allowed in (("backward", backward, LOSS_BACKWARDS),
                                 ("divergence", divergence, DIVERGENCES)):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    if kl_weight > 0 and teacher is None:
        raise ValueError("a divergence term (--loss kl or mix) needs the stored final hidden state "
                         "(extract with --last-hidden)")


def _labelled_at(keep: torch.Tensor, labelled: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """keep [B, Q] -> the batch row and the query [n] of each labelled row, row-major. From
    `labelled`, their flat indices as train.data's collate lists them on the host; without it they
    are found on the device, which reads their count back: a host sync, and the host stops queueing
    the step's later work (and the next batch's copy) ahead of the GPU. Indexing by them gathers
    what keep as a boolean mask would (a mask becomes these very indices), in its order."""
    if labelled is None:
        labelled = keep.flatten().nonzero().squeeze(1)  # [n]
    q = keep.shape[1]
    return labelled // q, labelled % q


def _head_dtype(lm_head: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The frozen lm_head in the dtype its matmuls run in: autocast's, cast once here rather than
    by every chunk's matmuls (the same values), else the rows' (CPU float32 over a bf16 store)."""
    if torch.is_autocast_enabled(hidden.device.type):
        return lm_head.to(torch.get_autocast_dtype(hidden.device.type))
    return lm_head.to(hidden.dtype)


def _weighted_mean(row_loss, hit, keep, at, in_vocab, weighting: Weighting, anchors, spans, *,
                   block_size: int, gamma: float, replay: bool):
    """The labelled rows' loss [n] averaged by their weights: (loss, weight sum, and the hits laid
    out by block [B, N, bs] where the weights or `replay` need them, else None). keep [B, Q] marks
    the labelled rows, at ([n] x 2) indexes them, hit and in_vocab [n] are theirs."""
    b, q = keep.shape
    dense = None
    if replay or weighting.decode_aware:
        dense = torch.zeros(b, q, dtype=torch.bool, device=keep.device).masked_scatter_(keep, hit)
        dense = dense.view(b, q // block_size, block_size)  # [B, N, bs]
    # [B, Q]
    w_all = weighting.row_weights(dense, keep, anchors, spans, block_size=block_size, gamma=gamma)
    w = w_all[at] * in_vocab
    wsum = w.sum()
    return (row_loss * w).sum() / wsum.clamp(min=1e-12), wsum, dense


@dataclass(frozen=True, kw_only=True)
class Weighting:
    """Which loss weights a block's slots get (train.replay builds the decode-aware ones)."""

    position: str = "decay"
    """decay: exp(-(k-1)/gamma) per slot k (DFlash Eq. 4); reach: each slot by the accepted tokens
    it leads to in this batch (train.replay.reach_weights)."""
    visit_weight: float = 0.0
    """Extra weight of the blocks whose anchors decoding with the current drafter visits (0:
    none)."""

    def __post_init__(self) -> None:
        if self.position not in POSITION_WEIGHTS:
            raise ValueError(f"position weights must be one of {POSITION_WEIGHTS}, got "
                             f"{self.position!r}")
        if not self.visit_weight >= 0:
            raise ValueError(f"visit_weight must be >= 0, got {self.visit_weight}")

    @property
    def decode_aware(self) -> bool:
        return self.position != "decay" or self.visit_weight > 0

    def row_weights(self, hit: torch.Tensor | None, keep: torch.Tensor,
                    anchors: torch.Tensor | None,
                    spans: torch.Tensor | None, *, block_size: int, gamma: float) -> torch.Tensor:
        """float32 [B, Q] loss weight of each query row (0 where unlabelled is harmless: those rows
        are dropped).

        hit [B, N, bs] (this forward's hits; needed when decode_aware), keep [B, Q] labelled
        rows."""
        b, q = keep.shape
        if self.position == "reach":
            per_slot = reach_weights(hit, keep.view(hit.shape))
        else:
            per_slot = decay_weights(block_size, gamma)  # made on the host as ever
            if keep.device.type != "cpu":  # a copy from pageable memory may wait for the GPU
                per_slot = per_slot.pin_memory().to(keep.device, non_blocking=True)
        w = per_slot.repeat(q // block_size).expand(b, q)  # [B, Q]
        if self.visit_weight > 0:
            if anchors is None or spans is None:
                raise ValueError("visit weights need the blocks' anchors and spans")
            visit = visit_weights(anchors, block_accepts(hit), spans, self.visit_weight)  # [B, N]
            w = w * visit.repeat_interleave(block_size, dim=1)
        return w


def default_gamma(block_size: int) -> float:
    """gamma = 7 for block 16, 5 for 10, 4 for 8 (DFlash paper); interpolated elsewhere."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size,
                                          max(1.0, 7.0 * math.log(block_size) / math.log(16)))
