"""Decoding replayed from one batched forward (train.replay), against loops that decode step by step,
and the decode-aware loss weights against a naive loop."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from train.acceptance import decode_chain
from train.anchors import IGNORE
from train.losses import Weighting, decay_weights, draft_loss
from train.replay import anchor_spans, block_accepts, decode_visits, reach_weights, replay_counts


def _loop_visits(anchors: list[int], accepts: list[int], spans: list[int]) -> set[int]:
    """Indices decoding visits: from each span's first anchor, jump to position p + a + 1, or the
    first anchor after it in the same span where that position holds none."""
    seen = set()
    for i, (p, s) in enumerate(zip(anchors, spans)):
        if p < 0 or (i > 0 and spans[i - 1] == s):
            continue
        j = i
        while True:
            seen.add(j)
            want = anchors[j] + accepts[j] + 1
            nxt = [k for k in range(len(anchors)) if anchors[k] >= want and spans[k] == s]
            if not nxt:
                break
            j = nxt[0]
    return seen


def _random_batch(rng: random.Random, b: int, full: bool):
    """Anchors (sorted, -1 padding), spans and accepts of b sequences of 1-3 response spans."""
    rows = []
    for _ in range(b):
        mask = []
        for _ in range(rng.randint(1, 3)):
            mask += [0] * rng.randint(1, 5) + [1] * rng.randint(1, 30)
        mask = torch.tensor(mask)
        valid = [p for p in range(len(mask) - 1) if mask[p] and mask[p + 1]]
        if not full:
            valid = sorted(rng.sample(valid, k=rng.randint(0, len(valid))))
        a = torch.tensor(valid, dtype=torch.long)
        spans = anchor_spans(mask, a) if len(a) else a
        # an acceptance never runs past the span's end (labels stop there)
        span_of = anchor_spans(mask, torch.arange(len(mask))).tolist()
        ends = {}
        for p in range(len(mask)):
            if mask[p]:
                ends[span_of[p]] = p
        acc = [min(rng.randint(0, 7), ends[int(s)] - int(p)) for p, s in zip(a.tolist(), spans.tolist())]
        rows.append((a, spans, torch.tensor(acc, dtype=torch.long), mask))
    n = max(1, max(len(r[0]) for r in rows))
    pad = lambda xs: torch.stack([F.pad(x, (0, n - len(x)), value=-1) for x in xs])  # noqa: E731
    return pad([r[0] for r in rows]), pad([r[1] for r in rows]), pad([r[2] for r in rows]).clamp(min=0), rows


@pytest.mark.parametrize("full", [True, False])
def test_decode_visits_equal_the_loop(full):
    rng = random.Random(0)
    for _ in range(60):
        anchors, spans, accepts, _ = _random_batch(rng, 4, full)
        got = decode_visits(anchors, accepts, spans)
        for r in range(anchors.shape[0]):
            want = _loop_visits(anchors[r].tolist(), accepts[r].tolist(), spans[r].tolist())
            assert set(torch.nonzero(got[r]).flatten().tolist()) == want


def _decoded(rows, window: int = 0) -> tuple[int, int]:
    """The loop oracle: (tokens, forwards) of decode_chain over every span of `rows`, each stopped at
    `window` new tokens (0: at its end); a span of n tokens has n - 1 anchors."""
    tokens = forwards = 0
    for _a, s, acc, _ in rows:
        for span in s.unique().tolist():
            sel = s == span
            new = int(sel.sum()) + 1 if not window else min(int(sel.sum()) + 1, window)
            tokens += new
            forwards += len(decode_chain(acc[sel].tolist() + [0], new))
    return tokens, forwards


def test_replay_counts_equal_decode_chain_span_by_span():
    """With an anchor at every position, tokens / forwards is decoding's τ (train.acceptance.decode_chain)."""
    rng = random.Random(1)
    for _ in range(40):
        anchors, spans, accepts, rows = _random_batch(rng, 3, full=True)
        t, f = replay_counts(anchors, accepts, spans)
        assert (int(t), int(f)) == _decoded(rows)


@torch.inference_mode()
@pytest.mark.parametrize("window", [1, 2, 3, 5, 9])
def test_replay_counts_in_a_window_equal_decoding_that_stops_there(window):
    """window W: each span decoded only until W new tokens, as train.eval --max-new-tokens W decodes."""
    rng = random.Random(window)
    for _ in range(40):
        anchors, spans, accepts, rows = _random_batch(rng, 3, full=True)
        t, f = replay_counts(anchors, accepts, spans, window=window)
        assert (int(t), int(f)) == _decoded(rows, window)
        # the visits walked once and handed in count the same
        visits = decode_visits(anchors, accepts, spans)
        assert replay_counts(anchors, accepts, spans, window=window, visits=visits) == (t, f)


