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
def test_the_exported_drafter_proposes_the_trained_drafters_tokens(draft_vocab):
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
        got = theirs.draft_tokens(h2[0, 1:] @ theirs.draft_head(head).T, block[0, 0])
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


def test_a_drafter_cast_between_decodes_decodes_alike():
    """spec_generate keeps its buffers for the next prompt; a drafter cast in between gets new ones."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tgt = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                                       num_attention_heads=4, num_key_value_heads=2)).eval()
    _, served, *_ = _pair(0)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    first = served.spec_generate(tgt, ids, max_new_tokens=12)["sequences"]
    served.to(torch.bfloat16)
    assert torch.equal(served.spec_generate(tgt, ids, max_new_tokens=12)["sequences"], first)  # lossless either way
    assert served._decoding.k[0].dtype == torch.bfloat16
    # the state's head is a copy of its own, in the weight's [V, H] layout: loading new head weights into
    # the target in place reaches the next decode through that copy, and the copy never writes back
    head = tgt.get_output_embeddings().weight
    assert served._decoding.head.shape == head.shape and served._decoding.head.data_ptr() != head.data_ptr()
    with torch.no_grad():
        head.mul_(-1.0)
    flipped = head.clone()
    served.spec_generate(tgt, ids, max_new_tokens=4)
    assert torch.equal(served._decoding.head, flipped.to(torch.bfloat16)) and torch.equal(head, flipped)
