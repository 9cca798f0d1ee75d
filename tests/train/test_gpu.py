"""The GPU training path against the CPU-tested one: FlexAttention + bf16 autocast (+ compile)."""

from __future__ import annotations

import pytest
import torch

from tests.train.test_step import _batch as cpu_batch
from train.masks import dense_mask, flex_block_mask
from train.model import DFlashDrafter, DrafterConfig
from train.step import LossSettings, forward_backward

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _batch(dc: DrafterConfig, g: torch.Generator) -> dict[str, torch.Tensor]:
    out = cpu_batch(g, dc=dc)
    out["hidden"] = out["hidden"].bfloat16()
    return {k: v.cuda() for k, v in out.items()}


@pytest.mark.parametrize(("compiled", "split", "tile", "kernel"), [
    (False, False, 128, "default"), ("default", False, 128, "default"), (False, True, 128, "default"),
    ("default", True, 128, "default"), ("default:model", False, 128, "default"), ("default", False, 128, "tuned"),
    ("default:model", False, 128, "tuned"), ("default:model", True, 128, "default"), ("max-autotune-no-cudagraphs", False, 128, "default"),
    ("max-autotune-no-cudagraphs", False, 64, "default")])
def test_flex_attention_step_equals_dense_step(compiled, split, tile, kernel):
    # compiled: False or a --compile-mode, ":model" for --compile-scope model; tile: the BlockMask's (--mask-tile);
    # kernel: --flex-kernel
    g = torch.Generator().manual_seed(0)
    dc = DrafterConfig(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                       vocab_size=500, num_taps=3, block_size=8, mask_token_id=499)
    emb, head = torch.randn(500, 128, generator=g) * 0.5, torch.randn(500, 128, generator=g) * 0.5
    batch = _batch(dc, g)
    losses, grads = [], []
    for use_flex in (False, True):
        torch.manual_seed(0)
        model = DFlashDrafter(dc, emb, head).cuda()
        if compiled and use_flex:
            model.compile_layers(*compiled.split(":"))
        out = forward_backward(model, batch, LossSettings(block_size=dc.block_size, gamma=4.0, use_flex=use_flex,
                                                          split_blocks=split and use_flex, mask_tile=tile, flex_kernel=kernel,
                                                          context_tile=0 if tile != 128 else 1))
        losses.append(float(out["loss"]))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert abs(losses[0] - losses[1]) < 2e-2 * abs(losses[0]), losses  # bf16 autocast, other kernels
    rel = (grads[0] - grads[1]).norm() / grads[0].norm()
    assert rel < 5e-2, float(rel)


def test_padded_shapes_under_the_whole_graph_compile_equal_the_dense_step_for_one_short_row():
    # one row with 3 anchors: train.shapes pads it to 2 rows and 2 query tiles for the compiled graph
    g = torch.Generator().manual_seed(0)
    dc = DrafterConfig(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                       vocab_size=500, num_taps=3, block_size=8, mask_token_id=499)
    emb, head = torch.randn(500, 128, generator=g) * 0.5, torch.randn(500, 128, generator=g) * 0.5
    out = cpu_batch(g, lens=(90,), n=3, dc=dc)
    batch = {k: (v.bfloat16() if k == "hidden" else v).cuda() for k, v in out.items()}
    losses, grads = [], []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = DFlashDrafter(dc, emb, head).cuda()
        if compiled:
            model.compile_layers("default", "model")
        out = forward_backward(model, batch, LossSettings(block_size=8, gamma=4.0, use_flex=compiled, pad_shapes=compiled))
        losses.append(float(out["loss"]))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert abs(losses[0] - losses[1]) < 2e-2 * abs(losses[0]), losses
    assert (grads[0] - grads[1]).norm() / grads[0].norm() < 5e-2


def test_flex_block_mask_equals_dense_mask_on_gpu():
    anchors = torch.tensor([[1, 20, 30, -1], [31, 5, 2, 7]], device="cuda")
    bm = flex_block_mask(anchors, 40, 16)
    q, kv = 4 * 16, 40 + 4 * 16
    b, qi, ki = torch.meshgrid(torch.arange(2, device="cuda"), torch.arange(q, device="cuda"),
                               torch.arange(kv, device="cuda"), indexing="ij")
    assert torch.equal(bm.mask_mod(b, torch.zeros_like(b), qi, ki), dense_mask(anchors, 40, 16))
    # the tiles built from the anchors are the ones create_block_mask finds on the device
    from torch.nn.attention.flex_attention import create_block_mask

    ref = create_block_mask(bm.mask_mod, B=2, H=None, Q_LEN=q, KV_LEN=kv, device="cuda", BLOCK_SIZE=16)
    ours = flex_block_mask(anchors, 40, 16, tile=16)
    assert torch.equal(ours.to_dense(), ref.to_dense())
    assert torch.equal(ours.full_kv_num_blocks, ref.full_kv_num_blocks)


