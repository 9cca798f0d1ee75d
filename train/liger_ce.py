"""Liger's cross-entropy kernel as the fused loss's per-chunk softmax and gradient
(--ce-kernel liger).

train.losses' fused path forms each chunk's row losses, hits and d(row loss)/d(logits) right after
the lm_head matmul (train.losses._head_grad, compiled with --compile). Liger's Triton kernel does
the same for plain cross-entropy in one program per row, writing the gradient over the logits in
place (liger-kernel, https://github.com/linkedin/Liger-Kernel). Its kernel is called directly, not
through its `cross_entropy_forward`, because that one reads two host values a call (a sync per
chunk) and keeps the loss in the logits' dtype. With reduction "none" the kernel leaves each row's
gradient unscaled: softmax - onehot, which the fused path's backward scales by each row's loss
weight. The kernel's arguments are those of liger-kernel 0.8.5 (the pinned optional extra `liger`).
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["liger_available", "liger_head_grad"]


def liger_available() -> bool:
    """Whether the liger-kernel package is installed (found, not imported: importing it loads
    Triton)."""
    return importlib.util.find_spec("liger_kernel") is not None


def liger_head_grad(logits: torch.Tensor, labels: torch.Tensor, t_logits, kl_weight: float,
                    divergence: str = "kl", penalty: float = 0.0
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """train.losses._head_grad for plain cross-entropy: logits [c, V] (overwritten), labels [c]
    -> row losses [c] float32, d row loss / d logits [c, V] (the logits' buffer and dtype), hits
    [c]."""
    if t_logits is not None or kl_weight or penalty:
        raise ValueError("--ce-kernel liger computes plain cross-entropy only (no soft labels, no "
                         "confidence penalty)")
    import torch
    from liger_kernel.ops.cross_entropy import MAX_FUSED_SIZE, liger_cross_entropy_kernel

    logits = logits.contiguous()
    c, v = logits.shape
    loss = torch.zeros(c, dtype=torch.float32, device=logits.device)
    acc = torch.zeros(c, dtype=torch.float32, device=logits.device)
    if c:
        liger_cross_entropy_kernel[(c,)](
            X_ptr=logits, X_stride=logits.stride(-2), Y_ptr=labels, Y_stride=labels.stride(-1),
            weight_ptr=None, loss_ptr=loss, z_loss_ptr=None, loss_stride=loss.stride(-1),
            token_accuracy_ptr=acc, token_accuracy_stride=acc.stride(-1),
            predicted_tokens_ptr=None, predicted_tokens_stride=0, n_cols=v, n_non_ignore=c,
            sum_non_ignore_weight=c, ignore_index=-100, weight_sum=0.0, lse_square_scale=0.0,
            label_smoothing=0.0, reduction="none", softcap=None, RETURN_Z_LOSS=False,
            RETURN_TOKEN_ACCURACY=True, RETURN_PREDICTED_TOKENS=False,
            BLOCK_SIZE=min(MAX_FUSED_SIZE, 1 << (v - 1).bit_length()), HAS_WEIGHT=False,
            HAS_SOFTCAPPING=False, HAS_GRADIENTS=True, num_warps=32)
    return loss, logits, acc > 0
