"""train.draft_tree against brute force: every prefix enumerated, ranked by the documented order."""

from __future__ import annotations

import itertools

import pytest
import torch

from train.draft_tree import _best, _ranked, ancestor_mask, build_tree, walk_tree


def _oracle(logp: torch.Tensor, budget: int, width: int = 0) -> list[tuple[tuple[int, ...], float]]:
    """logp [D, V] -> the chosen prefixes (token tuples) with their scores, in rank order, by
    enumerating every prefix of every depth."""
    d_slots, v = logp.shape
    rank = [sorted(range(v), key=lambda t, d=d: (-float(logp[d, t]), t)) for d in range(d_slots)]
    levels: list[list[tuple[tuple[int, ...], float]]] = []
    prev = [((), 0.0)]
    for d in range(d_slots):
        cand = []
        for pi, (pre, s) in enumerate(prev):
            for ri, t in enumerate(rank[d]):
                sc = s + float(logp[d, t])
                if sc > float("-inf"):
                    cand.append((-sc, pi, ri, pre + (t,), sc))
        cand.sort(key=lambda c: c[:3])
        prev = [(c[3], c[4]) for c in cand]
        levels.append(prev[:width] if width else prev)
    flat = [(-sc, d, i, pre, sc) for d, lev in enumerate(levels) for i, (pre, sc) in enumerate(lev)]
    flat.sort(key=lambda c: c[:3])
    return [(c[3], c[4]) for c in flat[:budget]]


def _prefixes(tree, b: int | None = None) -> list[tuple[tuple[int, ...], float]]:
    """The tree's valid nodes as token tuples (root excluded) with their scores, in node order."""
    pick = (lambda x: x[b]) if b is not None else (lambda x: x)
    tok, par, val, sc = (pick(x).tolist() for x in (tree.tokens, tree.parents, tree.valid, tree.scores))
    out = []
    for i in range(1, len(tok)):
        if not val[i]:
            continue
        seq, j = [], i
        while j != 0:
            seq.append(tok[j])
            j = par[j]
        out.append((tuple(reversed(seq)), sc[i]))
    return out


def _same(got, want) -> None:
    assert [p for p, _ in got] == [p for p, _ in want]
    assert [s for _, s in got] == pytest.approx([s for _, s in want])


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("budget,width", [(1, 0), (5, 0), (16, 0), (16, 3), (40, 0), (200, 0)])
def test_the_tree_is_the_budgets_best_prefixes_with_ties_and_impossible_tokens(seed, budget, width):
    g = torch.Generator().manual_seed(seed)
    d_slots, v = 1 + seed % 4, 2 + seed % 4
    if seed % 3 == 0:  # continuous scores
        logp = torch.log_softmax(torch.randn(d_slots, v, generator=g), -1)
    else:  # many ties, and tokens the drafter gives no probability
        logp = -torch.randint(0, 3, (d_slots, v), generator=g).float()
        logp[torch.rand(d_slots, v, generator=g) < 0.15] = float("-inf")
    tree = build_tree(logp, budget, root=7, width=width)
    want = _oracle(logp, budget, width)
    _same(_prefixes(tree), want)
    assert tree.tokens.shape == (budget + 1,) and int(tree.tokens[0]) == 7
    assert int(tree.valid.sum()) == len(want) + 1  # N larger than the tree can hold: the rest invalid
    assert all(int(tree.parents[i]) < i for i in range(1, budget + 1) if tree.valid[i])  # parents first
    assert tree.depths.tolist()[1:len(want) + 1] == [len(p) for p, _ in want]


@pytest.mark.parametrize("seed", range(4))
def test_a_top_k_by_rank_keys_is_the_whole_sorts_first_k(seed):
    # ties (a few distinct values), -0.0 beside +0.0, -inf: the k best in the sort's order, ties by index
    g = torch.Generator().manual_seed(seed)
    x = -torch.randint(0, 4, (3, 5, 300), generator=g).float() / 2
    x[torch.rand(x.shape, generator=g) < 0.3] = float("-inf")
    x[torch.rand(x.shape, generator=g) < 0.1] = 0.0  # +0.0 among the -0.0 of -randint
    x[..., 7] = torch.randn(3, 5, generator=g) - 3
    for k in (1, 17, 128, 299):
        v, i = _best(x, k)
        sv, si = _ranked(x)
        assert torch.equal(i, si[..., :k]) and torch.equal(v, sv[..., :k])


