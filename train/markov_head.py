"""A dependence head for the draft block: DSpark's first-order Markov head. Shipped beside
modeling_dflash.py in every export (torch only); config.json's markov_rank > 0 turns it on.

A DFlash drafter drafts every slot of a block in one forward, each slot blind to the tokens drafted
before it in the same block. The Markov head adds to slot k's logits a low-rank bias read from the
token at slot k - 1: W2 W1[prev], with W1 an embedding of the target's vocabulary into rank r and W2
a map from rank r onto the drafter's output vocabulary (DSpark's "vanilla" head; the weight names
markov_head.markov_w1 / markov_w2 are those of speculators' DSpark drafters). Slot 1's previous
token is the block's first token, the one the target already verified.

Drafting with the head is sequential over the block's slots (each argmax feeds the next slot's
bias), but costs only D small lookups and matrix-vector products after the drafter's one forward.
Training sees the true previous token (teacher forcing), which is exact for greedy verification:
a slot is only ever accepted when every slot before it drafted the true token.

Shapes: D drafted slots, V the target's vocabulary, N the drafter's output rows (V, or a draft
vocabulary), r the head's rank.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["MarkovHead", "markov_chain", "tree_inputs"]


class MarkovHead(nn.Module):
    """markov_w1 [V, r] (embedding of the previous token), markov_w2 [N, r] (rank r onto the
    logits)."""

    def __init__(self, vocab_size: int, out_size: int, rank: int) -> None:
        super().__init__()
        if rank < 1:
            raise ValueError(f"a Markov head needs a rank of at least 1, got {rank}")
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, out_size, bias=False)

    def forward(self, prev: torch.Tensor) -> torch.Tensor:
        """prev [...] target ids (the token before each slot) -> [..., N] logit bias of that
        slot."""
        return self.markov_w2(self.markov_w1(prev))


def markov_chain(logits: torch.Tensor, root: torch.Tensor, head: MarkovHead,
                 draft_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy drafting with the head: logits [D, N] (the drafter's, slots 1..D), root (0-d) the
    block's first token -> [D] target ids, slot k's argmax of logits[k - 1] + bias(slot k - 1's
    token). draft_ids [N]: the target id of each output row (a draft vocabulary), None when N =
    V."""
    out, prev = [], root.reshape(())
    for d in range(logits.shape[0]):
        idx = (logits[d].float() + head(prev).float()).argmax(-1)
        # a gather, not draft_ids[idx]: indexing by a 0-d tensor reads it on the host, which a CUDA
        # graph's capture refuses
        prev = idx if draft_ids is None else draft_ids.index_select(0, idx.reshape(1)).reshape(())
        out.append(prev)
    return torch.stack(out)


def tree_inputs(logits: torch.Tensor, root: torch.Tensor, head: MarkovHead,
                draft_ids: torch.Tensor | None = None):
    """What draft_tree.build_tree takes for a drafter with the head: logits [..., D, N] of the
    block's slots and root [...] (each block's first token, a target id) -> (log-probs [..., D, N],
    slot 1's after the root; the bias: output rows [..., P] of the parents -> [..., P, N] logits of
    their children). draft_ids [N]: the target id of each output row, None when N = V."""
    logits = logits.float()
    first = logits[..., :1, :] + head(root)[..., None, :].float()  # [..., 1, N]
    logp = torch.log_softmax(torch.cat([first, logits[..., 1:, :]], -2), -1)
    return logp, lambda t: head(t if draft_ids is None else draft_ids[t]).float()
