"""Training attention with the draft blocks drawn out: context and own block attended apart, merged.

A block query sees the context keys before its anchor and the keys of its own block (train.masks).
In one FlexAttention call over [context | blocks] the own-block keys cost a kv tile per query tile
that is 1/16 visible (sixteen 8-token blocks on its diagonal; two at 1/32 where the context does
not end on a tile), the largest share of the tiles the kernels visit at the SmolLM2 shape
(docs/benchmarks/2026-12-03_reach-full-run_h200.md). Here the context part runs alone (FlexAttention
on a GPU, a dense masked product on the CPU), the own block as a dense [block x block] product per
block, and the two softmaxes are joined by their log-sum-exps: the same attention (up to rounding).

Shapes: B batch, nh query heads, nkv kv heads, Q = N blocks x bs query rows, T context keys, hd head
dim.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["SplitMask", "block_attention", "masked_attention", "merge_attention", "split_attention"]


class SplitMask(NamedTuple):
    """What a layer needs to attend apart: the context's visibility (a FlexAttention BlockMask over
    the T context keys, or a dense bool [B, Q, T]) and the block size."""

    context: object
    block_size: int


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query row attends to every key of its own block (bidirectional), nothing else.

    q [B, nh, Q, hd], k, v [B, nkv, Q, hd] -> out [B, nh, Q, hd], lse [B, nh, Q] (float32).
    Query head h reads kv head h // (nh / nkv), as FlexAttention's enable_gqa and repeat_interleave
    do.
    """
    b, nh, q_len, hd = q.shape
    nkv, n = k.shape[1], q_len // block_size
    qb = q.reshape(b, nkv, nh // nkv, n, block_size, hd)
    kb, vb = (t.reshape(b, nkv, 1, n, block_size, hd) for t in (k, v))
    scores = (qb @ kb.transpose(-1, -2)).float() * hd ** -0.5  # [B, nkv, rep, N, bs, bs]
    lse = torch.logsumexp(scores, dim=-1)  # [B, nkv, rep, N, bs]: finite, a row always sees itself
    out = torch.exp(scores - lse[..., None]).to(v.dtype) @ vb  # [B, nkv, rep, N, bs, hd]
    return out.reshape(b, nh, q_len, hd), lse.reshape(b, nh, q_len)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention with its log-sum-exp (the CPU path and the GPU kernel's oracle).

    q [B, nh, Q, hd], k, v [B, nkv, T, hd], visible [B, Q, T] bool -> out [B, nh, Q, hd], lse [B,
    nh, Q] (float32). A row that sees no key gets out 0 and lse -inf, as FlexAttention gives it.
    """
    rep, hd = q.shape[1] // k.shape[1], q.shape[-1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)).float() * hd ** -0.5  # [B, nh, Q, T]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, nh, Q]
    # an empty row: exp(-inf - 0) = 0
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    out = torch.exp(scores - finite[..., None]).to(v.dtype) @ v
    return out, lse


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor
                    ) -> torch.Tensor:
    """The attention over the union of two disjoint key sets from each one's: out [..., hd], lse
    [...] -> out [..., hd]. lse_b must be finite (the own block is never empty); lse_a may be
    -inf."""
    top = torch.maximum(lse_a, lse_b)
    # [...]: each side's share, unnormalized
    w_a, w_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    out = (out_a.float() * w_a[..., None] + out_b.float() * w_b[..., None]) / (w_a + w_b)[..., None]
    return out.to(out_b.dtype)


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_k: torch.Tensor,
                    ctx_v: torch.Tensor, mask: SplitMask, flex=None) -> torch.Tensor:
    """q [B, nh, Q, hd], the blocks' k, v [B, nkv, Q, hd], the context's ctx_k, ctx_v [B, nkv, T,
    hd] -> out [B, nh, Q, hd]. `flex`: the flex_attention function when mask.context is a
    BlockMask."""
    if isinstance(mask.context, torch.Tensor):
        out_c, lse_c = masked_attention(q, ctx_k, ctx_v, mask.context)
    else:
        out_c, lse_c = flex(q, ctx_k.to(q.dtype), ctx_v.to(q.dtype), block_mask=mask.context,
                            enable_gqa=True, return_lse=True)
    out_b, lse_b = block_attention(q, k.to(q.dtype), v.to(q.dtype), mask.block_size)
    return merge_attention(out_c, lse_c.float(), out_b, lse_b)
