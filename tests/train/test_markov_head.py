"""The Markov dependence head (train/markov_head.py): its training terms against loops, drafting with it
exact against a slow reference, the trees it scores, and its export served losslessly."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tests.train.test_draft_tree import _oracle_markov
from train.anchors import IGNORE, previous_tokens
from train.export import as_whole_head, export_config, hf_drafter
from train.losses import Weighting, draft_loss
from train.markov_head import MarkovHead, markov_chain
from train.model import DFlashDrafter, DrafterConfig
from train.replay import tree_accepts
from train.vocab import OUT_OF_VOCAB


def test_previous_tokens_are_the_anchor_then_each_slots_label():
    g = torch.Generator().manual_seed(0)
    bs, n = 4, 5
    ids = torch.full((2, n, bs), 99)
    ids[..., 0] = torch.randint(0, 50, (2, n), generator=g)
    labels = torch.randint(0, 50, (2, n, bs), generator=g)
    labels[..., 0] = IGNORE
    labels[0, 1, 2:] = IGNORE  # an answer that ends inside the block
    got = previous_tokens(ids.flatten(1), labels.flatten(1), bs).view(2, n, bs)
    for b in range(2):
        for j in range(n):
            for k in range(1, bs):
                want = int(ids[b, j, 0]) if k == 1 else max(0, int(labels[b, j, k - 1]))
                assert int(got[b, j, k]) == want


def _head(v: int, out: int, r: int, g: torch.Generator) -> MarkovHead:
    h = MarkovHead(v, out, r)
    with torch.no_grad():
        for p in h.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return h


@pytest.mark.parametrize("backward", ["fused", "recompute", "keep"])
def test_the_loss_with_the_head_equals_the_loop_and_trains_both_factors(backward):
    g = torch.Generator().manual_seed(1)
    b, bs, n, h, v, r = 2, 4, 3, 8, 20, 3
    q = n * bs
    hidden = torch.randn(b, q, h, generator=g, requires_grad=True)
    lm_head = torch.randn(v, h, generator=g)
    labels = torch.randint(0, v, (b, q), generator=g)
    labels.view(b, n, bs)[..., 0] = IGNORE
    labels[1, -2:] = IGNORE
    block_ids = torch.randint(0, v, (b, q), generator=g)
    head = _head(v, v, r, g)
    prev = previous_tokens(block_ids, labels, bs)
    out = draft_loss(hidden, labels, lm_head, block_size=bs, gamma=4.0, backward=backward, chunk=5,
                     bias_rows=head.markov_w1(prev), bias_head=head.markov_w2.weight)
    out["loss"].backward()
    num = den = 0.0
    for i in range(b):  # the loop: each supervised slot's logits, its weight exp(-(k-1)/gamma)
        for j in range(q):
            if labels[i, j] == IGNORE:
                continue
            k = j % bs
            logits = hidden[i, j] @ lm_head.T + head(prev[i, j])
            w = torch.exp(torch.tensor(-(k - 1) / 4.0))
            num = num + w * F.cross_entropy(logits[None], labels[i, j][None])
            den = den + w
    want = num / den
    torch.testing.assert_close(out["loss"], want.detach(), rtol=1e-5, atol=1e-6)
    got_grads = [hidden.grad.clone(), head.markov_w1.weight.grad.clone(), head.markov_w2.weight.grad.clone()]
    for p in (hidden, *head.parameters()):
        p.grad = None
    want.backward()
    for got, ref in zip(got_grads, [hidden.grad, head.markov_w1.weight.grad, head.markov_w2.weight.grad]):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6)
    assert head.markov_w2.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("position", ["decay", "reach"])
def test_the_fused_backward_gives_the_heads_gradients_of_the_recomputed_one(position):
    """The fused path keeps each chunk's logit gradient for W2 instead of rebuilding the logits:
    with a KL teacher, labels outside a draft vocabulary and weights built from the step's own
    hits (reach), every gradient equals the checkpointed path's."""
    g = torch.Generator().manual_seed(3)
    b, bs, n, h, v, r = 2, 4, 5, 8, 20, 3
    q = n * bs
    hidden0 = torch.randn(b, q, h, generator=g)
    teacher = torch.randn(b, q, h, generator=g)
    lm_head = torch.randn(v, h, generator=g)
    labels = torch.randint(0, v, (b, q), generator=g)
    labels.view(b, n, bs)[..., 0] = IGNORE
    labels[0, 5] = OUT_OF_VOCAB
    prev = previous_tokens(torch.randint(0, v, (b, q), generator=g), labels, bs)
    head0 = _head(v, v, r, g)
    grads = []
    for backward in ("fused", "recompute"):
        hidden = hidden0.clone().requires_grad_(True)
        head = _head(v, v, r, torch.Generator())
        head.load_state_dict(head0.state_dict())
        out = draft_loss(hidden, labels, lm_head, block_size=bs, gamma=4.0, backward=backward,
                         chunk=7, teacher=teacher, kl_weight=0.5, weighting=Weighting(position=position),
                         bias_rows=head.markov_w1(prev), bias_head=head.markov_w2.weight)
        out["loss"].backward()
        grads.append([out["loss"].detach(), hidden.grad, head.markov_w1.weight.grad,
                      head.markov_w2.weight.grad])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert grads[0][3].abs().sum() > 0


