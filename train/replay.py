"""Decoding replayed along a known continuation, from one batched drafter forward.

Speculative decoding does not visit anchors uniformly. After the prefill emits the first response
token, each verification accepts `a` drafted tokens plus the target's own next one, and the next
anchor is the last token emitted: `a + 1` positions further on, a place where the drafter just
failed. Training stores are the target's own greedy answers, so a forward with an anchor at every
response position knows each anchor's accepted length, and the path decoding would take follows
from those lengths alone (train.acceptance.decode_chain walks the same path in a loop).

Everything here is batched tensor code on the training device, with no host sync but one a round
in `visited_tree_accepts`:

- `block_accepts`: accepted drafts per block (the leading run of correct slots);
- `tree_accepts`: accepted drafts per block when decoding verifies a draft tree (train.draft_tree)
  instead of the chain: the deepest prefix of the known continuation the block's tree holds;
- `visited_tree_accepts`: the same at the blocks decoding visits only, found round by round;
- `anchor_spans`: which response span (assistant turn) each anchor lies in;
- `decode_visits`: the anchors decoding visits, by pointer doubling over "next anchor" links;
- `replay_counts`: tokens and target forwards of that decode (val_decode_tau = tokens / forwards);
- `reach_weights` and `visit_weights`: the decode-aware loss weights built from them.
"""

from __future__ import annotations

import torch

from train.draft_tree import build_tree, walk_tree
from train.markov_head import tree_inputs

__all__ = ["anchor_spans", "block_accepts", "decode_visits", "reach_weights", "replay_counts",
           "tree_accepts", "visit_weights", "visited_tree_accepts"]


def block_accepts(hit: torch.Tensor) -> torch.Tensor:
    """hit bool [b, N, B] (slot k's argmax equals its label; slot 0 is the anchor) -> int64 [b, N]:
    the leading run of hits over slots 1..B-1. A slot without a label counts as a miss, which caps
    the run where the known continuation ends."""
    return hit[..., 1:].long().cumprod(-1).sum(-1)