@pytest.mark.parametrize("seed", range(6))
def test_larger_trees_over_a_wider_vocabulary_are_the_best_prefixes(seed):
    # the depth's candidates cut to the pairs that can rank (train.draft_tree._pair_ranks), on trees
    # large against a vocabulary of 12 (the test above holds 5 tokens at most), with ties
    g = torch.Generator().manual_seed(seed)
    logp = -torch.randint(0, 4, (3, 12), generator=g).float() if seed % 2 else \
        torch.log_softmax(torch.randn(3, 12, generator=g), -1)
    for budget, width in ((30, 0), (64, 0), (100, 9)):
        _same(_prefixes(build_tree(logp, budget, width=width)), _oracle(logp, budget, width))


def test_a_batch_of_blocks_builds_each_blocks_own_tree():
    g = torch.Generator().manual_seed(3)
    logp = torch.log_softmax(torch.randn(2, 3, 3, 5, generator=g), -1)  # [2, 3, D=3, V=5]
    roots = torch.arange(6).view(2, 3)
    tree = build_tree(logp, 9, root=roots, width=4)
    for i, j in itertools.product(range(2), range(3)):
        one = build_tree(logp[i, j], 9, root=int(roots[i, j]), width=4)
        for a, b in zip(tree, one):
            assert torch.equal(a[i, j], b)


def test_the_ancestor_mask_is_each_nodes_path_to_the_root():
    g = torch.Generator().manual_seed(1)
    tree = build_tree(torch.log_softmax(torch.randn(4, 6, generator=g), -1), 20)
    anc = ancestor_mask(tree.parents, 4)
    par = tree.parents.tolist()
    for i in range(21):
        path, j = {i}, i
        while j != 0:
            j = par[j]
            path.add(j)
        assert set(torch.nonzero(anc[i]).flatten().tolist()) == path


def _walk_oracle(tree, want: list[int]) -> tuple[int, list[int]]:
    tok, par, val = tree.tokens.tolist(), tree.parents.tolist(), tree.valid.tolist()
    cur, path = 0, []
    while True:
        kids = [j for j in range(1, len(tok)) if val[j] and par[j] == cur and tok[j] == want[cur]]
        if not kids:
            return len(path), path
        cur = kids[0]
        path.append(cur)


@pytest.mark.parametrize("seed", range(20))
def test_the_walk_follows_the_asked_tokens_as_far_as_the_tree_holds_them(seed):
    g = torch.Generator().manual_seed(seed)
    d_slots, v = 4, 3
    tree = build_tree(torch.log_softmax(torch.randn(d_slots, v, generator=g) * 2, -1), 12)
    want = torch.randint(0, v, (13,), generator=g)
    accepted, path, last = walk_tree(tree, want, d_slots)
    n, wpath = _walk_oracle(tree, want.tolist())
    assert int(accepted) == n and path.tolist()[:n] == wpath and all(x == 0 for x in path.tolist()[n:])
    assert int(last) == (wpath[-1] if wpath else 0)


def test_a_width_one_tree_of_depth_many_nodes_is_the_chain():
    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(7, 50, generator=g), -1)
    tree = build_tree(logp, 7, width=1)
    assert tree.tokens[1:].tolist() == logp.argmax(-1).tolist() and tree.parents.tolist() == [0, *range(7)]


def test_a_budget_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        build_tree(torch.zeros(2, 3), 0)


def _oracle_markov(base: torch.Tensor, trans: torch.Tensor, root: int, budget: int,
                   width: int = 0) -> list[tuple[tuple[int, ...], float]]:
    """base [D, V] logits, trans [V, V] the logit bias of the token after each token -> the chosen prefixes,
    every prefix enumerated: slot d's log-probs after token t are log_softmax(base[d] + trans[t])."""
    d_slots, v = base.shape
    levels, prev = [], [((), 0.0, root)]
    for d in range(d_slots):
        cand = []
        for pi, (pre, s, last) in enumerate(prev):
            lp = torch.log_softmax(base[d] + trans[last], -1)
            for ri, t in enumerate(sorted(range(v), key=lambda t, lp=lp: (-float(lp[t]), t))):
                if float(lp[t]) > float("-inf"):
                    cand.append((-(s + float(lp[t])), pi, ri, pre + (t,), s + float(lp[t]), t))
        cand.sort(key=lambda c: c[:3])
        prev = [(c[3], c[4], c[5]) for c in cand]
        prev = prev[:width] if width else prev
        levels.append(prev)
    flat = [(-sc, d, i, pre, sc) for d, lev in enumerate(levels) for i, (pre, sc, _) in enumerate(lev)]
    flat.sort(key=lambda c: c[:3])
    return [(c[3], c[4]) for c in flat[:budget]]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("budget,width", [(1, 0), (6, 0), (20, 0), (20, 4), (300, 0)])
