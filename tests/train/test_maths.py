"""Pure training maths against loop oracles: anchors, blocks, masks, losses, acceptance."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from train.anchors import IGNORE, build_blocks, sample_anchors
from train.losses import acceptance_from_acc, decay_weights, draft_loss
from train.masks import block_tiles, dense_mask, flex_block_mask, use_flex_attention


def mask_oracle(anchors: list[list[int]], ctx_len: int, bs: int) -> torch.Tensor:
    b, n = len(anchors), len(anchors[0])
    out = torch.zeros(b, n * bs, ctx_len + n * bs, dtype=torch.bool)
    for i in range(b):
        for q in range(n * bs):
            blk, p = q // bs, anchors[i][q // bs]
            for kv in range(ctx_len + n * bs):
                if kv < ctx_len:
                    out[i, q, kv] = kv < p  # strictly before the anchor
                else:
                    out[i, q, kv] = (kv - ctx_len) // bs == blk
    return out


@pytest.mark.parametrize("ctx_len,bs,anchors", [
    (10, 4, [[0, 3, 7], [2, 5, -1]]),
    (33, 16, [[1, 20], [31, -1]]),
    (5, 2, [[0, 1, 2, 3]]),
    (64, 8, [[10, 11, 40, 62]]),
])
def test_dense_mask_matches_loop(ctx_len, bs, anchors):
    got = dense_mask(torch.tensor(anchors), ctx_len, bs)
    assert torch.equal(got, mask_oracle(anchors, ctx_len, bs))
    assert got.any(-1).all()  # no query row is empty (padded blocks see themselves)


def test_flex_mask_matches_loop_on_cpu():
    anchors = [[1, 20, 30], [31, 5, -1]]
    try:
        bm = flex_block_mask(torch.tensor(anchors), 40, 16)
    except Exception as e:  # noqa: BLE001 - flex may be unavailable on some CPU builds
        pytest.skip(f"FlexAttention BlockMask unavailable on CPU: {e}")
    dense = bm.to_dense()  # block-level [B, H, Qblocks, KVblocks]: use the mask_mod directly instead
    assert dense.shape[0] == 2
    b, q, kv = torch.meshgrid(torch.arange(2), torch.arange(48), torch.arange(88), indexing="ij")
    got = bm.mask_mod(b, torch.zeros_like(b), q, kv)
    assert torch.equal(got, mask_oracle(anchors, 40, 16))


@pytest.mark.parametrize("ctx_len,bs,tile,anchors", [
    (40, 16, 128, [[1, 20, 30], [31, 5, -1]]),  # one tile each way: partial everywhere
    (70, 4, 8, [[69, 64, 0, -1, 33], [16, 24, 40, 48, 8]]),  # context tiles fully visible, crossing tiles
    (20, 16, 8, [[19, 3]]),  # tile < block: block-part tiles can be full, and a tile across the context end
    (64, 8, 16, [[63, 62, 61, 60, 10, 11, 12, 13]]),
    (7, 2, 4, [[6, 5, 4, 3, 2, 1, 0]]),
])
@pytest.mark.parametrize("blocks", [True, False])
def test_block_tiles_match_the_loop_oracle(ctx_len, bs, tile, anchors, blocks):
    dense = mask_oracle(anchors, ctx_len, bs)  # [B, Q, KV]
    if not blocks:  # the context's keys alone (train.attention's context part)
        dense = dense[..., :ctx_len]
    b, q, kv = dense.shape
    qt, kvt = -(-q // tile), -(-kv // tile)
    padded = torch.zeros(b, qt * tile, kvt * tile, dtype=torch.bool)  # rows and keys past the ends: hidden
    padded[:, :q, :kv] = dense
    per_tile = padded.view(b, qt, tile, kvt, tile).permute(0, 1, 3, 2, 4).reshape(b, qt, kvt, tile * tile)
    want_full, want_some = per_tile.all(-1), per_tile.any(-1)
    partial, full = block_tiles(torch.tensor(anchors), ctx_len, bs, tile, blocks=blocks)
    assert torch.equal(full, want_full)
    assert torch.equal(partial, want_some & ~want_full)


def test_flex_block_mask_tiles_equal_create_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    anchors = torch.tensor([[0, 150, 299, -1, 7], [100, 101, 102, 103, 104]])
    ctx_len, bs = 300, 16
    ours = flex_block_mask(anchors, ctx_len, bs, tile=32)
    theirs = create_block_mask(ours.mask_mod, B=2, H=None, Q_LEN=5 * bs, KV_LEN=ctx_len + 5 * bs, device="cpu",
                               BLOCK_SIZE=32)
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    assert torch.equal(ours.to_dense(), theirs.to_dense())


def test_attention_choice_uses_flex_only_where_its_kernels_run():
    # every choice x device x head dim against the rule written out: auto takes flex on a GPU with
    # heads >= 16 (the tiny test drafters have 8, and inductor raised on them); flex elsewhere refuses
    for choice in ("auto", "flex", "sdpa"):
        for device in ("cpu", "cuda"):
            for head_dim in (8, 15, 16, 64, 128):
                if choice == "flex" and (device == "cpu" or head_dim < 16):
                    with pytest.raises(ValueError, match="--attention flex needs"):
                        use_flex_attention(choice, device, head_dim)
                    continue
                want = choice == "flex" or (choice == "auto" and device == "cuda" and head_dim >= 16)
                assert use_flex_attention(choice, device, head_dim) is want, (choice, device, head_dim)
    with pytest.raises(ValueError, match="choose auto, flex or sdpa"):
        use_flex_attention("xformers", "cuda", 64)


def test_anchor_sampler_properties():
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 0, 1, 1, 1, 1, 0])
    valid = {p for p in range(len(mask) - 1) if mask[p] and mask[p + 1]}
    for n in (1, 3, 100):
        a = sample_anchors(mask, n, g)
        assert len(a) == min(n, len(valid)) and set(a.tolist()) <= valid
        assert a.tolist() == sorted(set(a.tolist()))  # distinct, sorted
    # uniform: every valid anchor is drawn about equally often
    counts = torch.zeros(len(mask))
    for _ in range(3000):
        counts[sample_anchors(mask, 2, g)] += 1
    sel = counts[sorted(valid)]
    assert sel.min() > 0.8 * sel.mean() and counts.sum() == 6000
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(sample_anchors(mask, 3, g1), sample_anchors(mask, 3, g2))


def test_build_blocks_labels_same_position():
    ids = torch.arange(100, 112)
    lm = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1])
    bi, bp, bl = build_blocks(ids, lm, torch.tensor([2, 9]), 4, mask_token_id=7)
    assert bi.tolist() == [102, 7, 7, 7, 109, 7, 7, 7]
    assert bp.tolist() == [2, 3, 4, 5, 9, 10, 11, 12]
    # slot 0 never supervised; p+k past the end or unsupervised -> IGNORE
    assert bl.tolist() == [IGNORE, 103, 104, 105, IGNORE, 110, 111, IGNORE]


def naive_loss(hidden, labels, lm_head, bs, gamma, teacher=None, klw=0.0, divergence="kl", penalty=0.0):
    num = den = 0.0
    for b in range(hidden.shape[0]):
        for q in range(hidden.shape[1]):
            if labels[b, q] == IGNORE:
                continue
            k = q % bs
            w = math.exp(-(k - 1) / gamma)
            logits = hidden[b, q] @ lm_head.T
            term = (1 - klw) * F.cross_entropy(logits[None], labels[b, q][None])
            if klw:
                p = F.softmax(teacher[b, q] @ lm_head.T, -1)
                if divergence == "tv":  # total variation, summed over the vocabulary by a loop
                    q_ = F.softmax(logits, -1)
                    term = term + klw * 0.5 * sum((q_[j] - p[j]).abs() for j in range(len(p)))
                else:
                    term = term + klw * (p * (p.log() - F.log_softmax(logits, -1))).sum()
            if penalty:  # minus the drafter's entropy, summed by a loop
                q_ = F.softmax(logits, -1)
                term = term + penalty * sum(q_[j] * q_[j].log() for j in range(len(q_)))
            num += w * term
            den += w
    return num / den


@pytest.mark.parametrize("klw,divergence,penalty", [(0.0, "kl", 0.0), (0.5, "kl", 0.0), (1.0, "kl", 0.0),
                                                   (0.5, "tv", 0.0), (1.0, "tv", 0.0), (0.0, "kl", 0.3),
                                                   (0.5, "kl", 0.2), (0.5, "tv", 0.2)])
@pytest.mark.parametrize("backward", ["fused", "recompute", "keep"])
def test_loss_matches_naive(klw, divergence, penalty, backward):
    g = torch.Generator().manual_seed(1)
    bs, v, h = 4, 50, 8
    hidden = torch.randn(2, 12, h, generator=g, requires_grad=True)
    lm_head = torch.randn(v, h, generator=g)
    labels = torch.randint(0, v, (2, 12), generator=g)
    labels[:, ::bs] = IGNORE
    labels[1, 5] = IGNORE
    teacher = torch.randn(2, 12, h, generator=g)
    out = draft_loss(hidden, labels, lm_head, block_size=bs, gamma=7.0, teacher=teacher, kl_weight=klw, chunk=5,
                      backward=backward, divergence=divergence, confidence_penalty=penalty)
    ref = naive_loss(hidden, labels, lm_head, bs, 7.0, teacher, klw, divergence, penalty)
    torch.testing.assert_close(out["loss"], ref.float(), rtol=1e-5, atol=1e-5)
    g1 = torch.autograd.grad(out["loss"], hidden)[0]
    g2 = torch.autograd.grad(naive_loss(hidden, labels, lm_head, bs, 7.0, teacher, klw, divergence, penalty), hidden)[0]
    torch.testing.assert_close(g1, g2, rtol=1e-4, atol=1e-6)
    assert out["count"][0] == 0 and out["count"].sum() == (labels != IGNORE).sum()


def _saved_bytes(backward: str, n: int = 64, v: int = 4000, h: int = 16) -> int:
    """Bytes autograd keeps between forward and backward of draft_loss (what a chunk leaves alive)."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(1, n, h, generator=g, requires_grad=True)
    labels = torch.randint(0, v, (1, n), generator=g)
    kept = []

    def pack(t):
        kept.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = draft_loss(hidden, labels, torch.randn(v, h, generator=g), block_size=4, gamma=7.0, chunk=16,
                         backward=backward)
    out["loss"].backward()
    return sum(kept)


