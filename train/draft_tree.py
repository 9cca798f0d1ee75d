"""Draft trees: the best prefixes of one drafted block, and the walk that verifies them.

Shipped beside modeling_dflash.py in every export (torch only), so a served drafter builds the
same trees as training and evaluation measure.

A DFlash drafter gives, in one forward, a distribution for each of the block's D = block_size - 1
drafted slots. A chain keeps each slot's argmax. A tree keeps the N prefixes (c1, ..., cd), d <= D,
with the highest score log p1(c1) + ... + log pd(cd) (DDTree, Ringel & Romano, arXiv 2604.12989):
the target verifies them all in one forward with an ancestor-only mask, and its own greedy token is
walked down the tree. Every extension lowers the score (log-probabilities are <= 0), so the N best
prefixes hold their ancestors: the set is a tree.

The order is total, so trees are reproducible and testable. Within a depth, prefixes rank by score,
ties by their parent's rank, then by the token's rank in its slot (log-probability, then id). Across
depths, by score, ties to the shallower, then by rank within the depth. A parent then always ranks
before its children. `build_tree` finds the N best without enumerating: depth d's N best extend
depth d-1's N best by each slot's N best tokens (a prefix outranked by N others at its depth has N
outranking extensions too). Of those N x N candidates only the ~N ln N that N others cannot outrank
are sorted (_pair_ranks), and each slot's N best tokens come from a top-k, not a sort of the
vocabulary: fixed shapes and no host sync (a CUDA graph can hold it).

With a dependence head (a Markov head: `bias`), slot d+1's distribution depends on the token
drafted at slot d: a prefix's children are scored by log_softmax(logp[d+1] + bias(its last token)).
The same search stays exact (a node's score still bounds its descendants'), with each kept parent's
own N best children in place of one shared list; `child_cap` K < N keeps each parent's K best only
(fewer candidates, an approximation where some parent would have more than K children in the tree).

Nodes come in rank order after the root (index 0, the block's first token, already verified):
parents precede children. Shapes: `...` any batch dims, D drafted slots, V vocabulary, N budget.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

__all__ = ["DraftTree", "ancestor_mask", "build_tree", "walk_tree"]


class DraftTree(NamedTuple):
    """N + 1 nodes, the root first, then the drafted prefixes in rank order."""

    # [..., N+1] long: each node's last token (vocabulary index); the root's is `root`
    tokens: torch.Tensor
    parents: torch.Tensor  # [..., N+1] long: the parent's node index (the root is its own)
    depths: torch.Tensor  # [..., N+1] long: 0 for the root, d for a prefix of d drafted tokens
    valid: torch.Tensor  # [..., N+1] bool: False where fewer than N prefixes exist (or have p > 0)
    # [..., N+1] float: summed log-probabilities (0 at the root, -inf where invalid)
    scores: torch.Tensor


def _ranked(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., M] -> (values, indices) sorted descending, ties kept in index order."""
    return torch.sort(x, dim=-1, descending=True, stable=True)


def _rank_keys(x: torch.Tensor) -> torch.Tensor:
    """x [..., V] float (no NaN) -> int64 keys [..., V], all distinct, whose descending order is
    _ranked's: the value's float32 bits made order-keeping in the high half, the index reversed in
    the low half (ties to the lower index). A top-k of them is a sort's first k without the whole
    sort of V; `+ 0.0` makes -0.0 the +0.0 it equals."""
    bits = (x.float() + 0.0).view(torch.int32).long()
    # a negative float's magnitude bits count the wrong way: flipped, the order is the values'
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    n = x.shape[-1]
    return key * 2 ** 32 + (n - 1 - torch.arange(n, device=x.device))


