"""train.attention: the context and the own block attended apart and merged equal one attention over both."""

from __future__ import annotations

import pytest
import torch

from tests.train.test_step import DC, _batch
from train.attention import block_attention, masked_attention, merge_attention
from train.masks import FLEX_TILE, dense_context_mask, flex_context_mask
from train.model import DFlashDrafter
from train.step import LossSettings, forward_backward


def _qkv(g, b=2, nh=4, nkv=2, q=24, t=24, hd=8):
    return (torch.randn(b, nh, q, hd, generator=g), torch.randn(b, nkv, t, hd, generator=g),
            torch.randn(b, nkv, t, hd, generator=g))


def _naive(q, k, v, visible):
    """Row by row, head by head: softmax over the visible keys (empty row: zeros and -inf)."""
    b, nh, nq, hd = q.shape
    rep = nh // k.shape[1]
    out, lse = torch.zeros_like(q), torch.full((b, nh, nq), float("-inf"))
    for i in range(b):
        for h in range(nh):
            for r in range(nq):
                keys = visible[i, r].nonzero().flatten()
                if len(keys):
                    s = k[i, h // rep, keys] @ q[i, h, r] * hd ** -0.5
                    lse[i, h, r] = torch.logsumexp(s, 0)
                    out[i, h, r] = torch.softmax(s, 0) @ v[i, h // rep, keys]
    return out, lse


def test_masked_attention_equals_a_row_by_row_softmax_and_empty_rows_give_zero():
    g = torch.Generator().manual_seed(0)
    q, k, v = _qkv(g)
    visible = torch.rand(2, 24, 24, generator=g) < 0.4
    visible[0, 3] = False  # a row that sees nothing
    out, lse = masked_attention(q, k, v, visible)
    ref_out, ref_lse = _naive(q, k, v, visible)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, ref_lse)
    assert torch.isinf(lse[0, :, 3]).all() and (out[0, :, 3] == 0).all()


def test_block_attention_sees_exactly_the_own_block():
    g = torch.Generator().manual_seed(1)
    q, k, v = _qkv(g, q=24, t=24)
    blk = torch.arange(24) // 8
    own = (blk[:, None] == blk[None, :]).expand(2, 24, 24)
    out, lse = block_attention(q, k, v, 8)
    ref_out, ref_lse = _naive(q, k, v, own)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, ref_lse)


def test_merging_two_disjoint_key_sets_equals_attending_to_their_union():
    g = torch.Generator().manual_seed(2)
    q, k, v = _qkv(g, t=40)
    a = torch.rand(2, 24, 40, generator=g) < 0.3
    a[1, 5] = False  # no key of the first set: the merge takes the second alone
    b = (torch.rand(2, 24, 40, generator=g) < 0.3) & ~a
    b[..., 0] = ~a[..., 0]  # every row sees at least one key of the second set
    merged = merge_attention(*masked_attention(q, k, v, a), *masked_attention(q, k, v, b))
    torch.testing.assert_close(merged, _naive(q, k, v, a | b)[0], rtol=1e-5, atol=1e-6)


def test_the_context_mask_sees_the_keys_before_each_blocks_anchor():
    anchors = _batch(torch.Generator().manual_seed(0))["anchors"]
    got = dense_context_mask(anchors, 300, 8)  # [B, Q, T]
    for i in range(anchors.shape[0]):
        for r in range(got.shape[1]):
            p = int(anchors[i, r // 8])
            assert got[i, r].tolist() == [kv < p for kv in range(300)]


@pytest.mark.parametrize("ctx", [300, 384])
def test_the_flex_context_mask_covers_every_visible_key_and_calls_full_only_full_tiles(ctx):
    anchors = _batch(torch.Generator().manual_seed(0))["anchors"]
    bm = flex_context_mask(anchors, ctx, 8)
    dense = dense_context_mask(anchors, ctx, 8)  # [B, Q, T]
    b, q, t = dense.shape
    bi, qi, ki = torch.meshgrid(torch.arange(b), torch.arange(q), torch.arange(t), indexing="ij")
    assert torch.equal(bm.mask_mod(bi, torch.zeros_like(bi), qi, ki), dense)
    pad = torch.zeros(b, -(-q // FLEX_TILE) * FLEX_TILE, -(-t // FLEX_TILE) * FLEX_TILE, dtype=torch.bool)
    pad[:, :q, :t] = dense
    tiles = pad.view(b, pad.shape[1] // FLEX_TILE, FLEX_TILE, pad.shape[2] // FLEX_TILE, FLEX_TILE)
    some, every = tiles.any(4).any(2), tiles.all(4).all(2)  # [B, QT, KVT]
    listed = bm.to_dense()[:, 0].bool()  # partly or fully visible tiles, as the kernels will visit them
    assert (listed | ~some).all()  # no visible key in an unlisted tile
    full = torch.zeros_like(listed)
    for i in range(b):
        for r in range(full.shape[1]):
            n = int(bm.full_kv_num_blocks[i, 0, r])
            full[i, r, bm.full_kv_indices[i, 0, r, :n].long()] = True
    assert (every | ~full).all()  # a tile called full is visible throughout


@pytest.mark.parametrize("tile", [1, FLEX_TILE])
def test_a_split_step_equals_the_whole_masks_step(tile):
    """Loss, hits and gradients of the dense split path against the dense mask over [context | blocks]."""
    batch = _batch(torch.Generator().manual_seed(0), lens=(300, 20), n=32)  # padded blocks see no context
    assert (batch["anchors"] < 0).any()
    outs = []
    for split in (False, True):
        g = torch.Generator().manual_seed(1)
        model = DFlashDrafter(DC, torch.randn(300, 64, generator=g), torch.randn(300, 64, generator=g))
        torch.manual_seed(0)
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.05)
        out = forward_backward(model, batch, LossSettings(block_size=DC.block_size, gamma=4.0, split_blocks=split,
                                                          context_tile=tile))
        outs.append((out, torch.cat([p.grad.flatten() for p in model.parameters()])))
    (whole, g_whole), (split, g_split) = outs
    torch.testing.assert_close(split["loss"], whole["loss"], rtol=1e-5, atol=1e-6)
    assert torch.equal(split["correct"], whole["correct"])
    assert torch.isfinite(g_split).all()
    torch.testing.assert_close(g_split, g_whole, rtol=1e-4, atol=1e-6)
