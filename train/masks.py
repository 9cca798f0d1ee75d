"""DFlash training attention masks: dense (CPU, SDPA) and FlexAttention (GPU), from one rule.

Key/value layout per sequence: [context 0..T-1 | block 0 | block 1 | ...], queries are the blocks.
A query in block b with anchor p sees: context kv < p (strictly before the anchor: at inference
the anchor's own target state is not yet known; an inclusive <= was a real bug, SpecForge #473),
every token of its own block (bidirectional), nothing of other blocks. Padded blocks (anchor -1)
see only themselves, so softmax never meets an empty row; their labels are IGNORE.
"""

from __future__ import annotations

import torch

__all__ = ["dense_mask", "flex_block_mask"]


def dense_mask(anchors: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    """anchors [B, N] (-1 = padding) -> bool [B, N*bs, ctx_len + N*bs], True = may attend."""
    b, n = anchors.shape
    q_blk = torch.arange(n * block_size, device=anchors.device) // block_size  # [Q]
    kv = torch.arange(ctx_len + n * block_size, device=anchors.device)  # [KV]
    anchor_q = anchors[:, q_blk]  # [B, Q]
    ctx_ok = (kv[None, None] < ctx_len) & (kv[None, None] < anchor_q[..., None])
    kv_blk = (kv - ctx_len).div(block_size, rounding_mode="floor")
    blk_ok = (kv[None, None] >= ctx_len) & (kv_blk[None, None] == q_blk[None, :, None])
    return ctx_ok | blk_ok


def flex_block_mask(anchors: torch.Tensor, ctx_len: int, block_size: int):
    """The same rule as a FlexAttention BlockMask (H=None: no per-head copy, SpecForge #452)."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, n = anchors.shape
    q_len, kv_len = n * block_size, ctx_len + n * block_size

    def mask_mod(bi, _h, q_idx, kv_idx):
        q_blk = q_idx // block_size
        anchor = anchors[bi, q_blk]
        in_ctx = kv_idx < ctx_len
        own = (kv_idx - ctx_len) // block_size == q_blk
        return (in_ctx & (kv_idx < anchor)) | (~in_ctx & own)

    compile_ = anchors.device.type == "cuda"  # compiled: block-sparse build, no dense [Q, KV] grid
    return create_block_mask(mask_mod, B=b, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=anchors.device,
                             _compile=compile_)
