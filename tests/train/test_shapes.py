"""train.shapes: the compiled drafter's padded inputs change no loss, and trace it once."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch._dynamo.utils as dynamo_utils

from tests.train.test_step import DC
from tests.train.test_step import _batch as make_batch
from train.model import DFlashDrafter
from train.shapes import distinct_sizes, min_anchors, padded_model_inputs
from train.step import LossSettings, evaluate_holdout, forward_backward, forward_loss

# varied micro-batches as the length buckets give them: (lengths, anchors); one row alone and so
# few anchors that their queries fit one tile among them
SHAPES = [((300, 173), 25), ((200, 150, 90), 20), ((500,), 30), ((120, 100, 80, 60), 12),
          ((50,), 3), ((700, 600), 40)]


def test_min_anchors_is_the_fewest_whose_queries_span_two_tiles():
    for bs in range(1, 17):
        for tile in (16, 32, 64, 128):
            fewest = next(n for n in range(1, 1000) if math.ceil(n * bs / tile) >= 2)
            assert min_anchors(bs, tile) == fewest, (bs, tile)


def test_padded_inputs_keep_the_batch_and_pad_it_as_the_collate_pads():
    g = torch.Generator().manual_seed(0)
    b = make_batch(g, lens=(90,), n=3)
    taps, ids, pos, anchors = padded_model_inputs(b["hidden"], b["block_ids"], b["block_pos"],
                                                  b["anchors"], block_size=DC.block_size, tile=64)
    n = min_anchors(DC.block_size, 64)
    assert anchors.shape == (2, n) and ids.shape == pos.shape == (2, n * DC.block_size)
    assert taps.shape == (2, *b["hidden"].shape[1:])
    assert torch.equal(anchors[:1, :3], b["anchors"]) and (anchors[1] == -1).all() and (anchors[:, 3:] == -1).all()
    assert torch.equal(ids[:1, :3 * DC.block_size], b["block_ids"]) and not ids[1].any()
    assert torch.equal(pos[:1, :3 * DC.block_size], b["block_pos"]) and not pos[:, 3 * DC.block_size:].any()
    assert torch.equal(taps[:1], b["hidden"]) and not taps[1].any()
    big = make_batch(g, lens=(90, 80), n=n)  # already large enough: the same tensors back
    out = padded_model_inputs(big["hidden"], big["block_ids"], big["block_pos"], big["anchors"],
                              block_size=DC.block_size, tile=64)
    assert all(x is y for x, y in zip(out, (big["hidden"], big["block_ids"], big["block_pos"], big["anchors"])))


@pytest.mark.parametrize("lens_n", [((90,), 3), ((120, 60), 2), ((300,), 30)])
def test_padding_changes_neither_the_loss_nor_the_gradients_nor_the_replay(lens_n):
    g = torch.Generator().manual_seed(1)
    batch = make_batch(g, lens=lens_n[0], n=lens_n[1])
    emb, head = torch.randn(300, 64, generator=g), torch.randn(300, 64, generator=g)
    got = []
    for pad in (False, True):
        torch.manual_seed(0)
        model = DFlashDrafter(DC, emb, head)
        loss = LossSettings(block_size=DC.block_size, gamma=4.0, context_tile=0, pad_shapes=pad)
        out = forward_backward(model, batch, loss)
        with torch.no_grad():
            accepts = forward_loss(model, batch, loss, replay=True, tree_budgets=(8,))
        got.append((out["loss"].detach(), torch.cat([p.grad.flatten() for p in model.parameters()]),
                    accepts["accepts"], accepts["tree_accepts"][8]))
    (l0, g0, a0, t0), (l1, g1, a1, t1) = got
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g1, g0, rtol=1e-4, atol=1e-6)
    assert torch.equal(a0, a1) and torch.equal(t0, t1)


def _graphs(loss: LossSettings, *, backward: bool) -> int:
    """Graphs dynamo traces for a drafter compiled with dynamic shapes over SHAPES (its own backend
    "eager": dynamo's guards without inductor's code generation, which adds size guards of its own
    that this CPU test does not see)."""
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    g = torch.Generator().manual_seed(1)
    model = DFlashDrafter(DC, torch.randn(300, 64, generator=g), torch.randn(300, 64, generator=g))
    model.compile(dynamic=True, backend="eager")
    for lens, n in SHAPES:
        batch = make_batch(g, lens=lens, n=n)
        if backward:
            forward_backward(model, batch, loss)
        else:
            with torch.no_grad():
                forward_loss(model, batch, loss)
    return dynamo_utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("flex", [False, True])
def test_a_compiled_drafter_is_traced_once_over_every_bucket_shape(flex):
    # FlexAttention's backward does not run on the CPU: its masks are traced forward only
    loss = LossSettings(block_size=DC.block_size, gamma=4.0, context_tile=0, use_flex=flex, mask_tile=64)
    assert _graphs(dataclasses.replace(loss, pad_shapes=True), backward=not flex) == 1
    # the same micro-batches unpadded: one row alone, one tile of queries, equal sizes parting
    assert _graphs(loss, backward=not flex) > 1
    torch._dynamo.reset()


def test_the_held_out_pass_reuses_the_compiled_drafters_training_graph():
    """evaluate_holdout with training_graph (a compiled run's trainer asks for it) runs the drafter
    with autograd on and detaches its output: under no_grad a compiled drafter is traced again
    (torch.compile guards on the grad mode), a second compile in every process. Its figures are
    those of a no_grad forward, and it leaves no gradients."""
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    g = torch.Generator().manual_seed(1)
    batches = []
    for lens, n in SHAPES:
        b = make_batch(g, lens=lens, n=n)
        b["anchor_span"], b["sample_id"] = torch.where(b["anchors"] >= 0, 0, -1), torch.arange(len(lens))
        batches.append(b)
    torch.manual_seed(0)
    model = DFlashDrafter(DC, torch.randn(300, 64, generator=g), torch.randn(300, 64, generator=g))
    loss = LossSettings(block_size=DC.block_size, gamma=4.0, context_tile=0, pad_shapes=True)
    eager = evaluate_holdout(model, batches, torch.device("cpu"), world=1, loss=loss, tree_budgets=(8,))
    model.compile(dynamic=True, backend="eager")
    forward_backward(model, batches[0], loss)
    grads = [p.grad.clone() for p in model.parameters()]
    row = evaluate_holdout(model, batches, torch.device("cpu"), world=1, loss=loss, tree_budgets=(8,),
                           training_graph=True)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 1
    assert all(torch.equal(p.grad, g0) for p, g0 in zip(model.parameters(), grads))
    assert row["val_loss"] == pytest.approx(eager["val_loss"], rel=1e-5)
    assert row["val_decode_tau"] == eager["val_decode_tau"] and row["val_tree_tau"] == eager["val_tree_tau"]
    torch._dynamo.reset()


def test_distinct_sizes_restores_torchs_setting():
    import torch.fx.experimental._config as fx_config

    before = fx_config.use_duck_shape
    with distinct_sizes():
        assert fx_config.use_duck_shape is False
    with distinct_sizes(on=False):
        assert fx_config.use_duck_shape == before
    assert fx_config.use_duck_shape == before


@pytest.mark.parametrize("mode", ["default", "max-autotune-no-cudagraphs"])
def test_compile_options_keep_the_mode_and_drop_the_mix_order_size_guards(mode):
    import torch._inductor.config as inductor_config

    from train.model import compile_options

    options = compile_options(mode)
    for key, value in torch._inductor.list_mode_options(mode).items():
        assert options[key] == value
    with inductor_config.patch(options):  # every key is one inductor knows (torch.compile checks them so)
        if hasattr(inductor_config.triton, "mix_order_reduction_non_strict_mode"):
            assert options["triton.mix_order_reduction_non_strict_mode"] is True
            assert inductor_config.triton.mix_order_reduction_non_strict_mode is True
