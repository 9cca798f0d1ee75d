"""--ce-kernel liger: Liger's cross-entropy kernel as the fused loss's per-chunk softmax and gradient."""

from __future__ import annotations

import pytest
import torch

import train.liger_ce as liger_ce
from train.anchors import IGNORE
from train.losses import _head_grad, draft_loss


def _case():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 16, 24, generator=g, requires_grad=True)
    lm_head = torch.randn(90, 24, generator=g) * 0.3
    labels = torch.randint(0, 90, (2, 16), generator=g)
    labels[:, ::4] = IGNORE
    return hidden, lm_head, labels


def test_the_liger_path_gives_ours_when_its_kernel_gives_what_ours_does(monkeypatch):
    """The wiring around the kernel (chunks, hits, the weights applied in backward), with a stand-in
    kernel that forms loss, gradient and hits as ours does; the kernel itself is compared on a GPU."""
    monkeypatch.setattr(liger_ce, "liger_head_grad", lambda lo, y, t, w, d="kl", p=0.0: _head_grad(lo, y, t, w))
    hidden, lm_head, labels = _case()
    outs, grads = [], []
    for kernel in ("torch", "liger"):
        out = draft_loss(hidden, labels, lm_head, block_size=4, gamma=7.0, chunk=5, ce_kernel=kernel)
        outs.append(out)
        grads.append(torch.autograd.grad(out["loss"], hidden)[0])
    torch.testing.assert_close(outs[1]["loss"], outs[0]["loss"])
    assert torch.equal(outs[1]["correct"], outs[0]["correct"])
    torch.testing.assert_close(grads[1], grads[0])


def test_the_liger_kernel_refuses_soft_labels_and_the_penalty_in_one_line():
    hidden, lm_head, labels = _case()
    for kw in ({"kl_weight": 0.5, "teacher": torch.randn(2, 16, 24)}, {"confidence_penalty": 0.1}):
        with pytest.raises(ValueError, match="plain cross-entropy only"):
            draft_loss(hidden, labels, lm_head, block_size=4, gamma=7.0, ce_kernel="liger", **kw)
    with pytest.raises(ValueError, match="ce_kernel must be one of"):
        draft_loss(hidden, labels, lm_head, block_size=4, gamma=7.0, ce_kernel="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and liger_ce.liger_available()), reason="needs a GPU and Liger")
def test_the_liger_kernel_equals_ours_on_a_gpu():
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(300, 12288, generator=g) * 3).cuda().bfloat16()
    labels = torch.randint(0, 12288, (300,), generator=g).cuda()
    ref_loss, ref_d, ref_hit = _head_grad(logits.clone(), labels, None, 0.0)
    loss, d, hit = liger_ce.liger_head_grad(logits.clone(), labels, None, 0.0)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(d.float(), ref_d.float(), rtol=2e-2, atol=1e-4)
    assert torch.equal(hit, ref_hit)


def test_train_ce_kernel_and_flex_kernel_map_onto_the_loss_and_refuse_what_they_cannot_do(tmp_path, monkeypatch):
    from train.config import FLEX_KERNEL_NAMES, TrainConfig
    from train.masks import FLEX_KERNELS
    from train.model import DrafterConfig
    from train.start import loss_settings

    assert tuple(FLEX_KERNELS) == FLEX_KERNEL_NAMES
    dc = DrafterConfig(hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                       vocab_size=300, num_taps=3, block_size=4)
    base = {"store": str(tmp_path / "s.zarr"), "out": str(tmp_path / "run")}
    ls = loss_settings(TrainConfig(**base, flex_kernel="tuned"), torch.device("cpu"), dc)
    assert (ls.flex_kernel, ls.ce_kernel) == ("tuned", "torch")
    monkeypatch.setattr(liger_ce.importlib.util, "find_spec", lambda name: object())
    cfg = TrainConfig(**base, ce_kernel="liger")
    assert loss_settings(cfg, torch.device("cuda"), dc).ce_kernel == "liger"
    with pytest.raises(ValueError, match="ce_kernel liger needs a GPU"):
        loss_settings(cfg, torch.device("cpu"), dc)
    for bad in ({"loss": "mix"}, {"confidence_penalty": 0.1}, {"markov_rank": 8}, {"loss_backward": "keep"}):
        with pytest.raises(ValueError, match="ce_kernel liger computes plain cross-entropy"):
            TrainConfig(**base, ce_kernel="liger", **bad)
    monkeypatch.setattr(liger_ce.importlib.util, "find_spec", lambda name: None)
    cfg = TrainConfig(**base, ce_kernel="liger")  # a config (a preset, --print-config) needs no package
    with pytest.raises(ValueError, match="needs the liger-kernel package"):
        loss_settings(cfg, torch.device("cuda"), dc)
    with pytest.raises(ValueError, match="flex_kernel must be one of"):
        TrainConfig(**base, flex_kernel="fast")