def test_block_accepts_and_spans():
    hit = torch.tensor([[[True, True, True, False, True], [False, False, True, True, True]]])
    assert block_accepts(hit).tolist() == [[2, 0]]  # slot 0 (the anchor) does not count
    mask = torch.tensor([0, 1, 1, 1, 0, 0, 1, 1])
    assert anchor_spans(mask, torch.tensor([1, 2, 6])).tolist() == [0, 0, 1]


def _naive_reach(hit, labelled, floor):
    b, n, bs = hit.shape
    r = []
    for j in range(1, bs):
        num = den = 0
        for x in range(b):
            for y in range(n):
                if labelled[x, y, j]:
                    den += 1
                    num += all(hit[x, y, i] for i in range(1, j + 1))
        r.append(num / max(den, 1))
    w = [sum(r[k:]) for k in range(len(r))]
    return [0.0] + [max(v, floor * max(w[0], 1e-6)) for v in w]


def test_reach_weights_equal_the_loop():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        hit = torch.rand(3, 5, 6, generator=g) < 0.7
        labelled = torch.rand(3, 5, 6, generator=g) < 0.9
        got = reach_weights(hit, labelled, floor=0.05)
        assert got.tolist() == pytest.approx(_naive_reach(hit, labelled, 0.05), rel=1e-6, abs=1e-7)


def _leading(hits: list[bool]) -> int:
    n = 0
    while n < len(hits) and hits[n]:
        n += 1
    return n