@torch.no_grad()
def tree_accepts(hidden: torch.Tensor, labels: torch.Tensor, lm_head: torch.Tensor, *,
                 block_size: int, budget: int, width: int = 0, chunk: int = 512, head=None,
                 roots: torch.Tensor | None = None,
                 draft_ids: torch.Tensor | None = None) -> torch.Tensor:
    """hidden [b, Q, H] (drafter output, Q = N blocks x block_size), labels [b, Q] (lm_head row of
    the token at each slot; < 0: none, a miss), lm_head [V, H] -> int64 [b, N]: the drafted tokens
    each block's draft tree of `budget` nodes (build_tree, `width` per depth) accepts when the walk
    asks for the known continuation. A tree holds its prefixes' ancestors, so that is the longest
    prefix of the continuation among the tree's nodes; where the tree holds the argmax chain it is
    at least block_accepts. `chunk` blocks at a time: each holds [chunk, block_size - 1, V]
    log-probabilities.

    head: a Markov head (train.markov_head) whose conditional scores build the trees, with roots
    [b, Q] (the blocks' token ids: slot 0 holds the anchor's) and draft_ids [V] (the target id of
    each lm_head row, None when lm_head is the target's whole head)."""
    b, q, h = hidden.shape
    d = block_size - 1
    rows = hidden.reshape(-1, block_size, h)[:, 1:]  # [M, D, H]: slots 1..D of every block
    truth = labels.reshape(-1, block_size)[:, 1:].long()  # [M, D]: slot k+1's token at column k
    # depth j of a tree asks for slot j+1's token (the root asks for slot 1); depth D asks for
    # nothing
    asked = torch.cat([truth, truth.new_full((truth.shape[0], 1), -1)], 1)  # [M, D+1]
    head_w = lm_head.to(rows.dtype).T  # [H, V], cast once for every chunk
    # each chunk's conditional scores hold [chunk, F, V]: about 2^28 of them at most
    if head is not None:
        chunk = max(1, min(chunk, 2 ** 28 // (min(budget, width or budget) * lm_head.shape[0])))
        root = roots.reshape(-1, block_size)[:, 0]  # [M]: each block's first token
    out = []
    for i in range(0, rows.shape[0], chunk):
        logits = rows[i:i + chunk] @ head_w  # [c, D, V]
        logp, bias = (torch.log_softmax(logits.float(), -1), None) if head is None else \
            tree_inputs(logits, root[i:i + chunk], head, draft_ids)
        tree = build_tree(logp, budget, width=width, bias=bias)
        want = asked[i:i + chunk].gather(1, tree.depths)  # [c, N+1]
        out.append(walk_tree(tree, want, d)[0])
    return torch.cat(out).view(b, q // block_size) if out else labels.new_zeros(b, 0)


@torch.no_grad()
def visited_tree_accepts(hidden: torch.Tensor, labels: torch.Tensor, lm_head: torch.Tensor,
                         anchors: torch.Tensor, spans: torch.Tensor, *, block_size: int,
                         roots: torch.Tensor | None = None, **tree) -> torch.Tensor:
    """tree_accepts (same arguments, `tree` its keywords) at the anchors decoding visits, 0 at the
    others: decode_visits and replay_counts read the same figures from it as from tree_accepts, for
    the trees of the visited blocks alone (about one block in τ). A dependence head's trees score
    every kept prefix's children over the whole vocabulary, which makes a tree at every block the
    held-out pass's largest cost. anchors, spans [b, N] as decode_visits takes them.

    The visits are found round by round from the span starts: each round builds the trees of the
    current blocks only (one per span at most), and their accepted lengths link to the next
    round's (_next_links); a host sync a round ends the loop."""
    b, n = anchors.shape
    blocks = lambda x: x.reshape(b, n, block_size, *x.shape[2:])  # noqa: E731  [b, N, bs, ...]
    h, lab = blocks(hidden), blocks(labels)
    rts = blocks(roots) if roots is not None else None
    out = torch.zeros((b, n), dtype=torch.long, device=anchors.device)
    cur = _span_starts(anchors, spans)  # [b, N] the blocks of this round
    while bool(cur.any()):
        bi, ni = cur.nonzero(as_tuple=True)  # [M]
        # [1, M*bs, ...]: this round's blocks as one row
        hi, li, ri = (None if x is None else x[bi, ni].reshape(1, -1, *x.shape[3:])
                      for x in (h, lab, rts))
        acc = tree_accepts(hi, li, lm_head, block_size=block_size, roots=ri, **tree)[0]  # [M]
        out[bi, ni] = acc
        nxt = _next_links(anchors, out, spans)[bi, ni]  # [M] in 0..N (N: nowhere)
        cur = torch.zeros_like(cur)
        cur[bi[nxt < n], nxt[nxt < n]] = True
    return out


def anchor_spans(loss_mask: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """loss_mask [L], anchors [n] (positions) -> int64 [n]: the index of the supervised span
    (a run of supervised positions: one assistant turn) that holds each anchor."""
    m = loss_mask.bool().long()
    starts = m.clone()
    starts[1:] = (m[1:] - m[:-1]).clamp(min=0)
    return (starts.cumsum(0) - 1)[anchors]


def _span_starts(anchors: torch.Tensor, spans: torch.Tensor) -> torch.Tensor:
    """bool [b, N]: the first (valid) anchor of each span, where decoding starts."""
    first = torch.ones_like(anchors, dtype=torch.bool)
    first[:, 1:] = spans[:, 1:] != spans[:, :-1]
    return first & (anchors >= 0)


def _next_links(anchors: torch.Tensor, accepts: torch.Tensor, spans: torch.Tensor) -> torch.Tensor:
    """Index of the anchor decoding drafts from after each anchor, or N (nowhere) [b, N].

    After anchor p with `a` accepted, the next anchor is position p + a + 1. Where that position
    was not sampled as an anchor (training draws at most --num-anchors per sequence), the next
    sampled one after it stands in. Padding (-1) and another span's anchors are nowhere.
    """
    b, n = anchors.shape
    big = torch.iinfo(torch.long).max
    valid = anchors >= 0
    pos = torch.where(valid, anchors, big)  # padding sorts last
    want = torch.where(valid, anchors + accepts + 1, big)
    nxt = torch.searchsorted(pos, want)  # [b, N], in 0..N
    safe = nxt.clamp(max=n - 1)
    same = (nxt < n) & valid & (spans.gather(1, safe) == spans) & pos.gather(1, safe).ne(big)
    return torch.where(same, nxt, n)


def decode_visits(anchors: torch.Tensor, accepts: torch.Tensor,
                  spans: torch.Tensor) -> torch.Tensor:
    """anchors [b, N] (sorted positions, -1 padding at the end), accepts [b, N], spans [b, N]
    -> bool [b, N]: the anchors decoding visits when it starts at the first anchor of each span.

    The links only point forward, so the visited set is what the span starts reach. Pointer
    doubling finds it in ceil(log2 N) + 1 rounds: after round r every node within 2^r links of a
    start is marked, and the jump table is squared for the next round.
    """
    b, n = anchors.shape
    valid = anchors >= 0
    # [b, N+1]
    sink = torch.zeros(b, 1, dtype=torch.bool, device=anchors.device)
    mark = torch.cat([_span_starts(anchors, spans), sink], 1)
    jump = torch.cat([_next_links(anchors, accepts, spans),
                      # N+1 is a sink
                      torch.full((b, 1), n, dtype=torch.long, device=anchors.device)], 1)
    for _ in range(max(1, (n - 1).bit_length()) + 1):
        hits = torch.zeros(mark.shape, device=mark.device).scatter_add_(1, jump, mark.float())
        mark = mark | (hits > 0)
        jump = jump.gather(1, jump)
    return mark[:, :n] & valid


def replay_counts(anchors: torch.Tensor, accepts: torch.Tensor, spans: torch.Tensor,
                  window: int = 0,
                  visits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(new tokens, target forwards), float32 scalars, of decoding every span of the batch along
    its known continuation. Needs an anchor at every position of each span but its last (the
    held-out batches are built so): a span of s tokens then has s - 1 anchors, and decoding takes
    one forward for the prefill's token plus one per visited anchor (train.acceptance.decode_chain).
    window > 0: decoding stops after `window` new tokens, as an evaluation with that many new tokens
    does (a drafted anchor is one whose token is among the first window - 1). visits: decode_visits
    of the same arguments when the caller has it (counting several windows walks the links once).
    """
    starts = _span_starts(anchors, spans)
    num_spans = starts.sum()
    counted = anchors >= 0
    # each anchor's offset in its span: anchors are sorted, so the span's start is a running max
    if window > 0:
        first = torch.where(starts, anchors, torch.full_like(anchors, -1)).cummax(1).values
        counted = counted & (anchors - first < window - 1)
    tokens = counted.sum() + num_spans
    if visits is None:
        visits = decode_visits(anchors, accepts, spans)
    forwards = (visits & counted).sum() + num_spans
    return tokens.float(), forwards.float()


def visit_weights(anchors: torch.Tensor, accepts: torch.Tensor, spans: torch.Tensor,
                  extra: float) -> torch.Tensor:
    """float32 [b, N]: 1 + extra at the anchors decoding with the current drafter visits, 1
    elsewhere."""
    return 1.0 + extra * decode_visits(anchors, accepts, spans).float()


def reach_weights(hit: torch.Tensor, labelled: torch.Tensor, floor: float = 0.01) -> torch.Tensor:
    """hit, labelled bool [b, N, B] -> float32 [B]: the weight of each block slot by what it is
    worth to decoding now.

    With R_j the batch's share of blocks whose slots 1..j are all correct (among those with slot j
    labelled), expected acceptance is 1 + sum_j R_j and d tau / d log a_k = sum_{j >= k} R_j, a_k
    being slot k's accuracy given the slots before it. Slot k's weight is that sum: the tokens
    accepted at slot k or later. Slot 0 (the anchor) gets 0; every other slot at least `floor`
    times slot 1's weight, so no slot is dropped for good.
    """
    run = hit[..., 1:].long().cumprod(-1).bool()  # [b, N, B-1]: slots 1..j all correct
    lab = labelled[..., 1:]
    r = (run & lab).sum((0, 1)).float() / lab.sum((0, 1)).clamp(min=1).float()  # [B-1] R_j
    tail = r.flip(0).cumsum(0).flip(0)  # sum_{j >= k} R_j
    w = torch.maximum(tail, floor * tail[:1].clamp(min=1e-6))
    return torch.cat([w.new_zeros(1), w])