def test_with_a_dependence_head_each_child_is_scored_after_its_parents_token(seed, budget, width):
    g = torch.Generator().manual_seed(seed)
    d_slots, v, root = 1 + seed % 4, 3 + seed % 5, 1
    base, trans = torch.randn(d_slots, v, generator=g), 2 * torch.randn(v, v, generator=g)
    trans[:, 0] = float("-inf")  # a token no parent may be followed by
    logp = torch.log_softmax(base, -1)
    first = torch.log_softmax(logp[:1] + trans[root], -1)  # slot 1 after the root: the caller's part
    tree = build_tree(torch.cat([first, logp[1:]]), budget, root=root, width=width, bias=lambda t: trans[t])
    want = _oracle_markov(base, trans, root, budget, width)
    _same(_prefixes(tree), want)
    assert int(tree.valid.sum()) == len(want) + 1
    # a head that adds nothing builds the tree of the marginals
    flat = build_tree(logp, budget, root=root, width=width, bias=lambda t: torch.zeros(*t.shape, v))
    _same(_prefixes(flat), _oracle(logp, budget, width))


def test_a_child_cap_keeps_each_parents_best_children_only():
    g = torch.Generator().manual_seed(3)
    d_slots, v = 4, 9
    base, trans = torch.randn(d_slots, v, generator=g), torch.randn(v, v, generator=g)
    logp = torch.log_softmax(base, -1)
    first = torch.log_softmax(logp[:1] + trans[0], -1)
    lp = torch.cat([first, logp[1:]])
    exact = _prefixes(build_tree(lp, 30, bias=lambda t: trans[t]))
    capped = _prefixes(build_tree(lp, 30, bias=lambda t: trans[t], child_cap=2))
    per_parent: dict[tuple[int, ...], int] = {}
    for pre, _ in capped:
        if len(pre) > 1:
            per_parent[pre[:-1]] = per_parent.get(pre[:-1], 0) + 1
    assert max(per_parent.values()) <= 2 and len(capped) == 30  # depth 1 (the root's) is not capped
    def true_score(pre: tuple[int, ...]) -> float:  # the prefix's summed conditional log-probabilities
        s, last = 0.0, 0
        for d, tok in enumerate(pre):
            s, last = s + float(torch.log_softmax(base[d] + trans[last], -1)[tok]), tok
        return s
    assert all(s == pytest.approx(true_score(pre), abs=1e-5) for pre, s in capped)
    # an uncapped parent count is reached: the cap changes the tree
    assert {p for p, _ in capped} != {p for p, _ in exact}
    assert _prefixes(build_tree(lp, 30, bias=lambda t: trans[t], child_cap=30)) == exact


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("head", [False, True])
def test_a_smaller_budgets_tree_is_the_first_nodes_of_a_larger_ones(seed, head):
    """Trees are nested: the N-node tree is the first N nodes of the M-node tree (M > N), so at every
    step a larger budget holds every path a smaller one holds and accepts at least as many tokens.
    What a per-step budget choice could save is then only the larger tree's own cost (docs/BENCHMARKS.md)."""
    g = torch.Generator().manual_seed(seed)
    d_slots, v = 2 + seed % 3, 3 + seed % 4
    if seed % 2:  # ties
        logp = -torch.randint(0, 3, (d_slots, v), generator=g).float()
    else:
        logp = torch.log_softmax(torch.randn(d_slots, v, generator=g), -1)
    trans = torch.randn(v, v, generator=g)
    bias = (lambda t: trans[t]) if head else None
    trees = {n: _prefixes(build_tree(logp, n, root=1, bias=bias)) for n in (1, 3, 8, 30, 200)}
    for n, small in trees.items():
        for m, large in trees.items():
            if m > n:
                _same(small, large[:len(small)])
                assert len(small) == min(n, len(large))
