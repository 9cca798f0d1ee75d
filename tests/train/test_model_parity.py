"""The drafter trained (train.model.DFlashDrafter) and the drafter served (train/modeling_dflash.py,
the export's standalone file) are written twice; on the same weights they must give the same
hidden states, context and block alike, or the export serves another model than the one trained."""

from __future__ import annotations

import pytest
import torch

from train.export import hf_drafter
from train.model import DFlashDrafter, DrafterConfig


@pytest.mark.parametrize("kv_heads,layers", [(2, 2), (4, 1)])
def test_trained_and_exported_drafters_agree_on_the_same_weights(kv_heads, layers):
    g = torch.Generator().manual_seed(0)
    dc = DrafterConfig(hidden_size=64, intermediate_size=96, num_layers=layers, num_heads=4, num_kv_heads=kv_heads,
                       head_dim=16, vocab_size=50, num_taps=3, block_size=4, mask_token_id=49, rope_theta=10000.0,
                       rms_eps=1e-6)
    embed = torch.randn(dc.vocab_size, dc.hidden_size, generator=g)
    trained = DFlashDrafter(dc, embed, torch.randn(dc.vocab_size, dc.hidden_size, generator=g))
    with torch.no_grad():  # non-trivial norms too (they start at ones)
        for p in trained.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.2 if p.dim() > 1 else 1.0) + (1.0 if p.dim() == 1 else 0))
    weights = {k: v for k, v in trained.state_dict().items()}
    state = {"drafter": dc.to_dict(), "layer_ids": [0, 2, 4], "mask_token": "", "num_target_layers": 6}
    served = hf_drafter(state, weights).eval()
    t, n = 11, 7  # context of 11 tokens; the block's anchor at position 7 sees positions 0..6
    taps = torch.randn(1, t, dc.num_taps * dc.hidden_size, generator=g)
    block = torch.tensor([[5, 49, 49, 49]])
    pos = torch.arange(n, n + dc.block_size)[None]
    with torch.no_grad():
        ctx_a = trained.context_kv(taps, torch.arange(t)[None])
        ctx_b = served.context_kv(taps, torch.arange(t)[None])
        for (ka, va), (kb, vb) in zip(ctx_a, ctx_b):
            torch.testing.assert_close(ka, kb, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(va, vb, rtol=1e-5, atol=1e-5)
        a = trained.draft(block, pos, [(k[:, :, :n], v[:, :, :n]) for k, v in ctx_a], None)
        b = served(torch.nn.functional.embedding(block, embed), pos, [(k[:, :, :n], v[:, :, :n]) for k, v in ctx_b])
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert a.abs().mean() > 0.1  # not a degenerate comparison