def test_teacher_forced_hits_give_the_accepts_of_sequential_greedy_drafting():
    """Greedy verification accepts slot k only when slots < k drafted the true tokens: then the head's
    input at slot k is the true previous token, so the teacher-forced run of hits is the chain's."""
    g = torch.Generator().manual_seed(2)
    b, bs, n, h, v, r = 1, 6, 40, 8, 5, 4
    hidden = torch.randn(b, n * bs, h, generator=g)
    lm_head = torch.randn(v, h, generator=g)
    head = _head(v, v, r, g)
    block_ids = torch.randint(0, v, (b, n * bs), generator=g)
    blocks = hidden.view(n, bs, h)
    labels = torch.full((n, bs), IGNORE)
    for j in range(n):  # answers that follow the chain for a random number of slots, then leave it
        chain = markov_chain(blocks[j, 1:] @ lm_head.T, block_ids.view(n, bs)[j, 0], head)
        cut = int(torch.randint(0, bs, (), generator=g))
        labels[j, 1:] = chain
        if cut < bs - 1:
            labels[j, 1 + cut] = (chain[cut] + 1) % v
    labels = labels.view(b, n * bs)
    prev = previous_tokens(block_ids, labels, bs)
    out = draft_loss(hidden, labels, lm_head, block_size=bs, gamma=4.0, replay=True,
                     bias_rows=head.markov_w1(prev), bias_head=head.markov_w2.weight)
    seen = set()
    for j in range(n):
        drafted = markov_chain(blocks[j, 1:] @ lm_head.T, block_ids.view(n, bs)[j, 0], head).tolist()
        truth = labels.view(n, bs)[j, 1:].tolist()
        a = 0
        while a < bs - 1 and drafted[a] == truth[a]:
            a += 1
        assert int(out["accepts"][0, j]) == a
        seen.add(a)
    assert len(seen) > 2  # blocks accepted at several depths: not a check of zeros


def test_markov_chain_maps_draft_rows_to_target_ids():
    g = torch.Generator().manual_seed(3)
    v, rows, r = 30, 7, 2
    ids = torch.randperm(v, generator=g)[:rows]
    head = _head(v, rows, r, g)
    logits = torch.randn(5, rows, generator=g)
    got = markov_chain(logits, torch.tensor(4), head, ids).tolist()
    prev = 4
    for d in range(5):  # the loop: the bias is read from the previous token's target id
        prev = int(ids[(logits[d] + head(torch.tensor(prev))).argmax()])
        assert got[d] == prev