def _pair_ranks(f: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The (parent rank, token rank) pairs (i, j) of an F x F grid with (i + 1)(j + 1) <= F, in
    row-major order, [M] each (M ~ F ln F): where parents and tokens both come best first, any other
    pair is outranked by the (i + 1)(j + 1) > F pairs above and left of it (no lower score, no later
    in index order), so the F best of the grid are among these. One sort of the grid's indices, the
    pairs first: fixed shapes, no host sync."""
    grid = torch.arange(f * f, device=device)  # [F*F] row-major
    m = sum(f // (i + 1) for i in range(f))
    pair = (grid // f + 1) * (grid % f + 1) <= f  # [F*F]
    keep = torch.sort(torch.where(pair, grid, grid + f * f)).values[:m]  # [M]
    return keep // f, keep % f


def _pad(x: torch.Tensor, size: int, value: float) -> torch.Tensor:
    """x [..., M] -> [..., max(M, size)], padded with `value`."""
    if x.shape[-1] >= size:
        return x
    return torch.cat([x, x.new_full((*x.shape[:-1], size - x.shape[-1]), value)], dim=-1)


def _best(x: torch.Tensor, k: int, exact: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., V] -> the k best (values, indices) [..., k] in rank order (padded with -inf / 0 where
    V < k), ties in index order; `exact` False: a top-k instead of a whole sort, which may pick
    other tokens among ties at the k-th value (the dependence head's [F, V] rows, where a sort is
    costly)."""
    if k >= x.shape[-1]:
        v, i = _ranked(x)
        return _pad(v, k, float("-inf"))[..., :k], _pad(i, k, 0)[..., :k].long()
    if exact:
        i = torch.topk(_rank_keys(x), k, dim=-1).indices  # [..., k] in rank order
        return x.gather(-1, i), i
    v, i = torch.topk(x, k, dim=-1)
    # index order first, so the stable sort by value keeps ties by index
    i, o = torch.sort(i, dim=-1)
    v, o2 = _ranked(v.gather(-1, o))
    return v, i.gather(-1, o2)


def build_tree(logp: torch.Tensor, budget: int, root: torch.Tensor | int = 0, width: int = 0,
               bias: Callable[[torch.Tensor], torch.Tensor] | None = None,
               child_cap: int = 0) -> DraftTree:
    """logp [..., D, V] (each drafted slot's log-probabilities), budget N >= 1 -> the DraftTree of
    the N best prefixes (module docstring). width > 0: at most `width` nodes at each depth (the N
    best among each depth's `width` best). root: the root's token, a tensor [...] or an int.
    bias: a dependence head, token indices [..., P] -> logits [..., P, V] added to the next slot's
    (slot 1's log-probabilities must already hold the root's); child_cap > 0: each parent's best
    children kept (with bias; 0: as many as the depth keeps)."""
    if budget < 1:
        raise ValueError(f"tree budget {budget}: must be at least 1")
    *batch, d_slots, _ = logp.shape
    f = min(budget, width) if width > 0 else budget  # prefixes kept per depth
    k = min(child_cap, f) if child_cap > 0 and bias is not None else f  # children per parent
    logp = logp.float()
    # [..., D or 1, F]: each slot's tokens, best first; with a head only slot 1's list is shared by
    # all
    tv, ti = _best(logp if bias is None else logp[..., :1, :], f)
    scores, tokens = [tv[..., 0, :]], [ti[..., 0, :]]
    parent_slot = [torch.zeros_like(ti[..., 0, :])]
    pi, pj = _pair_ranks(f, logp.device) if bias is None else (None, None)  # [M]
    # depth d+1: the F best of F parents x K tokens, parents' order first
    for d in range(1, d_slots):
        if bias is None:  # one shared token list: only the pairs that can rank in the F best
            s, pos = _ranked(scores[-1][..., pi] + tv[..., d, pj])  # [..., M]
            scores.append(s[..., :f])
            parent_slot.append(pi[pos[..., :f]])
            tokens.append(ti[..., d, :].gather(-1, pj[pos[..., :f]]))
            continue
        # [..., F, V]
        cond = torch.log_softmax(logp[..., d, None, :] + bias(tokens[-1]).float(), -1)
        cv, ci = _best(cond, k, exact=False)  # [..., F, K]
        cand = (scores[-1][..., :, None] + cv).flatten(-2)  # [..., F*K]
        s, idx = _ranked(cand)
        s, idx = _pad(s, f, float("-inf"))[..., :f], _pad(idx, f, 0)[..., :f]  # [..., F]
        scores.append(s)
        parent_slot.append(idx // k)
        tokens.append(ci.flatten(-2).gather(-1, idx))
    return _assemble(scores, parent_slot, tokens, budget, f, root, batch, logp.device)


def _assemble(scores: list[torch.Tensor], parent_slot: list[torch.Tensor],
              tokens: list[torch.Tensor], budget: int,
              f: int, root: torch.Tensor | int, batch: list[int],
              device: torch.device) -> DraftTree:
    """Each depth's F kept prefixes (score, parent's rank in the depth above, token) [..., F] -> the
    DraftTree of the N best over all depths."""
    flat_s = torch.cat(scores, -1)  # [..., D*F], depth-major: ties go to the shallower
    s, order = _ranked(_pad(flat_s, budget, float("-inf")))
    # [..., N] flat indices of the nodes, best first
    s, order = s[..., :budget], order[..., :budget]
    valid = s > float("-inf")
    order = torch.where(valid, order, 0)
    # flat index -> node index (1..N), 0 if not chosen; the invalid nodes write to a spare last
    # column
    node_of = torch.zeros((*batch, flat_s.shape[-1] + 1), dtype=torch.long, device=device)
    node_of.scatter_(-1, torch.where(valid, order, flat_s.shape[-1]),
                     torch.arange(1, budget + 1, device=device).expand(order.shape))
    depth0 = order // f  # [..., N]: depth - 1 of each node
    par_slot = torch.cat(parent_slot, -1).gather(-1, order)  # the parent's rank within its depth
    par_flat = ((depth0 - 1).clamp(min=0) * f + par_slot)
    parents = torch.where((depth0 > 0) & valid, node_of.gather(-1, par_flat), 0)
    toks = torch.cat(tokens, -1).gather(-1, order)
    root_t = torch.as_tensor(root, device=device).long().expand(tuple(batch))[..., None]
    zero = torch.zeros((*batch, 1), dtype=torch.long, device=device)
    return DraftTree(tokens=torch.cat([root_t, torch.where(valid, toks, 0)], -1),
                     parents=torch.cat([zero, parents], -1),
                     depths=torch.cat([zero, torch.where(valid, depth0 + 1, 0)], -1),
                     valid=torch.cat([torch.ones_like(zero, dtype=torch.bool), valid], -1),
                     scores=torch.cat([zero.float(), s], -1))


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """parents [..., M] (the root its own parent, every node within max_depth of it) -> bool [...,
    M, M]: [i, j] True where node j is node i or one of its ancestors (what node i attends to in the
    tree)."""
    m = parents.shape[-1]
    cur = torch.arange(m, device=parents.device).expand(parents.shape).clone()  # [..., M]
    out = torch.zeros((*parents.shape, m), dtype=torch.bool, device=parents.device)
    for _ in range(max_depth + 1):
        out.scatter_(-1, cur[..., None], True)
        cur = parents.gather(-1, cur)
    return out


def walk_tree(tree: DraftTree, want: torch.Tensor,
              max_depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Follow `want` down the tree from the root: at node i, go to i's child whose token is want[i].

    want [..., N+1]: the token the walk asks for after each node (in verification the target's
    greedy choice after it; replayed along a known answer, the answer's token at the node's depth).
    Returns (accepted [...] long: nodes matched below the root; path [..., max_depth] long: their
    node indices in depth order, 0 past the accepted ones; last [...] long: the node the walk ends
    on)."""
    n1 = tree.tokens.shape[-1]
    is_node = tree.valid & (torch.arange(n1, device=want.device) > 0)  # [..., N+1]
    cur = torch.zeros(want.shape[:-1], dtype=torch.long, device=want.device)
    path, accepted = [], torch.zeros_like(cur)
    for _ in range(max_depth):
        asked = want.gather(-1, cur[..., None])  # [..., 1]
        # siblings differ: one at most
        match = is_node & (tree.parents == cur[..., None]) & (tree.tokens == asked)
        has = match.any(-1)
        nxt = match.long().argmax(-1)
        # a miss stays a miss: the next depth asks the same node again
        cur = torch.where(has, nxt, cur)
        path.append(torch.where(has, nxt, 0))
        accepted = accepted + has.long()
    return accepted, torch.stack(path, -1), cur