def test_fused_loss_keeps_no_logits():
    """keep holds every chunk's [c, V] logits for backward; fused holds one [n, H] gradient."""
    n, v, h = 64, 4000, 16
    assert _saved_bytes("keep") >= n * v * 4
    assert _saved_bytes("fused") <= 4 * n * h * 4


def test_fused_loss_bf16_matches_keep():
    """bf16 rows (as under autocast): the fused gradient equals autograd's through the kept logits."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 16, 32, generator=g).bfloat16().requires_grad_()
    lm_head = (torch.randn(300, 32, generator=g) * 0.3).bfloat16()
    labels = torch.randint(0, 300, (2, 16), generator=g)
    teacher = torch.randn(2, 16, 32, generator=g).bfloat16()
    grads = []
    for backward in ("fused", "keep"):
        out = draft_loss(hidden, labels, lm_head, block_size=4, gamma=7.0, teacher=teacher, kl_weight=0.3, chunk=7,
                         backward=backward)
        grads.append(torch.autograd.grad(out["loss"], hidden)[0].float())
    torch.testing.assert_close(grads[0], grads[1], rtol=2e-2, atol=2e-3)


def test_autocast_loss_casts_the_head_once_as_each_chunk_would_and_keeps_w2s_gradient_in_float32():
    """Under autocast the frozen lm_head is cast once, to autocast's dtype: the loss equals the one over
    bf16 rows and a bf16 head; a Markov head's W2 keeps its float32 gradient (not rounded to bf16)."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 16, 32, generator=g, requires_grad=True)
    lm_head = torch.randn(300, 32, generator=g) * 0.3
    labels = torch.randint(0, 300, (2, 16), generator=g)
    labels[:, ::4] = IGNORE
    kw = {"block_size": 4, "gamma": 7.0, "chunk": 7, "backward": "fused"}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = draft_loss(hidden, labels, lm_head, **kw)
    ref = draft_loss(hidden.detach().bfloat16(), labels, lm_head.bfloat16(), **kw)
    torch.testing.assert_close(out["loss"], ref["loss"], rtol=1e-6, atol=1e-6)
    assert torch.equal(out["correct"], ref["correct"])
    w2s = []
    for autocast in (True, False):
        w2 = torch.nn.Parameter(torch.randn(300, 8, generator=torch.Generator().manual_seed(6)) * 0.1)
        rows = torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(7))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = draft_loss(hidden, labels, lm_head, bias_rows=rows, bias_head=w2, **kw)
        out["loss"].backward()
        # float32 and not a bf16-rounded value in float32 clothing
        assert w2.grad.dtype == torch.float32 and not torch.equal(w2.grad, w2.grad.bfloat16().float())
        w2s.append(w2.grad)
    torch.testing.assert_close(w2s[0], w2s[1], rtol=3e-2, atol=3e-3)