class _HostReads(TorchDispatchMode):
    """Counts the ops that copy a tensor's value to the host (what a CUDA graph's capture refuses)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("rows", [30, 7])
def test_markov_chain_drafts_without_reading_a_value_on_the_host(rows):
    g = torch.Generator().manual_seed(5)
    ids = None if rows == 30 else torch.randperm(30, generator=g)[:rows]
    head, logits = _head(30, rows, 2, g), torch.randn(5, rows, generator=g)
    with torch.no_grad(), _HostReads() as probe:
        markov_chain(logits, torch.tensor(4), head, ids)
        _ = torch.tensor([3, 1])[torch.tensor(1)]  # the probe sees a host read where there is one
    assert probe.reads == 1


def test_tree_accepts_with_the_head_equal_the_longest_true_prefix_of_the_enumerated_tree():
    g = torch.Generator().manual_seed(4)
    bs, n, h, v, r, budget = 4, 12, 6, 5, 3, 9
    hidden = torch.randn(1, n * bs, h, generator=g)
    lm_head = torch.randn(v, h, generator=g)
    head = _head(v, v, r, g)
    block_ids = torch.randint(0, v, (1, n * bs), generator=g)
    labels = torch.randint(0, v, (1, n * bs), generator=g)
    labels.view(n, bs)[:, 0] = IGNORE
    with torch.no_grad():
        got = tree_accepts(hidden, labels, lm_head, block_size=bs, budget=budget, head=head, roots=block_ids)
        trans = head(torch.arange(v))  # [V, V]: the bias after each token
        for j in range(n):
            base = hidden.view(n, bs, h)[j, 1:] @ lm_head.T
            prefixes = {p for p, _ in _oracle_markov(base, trans, int(block_ids.view(n, bs)[j, 0]), budget)}
            truth = tuple(labels.view(n, bs)[j, 1:].tolist())
            want = max(d for d in range(bs) if d == 0 or truth[:d] in prefixes)
            assert int(got[0, j]) == want
    assert got.max() > 1


def _drafter(rank: int, draft_vocab: int = 0, seed: int = 5) -> tuple[DFlashDrafter, dict]:
    g = torch.Generator().manual_seed(seed)
    v = 300
    dc = DrafterConfig(hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                       vocab_size=v, num_taps=3, block_size=8, mask_token_id=299, draft_vocab_size=draft_vocab,
                       markov_rank=rank)
    ids = torch.randperm(v, generator=g)[:draft_vocab] if draft_vocab else None
    ours = DFlashDrafter(dc, torch.randn(v, 64, generator=g), torch.randn(v, 64, generator=g), ids).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return ours, {"drafter": dc.to_dict(), "layer_ids": [0, 2, 4], "num_target_layers": 6}


def test_a_new_head_adds_nothing_until_trained():
    g = torch.Generator().manual_seed(0)
    dc = DrafterConfig(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                       vocab_size=40, num_taps=2, markov_rank=4)
    ours = DFlashDrafter(dc, torch.randn(40, 16, generator=g), torch.randn(40, 16, generator=g))
    assert ours.markov_head(torch.arange(40)).abs().max() == 0


@pytest.mark.parametrize("draft_vocab", [0, 64])
def test_the_served_drafter_drafts_the_trained_drafters_chain_and_tree(draft_vocab):
    ours, state = _drafter(8, draft_vocab)
    theirs = hf_drafter(state, ours.state_dict()).eval()
    g = torch.Generator().manual_seed(6)
    hid = torch.randn(7, 64, generator=g)
    logits = ours.logits(hid)  # [D, V or N]
    root = torch.tensor(17)
    ids = ours.draft_ids if draft_vocab else None
    with torch.no_grad():
        want = markov_chain(logits, root, ours.markov_head, ids)
        assert torch.equal(theirs.draft_tokens(logits, root), want)
        logp, bias = theirs.tree_logp(logits, root)
        first = torch.log_softmax(logits[0] + ours.markov_head(root), -1)
        torch.testing.assert_close(logp[0], first)
        rows = torch.arange(logits.shape[1])
        target_ids = rows if ids is None else ids
        torch.testing.assert_close(bias(rows), ours.markov_head(target_ids))


def test_the_export_names_the_head_and_a_whole_head_export_keeps_its_rows():
    ours, state = _drafter(4, draft_vocab=64)
    cfg = export_config(state)
    assert cfg["architectures"] == ["DFlashMarkovDraftModel"] and cfg["markov_rank"] == 4
    assert export_config(_drafter(0)[1])["architectures"] == ["DFlashDraftModel"]
    whole_state, whole = as_whole_head(state, dict(ours.state_dict()))
    w2 = whole["markov_head.markov_w2.weight"]
    assert w2.shape == (300, 4)
    torch.testing.assert_close(w2[ours.draft_ids], ours.markov_head.markov_w2.weight.detach())
    others = torch.ones(300, dtype=torch.bool)
    others[ours.draft_ids] = False
    assert w2[others].abs().max() == 0
    served = hf_drafter(whole_state, whole).eval()
    prev = torch.arange(300)
    with torch.no_grad():  # served over the whole head: the draft rows get the trained bias, the others none
        bias = served.markov_head(prev)  # [V, V]
        torch.testing.assert_close(bias[:, ours.draft_ids], ours.markov_head(prev))
        assert bias[:, others].abs().max() == 0


def test_a_head_the_modeling_file_cannot_run_is_refused():
    _, state = _drafter(4)
    cfg = export_config(state)
    cfg["markov_head_type"] = "rnn"
    from transformers import Qwen3Config

    from train.modeling_dflash import DFlashDraftModel
    with pytest.raises(ValueError, match="vanilla"):
        DFlashDraftModel(Qwen3Config(**cfg))
    assert json.dumps(cfg)


@pytest.fixture(scope="module")
def markov_pair(trained):
    """The evaluation tests' overfit drafter given a random Markov head, served, with the tiny target."""
    from chat.conversations import read_conversations
    from target.loader import chat_ids, load_target
    from train.checkpoint import latest_checkpoint, load_checkpoint

    target, prompts, run = trained
    weights, _, state = load_checkpoint(latest_checkpoint(run))
    v = state["drafter"]["vocab_size"]
    g = torch.Generator().manual_seed(7)
    weights = {**weights, "markov_head.markov_w1.weight": torch.randn(v, 4, generator=g),
               "markov_head.markov_w2.weight": torch.randn(v, 4, generator=g) * 0.5}
    drafter = hf_drafter({**state, "drafter": {**state["drafter"], "markov_rank": 4}}, weights).eval()
    tgt = load_target(target, device=torch.device("cpu"))
    ids = [chat_ids(tgt.tokenizer, [m for m in msgs if m["role"] != "assistant"])
           for _, msgs in read_conversations(prompts, skip_bad=False)]
    return drafter, tgt.model, ids