def test_side_stream_copies_arrive_before_the_step_reads_them():
    # batches from pinned host memory, copied on a side stream while the compute stream is busy with a
    # long matmul chain; each step reads its batch right away: every value must be the host's
    from train.data import to_device

    dev, side = torch.device("cuda"), torch.cuda.Stream()
    busy = torch.randn(4096, 4096, device=dev)
    for i in range(5):
        host = {"x": torch.full((16, 4096, 1024), float(i)).pin_memory(), "y": torch.arange(4096).pin_memory()}
        for _ in range(20):
            busy = busy @ busy / busy.norm()  # keep the compute stream behind the CPU
        got = to_device(host, dev, side)
        assert bool((got["x"] == i).all()) and torch.equal(got["y"].cpu(), host["y"])


def test_fp8_taps_dequantized_on_the_side_stream_equal_the_host_decode(tmp_path):
    # fp8 bits and scales go to the GPU and are dequantized on the copy stream: bit for bit the
    # bf16 taps that the CPU path (the reader's own decode) gives
    from tests.helpers import make_manifest, write_store
    from train.data import BatchDataset, CollateSettings, to_device

    write_store(tmp_path / "s.zarr", range(8), make_manifest(dtype="fp8_e4m3"))
    settings = CollateSettings(tap_index=(1, 0), num_stored_taps=2, num_anchors=4, block_size=4, mask_token_id=99,
                               with_last_hidden=False)
    ds = BatchDataset(str(tmp_path / "s.zarr"), [[0, 5, 7], [3]], [0, 1], settings, seed=0, epoch=0)
    side = torch.cuda.Stream()
    for i in range(len(ds)):
        item = ds[i]
        got = to_device({k: v.pin_memory() for k, v in item.items()}, torch.device("cuda"), side)
        want = to_device(item, torch.device("cpu"))
        assert got["hidden"].dtype == torch.bfloat16 and torch.equal(got["hidden"].cpu(), want["hidden"])


@pytest.mark.parametrize("budget,markov,rows", [(0, 0, 0), (8, 0, 0), (32, 0, 0), (0, 4, 0), (32, 4, 0),
                                                (0, 4, 4), (32, 4, 4)])
def test_spec_generate_replays_the_drafter_step_as_a_cuda_graph_with_the_same_result(budget, markov, rows):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config

    from train.modeling_dflash import DFlashDraftModel
    from train.spec_decode import target_generate

    torch.manual_seed(0)
    # a 6-token vocabulary: random drafts often match, so blocks are partly accepted at many lengths
    tgt = LlamaForCausalLM(LlamaConfig(vocab_size=6, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2)).cuda().eval()
    dc = Qwen3Config(vocab_size=6, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16)
    dc.block_size, dc.dflash_config = 8, {"target_layer_ids": [0, 2], "mask_token_id": 5}
    dc.markov_rank = markov  # a Markov head: sequential chain drafting, conditional trees, inside the graph
    dc.draft_vocab_size = rows  # a draft vocabulary of 4 of the 6 ids (0: the whole vocabulary)
    drafter = DFlashDraftModel(dc).cuda().eval()
    if rows:
        drafter.draft_ids.copy_(torch.tensor([0, 1, 2, 4]))
    longest = 0
    for p in ([1, 2, 3, 4, 0, 1], [2] * 40, [0, 3]):
        ids = torch.tensor([p], device="cuda")
        want = target_generate(tgt, p, max_new_tokens=64, eos=set()).tokens
        runs = [drafter.spec_generate(tgt, ids, max_new_tokens=64, cuda_graph=g, tree_budget=budget)
                for g in (False, True, True)]
        for r in runs:
            assert r["sequences"][0, len(p):].tolist() == want
        assert runs[0]["accepted"] == runs[1]["accepted"] == runs[2]["accepted"]
        longest = max(longest, *runs[0]["accepted"])
    assert longest > 1  # some steps accepted drafts: the graph's acceptance and context update were exercised


def test_the_whole_graph_compile_makes_one_graph_across_the_mix_order_thresholds():
    # inductor's fused norm backward (mix-order reduction) checks its size in strict mode: 5 Mi
    # elements, 4,096 rows; micro-batches above and below them would each get a graph of their own
    import torch._dynamo.utils as dynamo_utils

    loss = LossSettings(block_size=8, gamma=4.0, use_flex=True, context_tile=0, pad_shapes=True)
    # rows x context x anchors: 51,200 queries x 128 hidden (over 5 Mi), then one row, then a few anchors
    _trained_whole_graph(loss, ((16, 1024, 400), (1, 700, 40), (3, 200, 4), (40, 400, 200)))
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


