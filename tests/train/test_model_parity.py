"""The trained drafter (train.model) and its exported twin (train.modeling_dflash, loaded by the
export) compute the same thing on the same weights: the export's file is written separately so that
it stands alone, and this is what keeps the two from drifting apart."""

from __future__ import annotations

import pytest
import torch

from train.export import hf_drafter
from train.model import DFlashDrafter, DrafterConfig


def _pair(draft_vocab: int):
    g = torch.Generator().manual_seed(0)
    dc = DrafterConfig(hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                       vocab_size=300, num_taps=3, block_size=8, mask_token_id=299, draft_vocab_size=draft_vocab)
    embed, head = torch.randn(300, 64, generator=g), torch.randn(300, 64, generator=g)
    ids = torch.randperm(300, generator=g)[:draft_vocab] if draft_vocab else None
    ours = DFlashDrafter(dc, embed, head, ids).eval()
    with torch.no_grad():  # away from the init, so that every weight matters
        for p in ours.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    state = {"drafter": dc.to_dict(), "layer_ids": [0, 2, 4], "num_target_layers": 6}
    return ours, hf_drafter(state, ours.state_dict()).eval(), embed, head, g


@pytest.mark.parametrize("draft_vocab", [0, 64])
def test_the_exported_drafter_drafts_what_the_trained_one_drafts(draft_vocab):
    ours, theirs, embed, head, g = _pair(draft_vocab)
    t, bs = 37, 8
    taps = torch.randn(1, t, 3 * 64, generator=g)  # [1, T, K*H]
    block = torch.cat([torch.tensor([[17]]), torch.full((1, bs - 1), 299)], 1)  # [1, Q]: last token, masks
    pos = torch.arange(t, t + bs)[None]
    with torch.no_grad():
        h1 = ours(taps, torch.arange(t)[None], block, pos, None)  # no mask: the block sees all context and itself
        h2 = theirs(torch.nn.functional.embedding(block, embed), pos, theirs.context_kv(taps, torch.arange(t)[None]))
        torch.testing.assert_close(h1, h2, rtol=1e-5, atol=1e-5)
        logits = ours.logits(h1[0, 1:])  # [Q-1, V or N]
        want = logits.argmax(-1) if not draft_vocab else ours.draft_ids[logits.argmax(-1)]
        got = theirs.draft_tokens(h2[0, 1:] @ theirs.draft_head(head).T)
        assert torch.equal(got, want)


def test_masked_stale_context_rows_change_nothing():
    """The export's decoder keeps its context in a fixed buffer whose rows past the verified length
    are stale; masking them must equal attending to the verified rows alone."""
    _, theirs, embed, _, g = _pair(0)
    t, rows, bs = 21, 40, 8
    taps = torch.randn(1, rows, 3 * 64, generator=g)
    block = torch.cat([torch.tensor([[5]]), torch.full((1, bs - 1), 299)], 1)
    x, pos = torch.nn.functional.embedding(block, embed), torch.arange(t, t + bs)[None]
    with torch.no_grad():
        exact = theirs(x, pos, theirs.context_kv(taps[:, :t], torch.arange(t)[None]))
        buffered = theirs(x, pos, theirs.context_kv(taps, torch.arange(rows)[None]), torch.arange(rows) < t)
    torch.testing.assert_close(buffered, exact, rtol=1e-5, atol=1e-5)
