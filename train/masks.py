"""DFlash training attention masks: dense (CPU, SDPA) and FlexAttention (GPU), from one rule.

Key/value layout per sequence: [context 0..T-1 | block 0 | block 1 | ...], queries are the blocks.
A query in block b with anchor p sees: context kv < p (strictly before the anchor: at inference
the anchor's own target state is not yet known; an inclusive <= was a real bug, SpecForge #473),
every token of its own block (bidirectional), nothing of other blocks. Padded blocks (anchor -1)
see only themselves, so softmax never meets an empty row; their labels are IGNORE.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["FLEX_KERNELS", "FLEX_TILE", "FlexMask", "block_tiles", "dense_context_mask",
           "dense_mask", "flex_block_mask", "flex_context_mask", "use_flex_attention"]

FLEX_TILE = 128  # the BlockMask tile: query rows x keys the kernels take or skip as one

# FlexAttention kernel_options by name (--flex-kernel): None leaves inductor's defaults; "tuned" is
# what its max-autotune picked for the preset's training step on an H200 (head dim 64, 9 query and
# 3 kv heads, 128-token mask tiles: docs/results/levers-h200-3/), without the minutes of autotuning
# at every new shape: forward 128 x 64 tiles, backward 32/64 and 64/32, 4 warps, 3 stages.
FLEX_KERNELS = {
    "default": None,
    "tuned": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_warps": 4, "fwd_num_stages": 3,
              "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32,
              "bwd_num_warps": 4, "bwd_num_stages": 3},
}


class FlexMask(NamedTuple):
    """A FlexAttention BlockMask and the kernel options to attend with (None: inductor's own)."""

    block: object
    options: dict | None


def dense_mask(anchors: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    """anchors [B, N] (-1 = padding) -> bool [B, N*bs, ctx_len + N*bs], True = may attend."""
    b, n = anchors.shape
    q_blk = torch.arange(n * block_size, device=anchors.device) // block_size  # [Q]
    # [B, Q, Q]: the keys of the row's own block
    own = (q_blk[:, None] == q_blk[None, :]).expand(b, -1, -1)
    return torch.cat([dense_context_mask(anchors, ctx_len, block_size), own], dim=-1)


def dense_context_mask(anchors: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    """The context part of dense_mask alone: anchors [B, N] -> bool [B, N*bs, ctx_len]
    (train.attention)."""
    q_blk = torch.arange(anchors.shape[1] * block_size, device=anchors.device) // block_size  # [Q]
    return torch.arange(ctx_len, device=anchors.device)[None, None] < anchors[:, q_blk, None]


def block_tiles(anchors: torch.Tensor, ctx_len: int, block_size: int, tile: int = FLEX_TILE, *,
                blocks: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Which [tile x tile] tiles of the mask are partly and which fully visible, straight from the
    anchors.

    anchors [B, N] -> (partial, full), bool [B, QT, KVT] with QT = ceil(N*bs / tile), KVT = ceil(KV
    / tile). Exactly what create_block_mask finds by evaluating the mask over the whole [Q, KV] grid
    (rows and keys past the ends count as hidden, so a tile that crosses an end is never full), but
    with no grid and no compile: per query row only the row's anchor and own block matter. With
    blocks=False the keys are the context's alone (KV = ctx_len: dense_context_mask's tiles).
    """
    b, n = anchors.shape
    q_len = n * block_size
    kv_len = ctx_len + q_len if blocks else ctx_len
    qt, kvt = -(-q_len // tile), -(-kv_len // tile)
    dev = anchors.device
    rows = torch.arange(qt * tile, device=dev)  # [R] query rows, padded to whole tiles
    exists = rows < q_len
    blk = (rows // block_size).clamp(max=n - 1)
    a = torch.where(exists[None], anchors[:, blk], -1)[..., None]  # [B, R, 1] anchor per row
    own_lo = (ctx_len + blk * block_size)[None, :, None]  # [1, R, 1] the row's own block keys
    own_hi = own_lo + block_size
    lo = torch.arange(kvt, device=dev) * tile  # [KVT] first key of each kv tile
    hi = lo + tile
    ctx_hi = hi.clamp(max=ctx_len)
    # some key visible: a context key below the anchor, or a key of the row's own block
    some = lo < a.clamp(0, ctx_len)  # [B, R, KVT]
    if blocks:
        some = some | (torch.maximum(lo, own_lo) < torch.minimum(hi, own_hi))
    # every key visible: the tile's context part below the anchor, its block part inside the own
    # block
    every = (hi <= kv_len) & ((lo >= ctx_len) | (ctx_hi <= a)) & \
        ((hi <= ctx_len) | ((own_lo <= lo.clamp(min=ctx_len)) & (hi <= own_hi)))
    some = (some & exists[None, :, None]).view(b, qt, tile, kvt).any(2)
    full = (every & exists[None, :, None]).view(b, qt, tile, kvt).all(2)
    return some & ~full, full


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [B, QT, KVT] -> (count [B, 1, QT], indices [B, 1, QT, KVT]): the set tiles' kv indices
    first, ascending."""
    idx = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True)
    return tiles.sum(-1, dtype=torch.int32)[:, None], idx.to(torch.int32)[:, None]


def _block_mask(partial: torch.Tensor, full: torch.Tensor, mask_mod, tile: int,
                seq_lengths: tuple[int, int]):
    """A FlexAttention BlockMask (H=None) from block_tiles' partly and fully visible tiles."""
    from torch.nn.attention.flex_attention import BlockMask

    (kv_num, kv_idx), (full_num, full_idx) = _ordered(partial), _ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(tile, tile),
                                    mask_mod=mask_mod, seq_lengths=seq_lengths)


def flex_block_mask(anchors: torch.Tensor, ctx_len: int, block_size: int, tile: int = FLEX_TILE):
    """The same rule as a FlexAttention BlockMask (H=None: no per-head copy, SpecForge #452).

    The tiles come from block_tiles rather than create_block_mask: that one evaluates the mask over
    the whole grid, which on a GPU wants torch.compile, and its cold compile was the first minutes
    of a fresh machine's first step (docs/BENCHMARKS.md). The partly visible tiles still apply
    mask_mod elementwise inside the kernel.
    """
    q_len = anchors.shape[1] * block_size

    def mask_mod(bi, _h, q_idx, kv_idx):
        q_blk = q_idx // block_size
        anchor = anchors[bi, q_blk]
        in_ctx = kv_idx < ctx_len
        own = (kv_idx - ctx_len) // block_size == q_blk
        return (in_ctx & (kv_idx < anchor)) | (~in_ctx & own)

    return _block_mask(*block_tiles(anchors, ctx_len, block_size, tile), mask_mod, tile,
                       (q_len, ctx_len + q_len))


def flex_context_mask(anchors: torch.Tensor, ctx_len: int, block_size: int, tile: int = FLEX_TILE):
    """dense_context_mask as a FlexAttention BlockMask over the ctx_len context keys only."""
    q_len = anchors.shape[1] * block_size

    def mask_mod(bi, _h, q_idx, kv_idx):
        return kv_idx < anchors[bi, q_idx // block_size]

    return _block_mask(*block_tiles(anchors, ctx_len, block_size, tile, blocks=False),
                       mask_mod, tile, (q_len, ctx_len))


# FlexAttention's kernels refuse smaller heads (inductor's "NYI: embedding dimension")
FLEX_MIN_HEAD_DIM = 16


def use_flex_attention(choice: str, device_type: str, head_dim: int) -> bool:
    """Whether training attends with FlexAttention (else SDPA over the dense mask).

    auto takes FlexAttention on a GPU where its kernels apply; flex where they cannot raises a
    one-line ValueError instead of an error from deep inside inductor; sdpa never.
    """
    if choice not in ("auto", "flex", "sdpa"):
        raise ValueError(f"attention {choice!r}: choose auto, flex or sdpa")
    fits = head_dim >= FLEX_MIN_HEAD_DIM
    if choice == "flex" and device_type != "cuda":
        raise ValueError("--attention flex needs a GPU (FlexAttention has no backward on CPU); use "
                         "auto or sdpa")
    if choice == "flex" and not fits:
        raise ValueError(f"--attention flex needs a head dimension >= {FLEX_MIN_HEAD_DIM}; the "
                         f"drafter's is {head_dim}")
    return choice == "flex" or (choice == "auto" and device_type == "cuda" and fits)