def test_decay_and_acceptance():
    w = decay_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1 and math.isclose(float(w[8]), math.exp(-1), rel_tol=1e-6)
    assert acceptance_from_acc([1.0] * 15) == 16.0
    assert acceptance_from_acc([0.0] * 15) == 1.0
    assert math.isclose(acceptance_from_acc([0.5, 0.5]), 1 + 0.5 + 0.25)


@pytest.mark.slow
def test_compiled_fused_loss_matches_eager():
    """--compile runs the fused loss's per-chunk softmax and gradient through torch.compile: same
    loss, gradient and hits as eager (ragged last chunk included)."""
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 24, 16, generator=g, requires_grad=True)
    lm_head = torch.randn(200, 16, generator=g)
    labels = torch.randint(0, 200, (2, 24), generator=g)
    labels[:, ::4] = IGNORE
    teacher = torch.randn(2, 24, 16, generator=g)
    for divergence, penalty in (("kl", 0.0), ("tv", 0.0), ("kl", 0.2)):
        outs = [draft_loss(hidden, labels, lm_head, block_size=4, gamma=7.0, teacher=teacher, kl_weight=0.4, chunk=10,
                           compiled=c, divergence=divergence, confidence_penalty=penalty) for c in (False, True)]
        torch.testing.assert_close(outs[1]["loss"], outs[0]["loss"], rtol=1e-5, atol=1e-6)
        assert torch.equal(outs[1]["correct"], outs[0]["correct"])
        g0, g1 = (torch.autograd.grad(o["loss"], hidden)[0] for o in outs)
        torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-6)