def _trained_whole_graph(loss: LossSettings, shapes) -> tuple:
    """(config, drafter, generator): a small drafter compiled as one graph (--compile-scope model),
    dynamo's counters cleared first, then a training step on a micro-batch of each (rows, context,
    anchors) of `shapes`."""
    import torch._dynamo.utils as dynamo_utils

    from bench.recompile_bench import micro_batch

    g = torch.Generator().manual_seed(0)
    dc = DrafterConfig(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                       vocab_size=500, num_taps=3, block_size=8, mask_token_id=499)
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    model = DFlashDrafter(dc, torch.randn(500, 128, generator=g), torch.randn(500, 128, generator=g)).cuda()
    model.compile_layers("default", "model")
    for rows, length, anchors in shapes:
        forward_backward(model, micro_batch(dc, rows, length, anchors, g, torch.device("cuda")), loss)
        model.zero_grad(set_to_none=True)
    return dc, model, g


def test_the_held_out_pass_adds_no_graph_to_the_whole_graph_compile():
    # a compiled run's held-out pass (training_graph: autograd on, output detached) runs the graph
    # the steps compiled; under no_grad it was traced and compiled again, once in every process
    import torch._dynamo.utils as dynamo_utils

    from bench.recompile_bench import micro_batch
    from train.step import evaluate_holdout

    loss = LossSettings(block_size=8, gamma=4.0, use_flex=True, context_tile=0, pad_shapes=True, compiled=True,
                        flex_kernel="tuned")
    dc, model, g = _trained_whole_graph(loss, ((16, 512, 64), (4, 300, 32)))
    # the drafter's graph and the compiled loss's own (compiled=True: its per-chunk gradient)
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    held = []
    for rows, length in ((6, 200), (3, 260)):  # an anchor at every answer position but the last
        b = micro_batch(dc, rows, length, length - 1, g, torch.device("cuda"))
        b["anchor_span"] = torch.where(b["anchors"] >= 0, 0, -1)
        b["sample_id"] = torch.arange(rows, device="cuda")
        held.append(b)
    row = evaluate_holdout(model, held, torch.device("cuda"), world=1, loss=loss, tree_budgets=(8,),
                           training_graph=True)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs
    assert all(p.grad is None for p in model.parameters())
    assert row["val_tree_tau"] >= 1.0 and row["val_decode_tau"] >= 1.0
    # and the count sees a graph when one is made: under no_grad the drafter compiles again
    evaluate_holdout(model, held[:1], torch.device("cuda"), world=1, loss=loss, training_graph=False)
    assert dynamo_utils.counters["stats"]["unique_graphs"] > graphs
    torch._dynamo.reset()


@pytest.mark.parametrize(("compiled", "ce_kernel", "position"), [
    (False, "torch", "decay"), (False, "torch", "reach"), ("default:model", "torch", "reach"),
    ("default:model", "liger", "reach")])
def test_a_training_step_never_waits_for_the_gpu(compiled, ce_kernel, position):
    # a host sync inside the step (a value read back) keeps the host from queueing the step's later
    # work and the next batch's side-stream copy ahead of the GPU; "error" raises at the first one
    # (a copy from pageable memory that the driver stages is not caught; the step makes none we know of)
    from tests.train.test_step import _labelled
    from train.liger_ce import liger_available
    from train.losses import Weighting
    from train.step import make_optimizer

    if ce_kernel == "liger" and not liger_available():
        pytest.skip("liger-kernel is not installed")
    g = torch.Generator().manual_seed(0)
    dc = DrafterConfig(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                       vocab_size=500, num_taps=3, block_size=8, mask_token_id=499)
    model = DFlashDrafter(dc, torch.randn(500, 128, generator=g), torch.randn(500, 128, generator=g)).cuda()
    if compiled:
        model.compile_layers(*compiled.split(":"))
    batch = _labelled(_batch(dc, g))  # the collate's host-made index (found here on the GPU, before the check)
    loss = LossSettings(block_size=8, gamma=4.0, use_flex=True, context_tile=0, pad_shapes=bool(compiled),
                        compiled=bool(compiled), ce_kernel=ce_kernel, flex_kernel="tuned", chunk=64,
                        weighting=Weighting(position=position))
    opt = make_optimizer(model, lr=1e-4, weight_decay=0.0)

    def step():
        opt.zero_grad(set_to_none=True)
        forward_backward(model, batch, loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    step()  # the compiles, and the optimizer's state made
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
