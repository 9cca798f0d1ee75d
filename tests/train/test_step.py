"""train.step: padding the context to the attention tile changes no number, only the kernels' tiles; the step reads
nothing back from the device."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from train.anchors import build_blocks, sample_anchors
from train.config import MASK_TILES
from train.losses import Weighting
from train.masks import FLEX_KERNELS, FLEX_TILE, block_tiles
from train.model import DFlashDrafter, DrafterConfig
from train.step import LossSettings, fitted_steps, forward_backward

DC = DrafterConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                   vocab_size=300, num_taps=3, block_size=8, mask_token_id=299)


def _batch(g: torch.Generator, lens=(300, 173), n=24, dc: DrafterConfig = DC) -> dict[str, torch.Tensor]:
    """A collated micro-batch of random answers (every position supervised), float32 on the CPU."""
    bs, t = dc.block_size, max(lens)
    out = {"hidden": torch.randn(len(lens), t, dc.num_taps * dc.hidden_size, generator=g),
           "anchors": torch.full((len(lens), n), -1, dtype=torch.long),
           "block_ids": torch.full((len(lens), n * bs), dc.mask_token_id),
           "block_pos": torch.zeros(len(lens), n * bs, dtype=torch.long), "labels": torch.full((len(lens), n * bs), -100)}
    for j, L in enumerate(lens):
        ids = torch.randint(0, dc.vocab_size - 1, (L,), generator=g)
        mask = torch.ones(L, dtype=torch.uint8)
        a = sample_anchors(mask, n, g)
        bi, bp, bl = build_blocks(ids, mask, a, bs, dc.mask_token_id)
        m = len(a) * bs
        out["anchors"][j, : len(a)] = a
        out["block_ids"][j, :m], out["block_pos"][j, :m], out["labels"][j, :m] = bi, bp, bl
    return out


def _run(batch, tile: int):
    g = torch.Generator().manual_seed(1)
    model = DFlashDrafter(DC, torch.randn(300, 64, generator=g), torch.randn(300, 64, generator=g))
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    out = forward_backward(model, batch, LossSettings(block_size=DC.block_size, gamma=4.0, context_tile=tile))
    return out, torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("tile", [64, FLEX_TILE])
def test_padded_context_gives_the_same_loss_hits_and_gradients(tile):
    batch = _batch(torch.Generator().manual_seed(0))
    (plain, g_plain), (padded, g_padded) = _run(batch, 1), _run(batch, tile)
    assert batch["hidden"].shape[1] % tile != 0  # the case that pads
    torch.testing.assert_close(padded["loss"], plain["loss"], rtol=1e-5, atol=1e-6)
    assert torch.equal(padded["correct"], plain["correct"]) and torch.equal(padded["count"], plain["count"])
    torch.testing.assert_close(g_padded, g_plain, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("tile", "seen"), [(0, 300), (1, 300), (64, 320), (FLEX_TILE, 384)])
def test_the_drafter_sees_the_context_padded_to_the_tile(tile, seen):
    """0 pads nothing without FlexAttention (the CPU path); the context reaches the drafter padded."""
    batch = _batch(torch.Generator().manual_seed(0))
    model = DFlashDrafter(DC, torch.randn(300, 64), torch.randn(300, 64))
    lengths = []
    model.register_forward_pre_hook(lambda _m, args: lengths.append(args[0].shape[1]))
    forward_backward(model, batch, LossSettings(block_size=DC.block_size, gamma=4.0, context_tile=tile))
    assert lengths == [seen]


def test_an_aligned_context_puts_each_query_tiles_blocks_in_one_kv_tile():
    """Why the padding pays: 16 blocks of 8 fill a query tile; after an unaligned context their keys
    straddle two kv tiles, after an aligned one they fill exactly one, and fewer tiles are visited."""
    anchors = _batch(torch.Generator().manual_seed(0), lens=(300, 290, 173), n=48)["anchors"]
    t = 300
    aligned = -(-t // FLEX_TILE) * FLEX_TILE
    visited = {}
    for ctx in (t, aligned):
        partial, full = block_tiles(anchors, ctx, DC.block_size)
        visited[ctx] = partial | full  # [B, QT, KVT]
    per_q_tile = visited[aligned][:, :, aligned // FLEX_TILE:].sum(-1)  # kv tiles of block keys only
    rows = (anchors >= 0).sum(1) * DC.block_size  # real query rows per sample
    for b in range(anchors.shape[0]):
        assert (per_q_tile[b, : int(rows[b]) // FLEX_TILE] == 1).all(), (b, per_q_tile[b])
    assert visited[aligned].sum() < visited[t].sum()


def test_train_context_tile_maps_onto_the_loss_and_refuses_a_negative_tile(tmp_path):
    """--context-tile reaches LossSettings as given (1, no padding, by default); below 0 is one line."""
    from train.config import TrainConfig
    from train.start import loss_settings

    base = {"store": str(tmp_path / "s.zarr"), "out": str(tmp_path / "run")}
    assert loss_settings(TrainConfig(**base), torch.device("cpu"), DC).context_tile == 1
    assert loss_settings(TrainConfig(**base, context_tile=0), torch.device("cpu"), DC).context_tile == 0
    with pytest.raises(ValueError, match="context_tile must be >= 0"):
        TrainConfig(**base, context_tile=-1)


@pytest.mark.parametrize("tile", MASK_TILES)
def test_the_mask_tile_shapes_the_block_mask_and_the_context_padding(tile):
    """--mask-tile reaches the FlexAttention BlockMask (and context_tile 0 pads to it); the drafter is
    stopped at its input, since FlexAttention's backward needs a GPU."""
    batch = _batch(torch.Generator().manual_seed(0))
    model = DFlashDrafter(DC, torch.randn(300, 64), torch.randn(300, 64))
    seen = {}

    def stop(_m, args):
        seen["t"], seen["mask"] = args[0].shape[1], args[4]
        raise StopIteration

    model.register_forward_pre_hook(stop)
    with pytest.raises(StopIteration):
        forward_backward(model, batch, LossSettings(block_size=DC.block_size, gamma=4.0, use_flex=True,
                                                    context_tile=0, mask_tile=tile))
    assert seen["t"] == -(-300 // tile) * tile
    assert seen["mask"].BLOCK_SIZE == (tile, tile)  # inductor's own kernel tiles: the bare BlockMask
    with pytest.raises(StopIteration):  # --flex-kernel tuned: the mask travels with its kernel options
        forward_backward(model, batch, LossSettings(block_size=DC.block_size, gamma=4.0, use_flex=True,
                                                    context_tile=0, mask_tile=tile, flex_kernel="tuned"))
    assert seen["mask"].block.BLOCK_SIZE == (tile, tile) and seen["mask"].options == FLEX_KERNELS["tuned"]


def test_train_mask_tile_maps_onto_the_loss_and_refuses_what_the_kernels_cannot_take(tmp_path):
    from train.config import TrainConfig
    from train.start import loss_settings

    base = {"store": str(tmp_path / "s.zarr"), "out": str(tmp_path / "run")}
    assert loss_settings(TrainConfig(**base), torch.device("cpu"), DC).mask_tile == FLEX_TILE
    tuned = TrainConfig(**base, mask_tile=64, compile=True, compile_mode="max-autotune-no-cudagraphs")
    assert loss_settings(tuned, torch.device("cpu"), DC).mask_tile == 64
    assert loss_settings(TrainConfig(**base, residual_dtype="bfloat16"), torch.device("cpu"), DC).residual == "bfloat16"
    with pytest.raises(ValueError, match="residual_dtype must be one of"):
        TrainConfig(**base, residual_dtype="float16")
    with pytest.raises(ValueError, match="mask_tile must be one of"):
        TrainConfig(**base, mask_tile=48)
    with pytest.raises(ValueError, match="mask_tile 64 needs --compile with a max-autotune"):
        TrainConfig(**base, mask_tile=64)


def test_a_bfloat16_residual_stream_reaches_every_layer_under_autocast_only_and_stays_close():
    """--residual-dtype bfloat16: under autocast the blocks' stream enters each layer in bf16 (the
    elementwise kernels move half the bytes), close to the float32 stream's result; without
    autocast (the CPU path) the stream keeps the weights' dtype, which the layers' matmuls need."""
    from train.masks import dense_mask

    batch = _batch(torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    model = DFlashDrafter(DC, torch.randn(300, 64, generator=g), torch.randn(300, 64, generator=g))
    seen = []
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda _m, args: seen.append(args[0].dtype))
    t = batch["hidden"].shape[1]
    args = (batch["hidden"], torch.arange(t)[None].expand(2, t), batch["block_ids"], batch["block_pos"],
            dense_mask(batch["anchors"], t, DC.block_size))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        wide, narrow = model(*args), model(*args, torch.bfloat16)
    assert seen == [torch.float32] * 2 + [torch.bfloat16] * 2 and narrow.dtype == torch.bfloat16
    assert float((narrow.float() - wide).norm() / wide.norm()) < 3e-2
    seen.clear()
    with torch.no_grad():
        assert model(*args, torch.bfloat16).dtype == torch.float32 and seen == [torch.float32] * 2


def _fitted_by_loop(step, left, step_s, pause_s, every, cap):
    """The oracle: take steps one by one, a pass after each multiple of `every`, while they fit."""
    spent, s = 0.0, step
    while s < cap:
        cost = step_s + (pause_s if every and (s + 1) % every == 0 else 0.0)
        if spent + cost > left + 1e-9:
            break
        spent, s = spent + cost, s + 1
    return s


def test_fitted_steps_are_the_most_that_fit_as_a_loop_counts_them():
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        step = int(torch.randint(0, 50, (), generator=g))
        every = int(torch.randint(0, 7, (), generator=g))
        cap = step + int(torch.randint(0, 120, (), generator=g))
        step_s = 0.05 + float(torch.rand((), generator=g))
        pause_s = 3 * float(torch.rand((), generator=g))
        left = 60 * float(torch.rand((), generator=g)) - 5  # sometimes none left
        got = fitted_steps(step, left, step_s, pause_s=pause_s, pause_every=every, cap=cap)
        assert got == _fitted_by_loop(step, left, step_s, pause_s, every, cap), (step, left, every, cap)
    with pytest.raises(ValueError, match="positive"):
        fitted_steps(0, 10.0, 0.0, cap=5)


class _DeviceReads(TorchDispatchMode):
    """Records the ops that read a value back from the device to the host (on a GPU each is a sync
    that stops the host queueing work ahead): nonzero, item, masked_select, a boolean index."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = func.overloadpacket
        indices = args[1] if op in (torch.ops.aten.index, torch.ops.aten.index_put, torch.ops.aten.index_put_) else ()
        if op in (torch.ops.aten.nonzero, torch.ops.aten._local_scalar_dense, torch.ops.aten.masked_select) or any(
                i is not None and i.dtype == torch.bool for i in indices):
            self.seen.append(str(op))
        return func(*args, **(kwargs or {}))


def _labelled(batch):  # what train.data.collate adds (tests/train/test_data.py checks it does)
    return {**batch, "labelled": torch.nonzero(batch["labels"].flatten() != -100).squeeze(1)}


@pytest.mark.parametrize("position", ["decay", "reach"])
def test_a_step_given_the_collated_labelled_index_reads_nothing_back_and_changes_no_number(position):
    batch = _batch(torch.Generator().manual_seed(0))
    batch["labels"][0, ::3] = -100  # unlabelled rows among the labelled ones
    loss = LossSettings(block_size=DC.block_size, gamma=4.0, weighting=Weighting(position=position))
    results = []
    for b in (batch, _labelled(batch)):
        g = torch.Generator().manual_seed(1)
        torch.manual_seed(0)  # the layers' own initialization
        model = DFlashDrafter(DC, torch.randn(300, 64, generator=g), torch.randn(300, 64, generator=g))
        with _DeviceReads() as reads:
            out = forward_backward(model, b, loss)
        results.append((out, torch.cat([p.grad.flatten() for p in model.parameters()]), reads.seen))
    (found, g_found, reads_found), (given, g_given, reads_given) = results
    assert reads_found == ["aten.nonzero"]  # without the index: the labelled rows found on the device
    assert reads_given == []
    assert torch.equal(given["loss"], found["loss"]) and torch.equal(g_given, g_found)
    assert torch.equal(given["correct"], found["correct"]) and torch.equal(given["count"], found["count"])