@pytest.mark.parametrize("budget", [0, 12])
def test_decoding_with_the_head_equals_the_targets_greedy_decoding(markov_pair, budget):
    from train.spec_decode import target_generate

    drafter, tgt, prompts = markov_pair
    new = forwards = 0
    for ids in prompts[:3]:
        greedy = target_generate(tgt, ids, max_new_tokens=30, eos=set()).tokens
        out = drafter.spec_generate(tgt, torch.tensor([ids]), max_new_tokens=30, eos_token_id=[], tree_budget=budget)
        assert out["sequences"][0, len(ids):].tolist() == greedy
        new, forwards = new + len(greedy), forwards + out["target_forwards"]
    assert new / forwards > 1.2  # drafts are accepted: not a check of the target alone


def test_a_run_with_the_head_trains_it_validates_its_trees_and_exports_it(store, tmp_path):
    from train.config import TrainConfig
    from train.export import export_run
    from train.trainer import train

    run = str(tmp_path / "run")
    train(TrainConfig(store=store, out=run, num_layers=1, block_size=4, num_anchors=16, max_steps=4, epochs=50,
                      token_budget=1024, markov_rank=4, val_samples=4, val_every=2, val_tree_budget=6, workers=0))
    rows = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
    assert any("val_tree_tau_96" in r for r in rows)
    out = export_run(run, str(tmp_path / "export"))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["markov_rank"] == 4 and cfg["architectures"] == ["DFlashMarkovDraftModel"]
    assert (out / "markov_head.py").is_file()
    from safetensors.torch import load_file
    w2 = load_file(str(out / "model.safetensors"))["markov_head.markov_w2.weight"]
    assert w2.float().abs().max() > 0  # it started at zero: the steps trained it


def test_init_from_a_drafter_without_a_head_and_from_a_whole_head_export_with_one(store, tmp_path):
    from safetensors.torch import load_file

    from train.checkpoint import latest_checkpoint, load_checkpoint
    from train.config import TrainConfig
    from train.export import export_run
    from train.trainer import train

    kw = dict(store=store, num_layers=1, block_size=4, num_anchors=16, max_steps=2, epochs=50, token_budget=1024,
              workers=0)
    train(TrainConfig(out=str(tmp_path / "plain"), **kw))
    plain = export_run(str(tmp_path / "plain"), str(tmp_path / "plain_export"))
    train(TrainConfig(out=str(tmp_path / "head"), init_from=str(plain), markov_rank=4, draft_vocab=16, **kw))
    whole = export_run(str(tmp_path / "head"), str(tmp_path / "head_export"))  # W2 over the whole vocabulary
    train(TrainConfig(out=str(tmp_path / "again"), init_from=str(whole), markov_rank=4, draft_vocab=16,
                      **{**kw, "max_steps": 1}, lr=1e-12))
    w2 = load_file(str(whole / "model.safetensors"))["markov_head.markov_w2.weight"].float()
    weights, _, _ = load_checkpoint(latest_checkpoint(str(tmp_path / "again")))
    ids = weights["draft_ids"]
    torch.testing.assert_close(weights["markov_head.markov_w2.weight"], w2[ids], rtol=0.02, atol=1e-3)
    assert w2[ids].abs().max() > 0