def _naive_weighted_loss(hidden, labels, lm_head, bs, anchors, spans, weighting):
    """The loss with weights from a loop: hits by argmax, then each row's weight, then the mean."""
    b, q, _ = hidden.shape
    logits = hidden @ lm_head.T
    hit = torch.zeros(b, q // bs, bs, dtype=torch.bool)
    lab = torch.zeros(b, q // bs, bs, dtype=torch.bool)
    for x in range(b):
        for y in range(q):
            if labels[x, y] != IGNORE:
                hit[x, y // bs, y % bs] = bool(logits[x, y].argmax() == labels[x, y])
                lab[x, y // bs, y % bs] = True
    if weighting.position == "reach":
        per_slot = _naive_reach(hit, lab, 0.01)
    else:
        per_slot = decay_weights(bs, 7.0).tolist()
    visits = set()
    for x in range(b):
        acc = [_leading(hit[x, y, 1:].tolist()) for y in range(q // bs)]
        visits |= {(x, j) for j in _loop_visits(anchors[x].tolist(), acc, spans[x].tolist())}
    num = den = 0.0
    for x in range(b):
        for y in range(q):
            if labels[x, y] == IGNORE:
                continue
            w = per_slot[y % bs] * (1 + weighting.visit_weight * ((x, y // bs) in visits))
            num = num + w * F.cross_entropy(logits[x, y][None], labels[x, y][None])
            den += w
    return num / den


@pytest.mark.parametrize("weighting", [Weighting(position="reach"), Weighting(visit_weight=2.0),
                                       Weighting(position="reach", visit_weight=0.5)])
@pytest.mark.parametrize("backward", ["fused", "keep"])
def test_decode_aware_loss_matches_the_loop(weighting, backward):
    g = torch.Generator().manual_seed(2)
    bs, v, h, n = 4, 12, 8, 5
    lm_head = torch.randn(v, h, generator=g)
    labels = torch.randint(0, v, (2, n * bs), generator=g)
    hidden = (lm_head[labels] * 2 + 0.8 * torch.randn(2, n * bs, h, generator=g)).requires_grad_()  # many hits
    labels[:, ::bs] = IGNORE
    labels[1, -3:] = IGNORE  # a block cut by the response's end
    anchors = torch.tensor([[0, 1, 2, 3, 6], [2, 3, 4, 8, -1]])
    spans = torch.tensor([[0, 0, 0, 0, 1], [0, 0, 0, 1, -1]])
    out = draft_loss(hidden, labels, lm_head, block_size=bs, gamma=7.0, chunk=7, backward=backward,
                     weighting=weighting, anchors=anchors, spans=spans, replay=True)
    ref = _naive_weighted_loss(hidden, labels, lm_head, bs, anchors, spans, weighting)
    torch.testing.assert_close(out["loss"], ref.float(), rtol=1e-5, atol=1e-6)
    g1 = torch.autograd.grad(out["loss"], hidden)[0]
    g2 = torch.autograd.grad(_naive_weighted_loss(hidden, labels, lm_head, bs, anchors, spans, weighting), hidden)[0]
    torch.testing.assert_close(g1, g2, rtol=1e-4, atol=1e-6)
    assert 0 < out["accepts"].float().mean() < bs - 1  # the test exercises partial blocks


def test_weighting_refuses_bad_values():
    with pytest.raises(ValueError, match="position weights"):
        Weighting(position="uniform")
    with pytest.raises(ValueError, match="visit_weight"):
        Weighting(visit_weight=-1.0)
    with pytest.raises(ValueError, match="visit_weight"):
        Weighting(visit_weight=math.nan)


def _brute_tree_accepts(logp: torch.Tensor, truth: list[int], budget: int) -> int:
    """One block: enumerate every prefix of the D slots, keep the `budget` best by summed
    log-probability (ties to the shallower), and return the longest prefix of `truth` among them."""
    import itertools

    d_slots, v = logp.shape
    prefixes = [(sum(float(logp[k, t]) for k, t in enumerate(p)), len(p), p)
                for d in range(1, d_slots + 1) for p in itertools.product(range(v), repeat=d)]
    kept = {p for _, _, p in sorted(prefixes, key=lambda x: (-x[0], x[1]))[:budget]}
    best = 0
    for d in range(1, d_slots + 1):
        if all(t >= 0 for t in truth[:d]) and tuple(truth[:d]) in kept:
            best = d
    return best


@pytest.mark.parametrize("budget", [1, 3, 8, 200])
def test_tree_accepts_equal_a_brute_force_enumeration_of_each_blocks_best_prefixes(budget):
    from train.replay import tree_accepts

    torch.manual_seed(budget)
    b, n, bs, h, v = 2, 3, 4, 6, 5
    hidden, lm_head = torch.randn(b, n * bs, h) * 2, torch.randn(v, h)
    logp = torch.log_softmax(hidden.view(b, n, bs, h)[:, :, 1:] @ lm_head.T, -1)  # [b, n, D, V]
    # truths that follow the drafter's favourites often (else every tree misses), some unlabelled slots
    labels = torch.where(torch.rand(b, n * bs) < 0.6, (hidden @ lm_head.T).argmax(-1), torch.randint(0, v, (b, n * bs)))
    labels[0, 5], labels[1, 2], labels[1, 9] = IGNORE, -1, -1
    got = tree_accepts(hidden, labels, lm_head, block_size=bs, budget=budget, chunk=4)
    want = [[_brute_tree_accepts(logp[i, j], labels[i].view(n, bs)[j, 1:].tolist(), budget) for j in range(n)]
            for i in range(b)]
    assert got.tolist() == want
    assert budget < 8 or got.sum() > 0  # the oracle is not all zeros


def test_a_one_wide_tree_of_one_node_a_slot_accepts_what_the_chain_accepts():
    from train.replay import tree_accepts

    torch.manual_seed(0)
    b, n, bs, h, v = 3, 5, 6, 8, 7
    hidden, lm_head = torch.randn(b, n * bs, h), torch.randn(v, h)
    greedy = (hidden @ lm_head.T).argmax(-1)  # [b, Q]
    labels = torch.where(torch.rand(b, n * bs) < 0.8, greedy, (greedy + 1) % v)
    hit = (greedy == labels).view(b, n, bs)
    chain = block_accepts(hit)
    assert tree_accepts(hidden, labels, lm_head, block_size=bs, budget=bs - 1, width=1).tolist() == chain.tolist()
    assert chain.sum() > 0 and (tree_accepts(hidden, labels, lm_head, block_size=bs, budget=64) >= chain).all()


@pytest.mark.parametrize("with_head", [False, True])
def test_trees_at_the_visited_blocks_alone_replay_as_trees_at_every_block(with_head):
    # the oracle: tree_accepts at every block, walked by decode_visits and counted by replay_counts
    from train.markov_head import MarkovHead
    from train.replay import tree_accepts, visited_tree_accepts

    rng, g = random.Random(3), torch.Generator().manual_seed(3)
    bs, h, v = 4, 6, 5
    anchors, spans, _, _ = _random_batch(rng, 5, full=True)
    b, n = anchors.shape
    hidden, lm_head = torch.randn(b, n * bs, h, generator=g), torch.randn(v, h, generator=g)
    labels = torch.randint(0, v, (b, n * bs), generator=g)
    labels.view(b, n, bs)[..., 0] = IGNORE
    head, roots = None, None
    if with_head:
        head, roots = MarkovHead(v, v, 3), torch.randint(0, v, (b, n * bs), generator=g)
        with torch.no_grad():
            for p in head.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
    kw = {"block_size": bs, "budget": 6, "head": head, "roots": roots}
    every = tree_accepts(hidden, labels, lm_head, **kw)
    visited = visited_tree_accepts(hidden, labels, lm_head, anchors, spans, **kw)
    walk = decode_visits(anchors, every, spans)
    assert torch.equal(decode_visits(anchors, visited, spans), walk)
    assert torch.equal(visited[walk], every[walk]) and (visited[~walk] == 0).all()
    for window in (0, 7):
        assert replay_counts(anchors, visited, spans, window) == replay_counts(anchors, every, spans, window)
    assert every[walk].sum() > 0 and walk.sum() < (anchors >= 0).sum()  # accepted drafts; fewer trees
