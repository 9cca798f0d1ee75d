"""Drafter training rate fed from the store vs the same batches already in GPU memory; MFU.

    python -m bench train --store /dev/shm/tb.zarr --shape qwen3-8b --samples 48 --seq 2048 --steps 20

Builds a synthetic store (random bf16 taps, K=5) of `samples` sequences, then runs
train.step.forward_backward + AdamW on a DFlash drafter (5 layers, dims of the shape, 512
anchors x block 16) over the same micro-batches: (a) every batch preloaded on the GPU, (b) read through
train.data.BatchDataset + DataLoader workers (what `python -m train` runs), copied to the GPU on
the compute stream, (c) the same with the copy on a side stream (as `python -m train` copies); in
alternating rounds, medians.
MFU counts matmul FLOPs of the trainable layers (6 per parameter per token), the frozen lm_head
(4 V H per draft position: forward + input gradient) and attention (visible keys only).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time

import torch

from bench.common import SHAPES, synced_times, synthetic_manifest
from cache_format import (
    Manifest,
    ShardWriter,
    StoreReader,
    create_store,
    finalize_store,
    write_frozen,
)
from train.config import (
    CE_KERNELS,
    COMPILE_MODES,
    COMPILE_SCOPES,
    FLEX_KERNEL_NAMES,
    LOSS_BACKWARDS,
    MASK_TILES,
    RESIDUAL_DTYPES,
)
from train.data import BatchDataset, CollateSettings, plan_epoch, to_device
from train.losses import default_gamma
from train.model import DFlashDrafter, DrafterConfig
from train.step import LossSettings, forward_backward, make_optimizer


def make_store(path: str, shape: str, samples: int, seq: int, dtype: str = "bfloat16", min_seq: int = 0) -> Manifest:
    """`samples` sequences of `seq` tokens, or of lengths drawn uniformly from [min_seq, seq] (as real
    answers vary: a batch's context then rarely ends on an attention tile)."""
    sh = SHAPES[shape]
    h, v = sh["hidden_size"], sh["vocab_size"]
    shutil.rmtree(path, ignore_errors=True)
    # the target config lets `python -m train` (bench/ddp_bench.py) build the same drafter from the store
    tc = {"num_attention_heads": sh["num_attention_heads"], "num_key_value_heads": sh["num_key_value_heads"],
          "head_dim": sh["head_dim"], "intermediate_size": sh["intermediate_size"], "rope_theta": 1e6}
    m = synthetic_manifest(name=f"random-{shape}", hidden_size=h, vocab_size=v, layer_ids=(1, 9, 17, 25, 33),
                           num_records=samples, max_len=seq, bucket_bounds=(seq,), dtype=dtype, target_config=tc)
    create_store(path, m)
    g = torch.Generator().manual_seed(0)
    write_frozen(path, {"embed_tokens.weight": torch.randn(v, h, generator=g).bfloat16() * 0.02,
                        "lm_head.weight": torch.randn(v, h, generator=g).bfloat16() * 0.02,
                        "norm.weight": torch.ones(h).bfloat16()})
    pool = torch.randn(seq, 5 * h, generator=g).bfloat16()
    with ShardWriter(path, writer_id=0) as w:
        for i in range(samples):
            n = int(torch.randint(min_seq, seq + 1, (1,), generator=g)) if min_seq else seq
            w.add(i, input_ids=torch.randint(0, v, (n,), generator=g), loss_mask=torch.ones(n, dtype=torch.uint8),
                  hidden=pool[:n])
    finalize_store(path, m)
    return m


def drafter_config(shape: str, layers: int, block_size: int = 16, draft_vocab: int = 0,
                   markov_rank: int = 0) -> DrafterConfig:
    """The benched drafter: the shape's dims, 5 taps, block 16 by default (what `python -m train` builds from
    make_store's store)."""
    sh = SHAPES[shape]
    return DrafterConfig(hidden_size=sh["hidden_size"], intermediate_size=sh["intermediate_size"], num_layers=layers,
                         num_heads=sh["num_attention_heads"], num_kv_heads=sh["num_key_value_heads"],
                         head_dim=sh["head_dim"], vocab_size=sh["vocab_size"], num_taps=5, block_size=block_size,
                         mask_token_id=sh["vocab_size"] - 1, rope_theta=1e6, draft_vocab_size=draft_vocab,
                         markov_rank=markov_rank)


def bench_batches(store: str, dc: DrafterConfig, *, token_budget: int, anchors: int, count: int,
                  verify_shards: bool = False) -> BatchDataset:
    """`count` micro-batches of epoch 0's plan (cycled if it has fewer), as the trainer's DataLoader reads them."""
    r = StoreReader(store)
    steps = plan_epoch(r.sample_ids, r.lengths(), r.buckets(), token_budget=token_budget, seed=0, epoch=0,
                       ranks=1, grad_accum=1)
    micro = [s[0] for s in steps]
    micro = (micro * (count // max(1, len(micro)) + 1))[:count]
    settings = CollateSettings(tap_index=(0, 1, 2, 3, 4), num_stored_taps=5, num_anchors=anchors, block_size=dc.block_size,
                               mask_token_id=dc.mask_token_id, with_last_hidden=False)
    return BatchDataset(store, micro, list(range(len(micro))), settings, seed=0, epoch=0, verify_shards=verify_shards)


def flops_per_step(dc: DrafterConfig, batch: dict, anchors_per_seq: int) -> float:
    h, hd = dc.hidden_size, dc.head_dim
    layer = h * hd * (dc.num_heads * 2 + dc.num_kv_heads * 2) + 3 * h * dc.intermediate_size
    q = batch["block_ids"].numel()
    t = int(batch["ctx_len"].sum())
    kv = 2 * h * dc.num_kv_heads * hd
    pos = int((batch["labels"] != -100).sum())
    avg_visible = batch["hidden"].shape[1] / 2 + dc.block_size
    attn = 4 * q * avg_visible * dc.num_heads * hd * dc.num_layers * 3  # QK^T and PV, fwd + 2x bwd
    vocab = dc.draft_vocab_size or dc.vocab_size
    return 6 * q * layer * dc.num_layers + 6 * t * (5 * h * h + kv * dc.num_layers) + 4 * pos * vocab * h + attn


def _rounds(variants: dict, rounds: int, dev: torch.device) -> tuple[dict, dict, float | None]:
    """Each variant once per round, in turn: (seconds per round, share of them spent waiting for
    data, GPU memory high-water mark of the first in-memory round in GiB, batches, model and
    optimizer included)."""
    times: dict[str, list[float]] = {k: [] for k in variants}
    waits: dict[str, list[float]] = {k: [] for k in variants}
    peak_gib = None
    for r in range(rounds):
        for name, run in variants.items():
            first_mem = dev.type == "cuda" and name == "memory" and r == 0
            if first_mem:
                torch.cuda.reset_peak_memory_stats()
            t, w = run()
            times[name].append(t)
            waits[name].append(w / t)
            if first_mem:
                peak_gib = torch.cuda.max_memory_allocated() / 2**30
    return times, waits, peak_gib


def gemm_ceiling_tflops(dev: torch.device, n: int = 8192, runs: int = 12) -> float | None:
    """The card's measured bf16 matrix-product rate (n x n x n, median of the runs after two
    warm-ups): the ceiling MFU is reported against. None on a CPU (the spec figure stands there)."""
    if dev.type != "cuda":
        return None
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    times, _ = synced_times(lambda: a @ b, dev, runs)
    return 2 * n**3 / statistics.median(times[2:]) / 1e12


def _store_loader(ds: BatchDataset, a: argparse.Namespace, dev: torch.device):
    """An iterator of the bench's micro-batches from the store: DataLoader workers with pinned memory,
    as the trainer reads them."""
    return iter(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=a.workers, pin_memory=dev.type == "cuda",
                                            prefetch_factor=4 if a.workers else None))


def _profile(step, batches, dev: torch.device, sync, trace: str = "", sync_debug: bool = False) -> None:
    """Profile `step` over `batches` (an iterable of batches on the device); print the top 30 ops by
    self time. trace: the timeline also written there as a Chrome trace (gzipped where it ends in .gz;
    `python -m bench trace` sums it up). sync_debug: every host-device synchronization inside the
    profiled steps warned about, with its Python line (a sync stops the host running ahead of the GPU,
    which a side-stream copy needs to overlap the step before)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    debug = sync_debug and dev.type == "cuda"
    with profile(activities=acts) as prof:
        if debug:
            torch.cuda.set_sync_debug_mode("warn")
        for b in batches:
            step(b)
        if debug:
            torch.cuda.set_sync_debug_mode("default")
        sync()
    if trace:
        prof.export_chrome_trace(trace)
    key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=60))


def _profiled_batches(a: argparse.Namespace, gpu: list, ds, dev: torch.device, side):
    """--profile's batches: those already in GPU memory, or (--profile-from store) each read and
    copied inside the profiled window, as the trainer steps."""
    if a.profile_from == "memory":
        return gpu[a.warmup: a.warmup + a.profile]
    it = _store_loader(ds, a, dev)
    return (to_device(next(it), dev, side) for _ in range(a.profile))


def _report(a: argparse.Namespace, times: dict, waits: dict, peak_gib: float | None, *, positions: int, flops: float,
            model: torch.nn.Module, dev: torch.device) -> dict:
    """The bench's JSON line: medians over the rounds, rates, ratios to in-memory, MFU."""
    t_mem, t_store, t_side = (statistics.median(times[k]) for k in ("memory", "store", "store_side_stream"))
    return {"shape": a.shape, "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                      "layers": a.layers, "compile": a.compile, "compile_mode": a.compile_mode,
                      "compile_scope": a.compile_scope,
                      "loss_chunk": a.loss_chunk, "min_seq": a.min_seq,
                      "context_tile": a.context_tile, "mask_tile": a.mask_tile, "flex_kernel": a.flex_kernel,
                      "ce_kernel": a.ce_kernel, "residual_dtype": a.residual_dtype, "split_blocks": a.split_blocks, "markov_rank": a.markov_rank,
                      "loss_backward": a.loss_backward, "anchors": a.anchors, "token_budget": a.token_budget, "steps": a.steps,
                      "positions_per_s_memory": positions / t_mem, "positions_per_s_store": positions / t_store,
                      "ratio": t_mem / t_store, "data_wait_frac": statistics.median(waits["store"]),
                      "data_wait_frac_side_stream": statistics.median(waits["store_side_stream"]),
                      "positions_per_s_store_side_stream": positions / t_side, "ratio_side_stream": t_mem / t_side,
                      "rounds": a.rounds, "seconds_per_round": times, "peak_gib_memory": peak_gib,
                      "tflops_memory": flops / t_mem / 1e12, "mfu_memory": flops / t_mem / 1e12 / a.peak_tflops,
                      "mfu_store": flops / t_store / 1e12 / a.peak_tflops, "trainable_params":
                      sum(p.numel() for p in model.parameters() if p.requires_grad)}



def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", default="/dev/shm/draftcache_train_bench.zarr")
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--min-seq", type=int, default=0, help="lengths drawn from [min-seq, seq] (0: all seq)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of the three variants; medians reported")
    ap.add_argument("--token-budget", type=int, default=4096)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--draft-vocab", type=int, default=0, help="as --draft-vocab in train (the first N ids: the "
                    "synthetic labels are random, and every row costs the same)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "fp8_e4m3", "mxfp4"],
                    help="store dtype; fp8 batches are dequantized on the GPU by to_device, inside the timed step")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="H200 dense bf16 spec")
    ap.add_argument("--compile", action="store_true", help="torch.compile each drafter layer (as --compile in train)")
    ap.add_argument("--compile-mode", default="default", choices=COMPILE_MODES, help="as --compile-mode in train")
    ap.add_argument("--compile-scope", default="layers", choices=COMPILE_SCOPES, help="as --compile-scope in train")
    ap.add_argument("--verify-shards", action="store_true",
                    help="the store path checks each shard's checksums on first read (train --verify-shards on)")
    ap.add_argument("--loss-chunk", type=int, default=2048)
    ap.add_argument("--loss-backward", default="fused", choices=LOSS_BACKWARDS,
                    help="as --loss-backward in train")
    ap.add_argument("--context-tile", type=int, default=1, help="as train.step.LossSettings.context_tile: 0 pads the "
                    "context to FlexAttention's tile on a GPU, 1 never pads")
    ap.add_argument("--split-blocks", action="store_true", help="as --split-blocks in train")
    ap.add_argument("--flex-kernel", default="default", choices=FLEX_KERNEL_NAMES, help="as --flex-kernel in train")
    ap.add_argument("--residual-dtype", default="float32", choices=RESIDUAL_DTYPES,
                    help="as --residual-dtype in train")
    ap.add_argument("--ce-kernel", default="torch", choices=CE_KERNELS, help="as --ce-kernel in train")
    ap.add_argument("--mask-tile", type=int, default=128, choices=MASK_TILES, help="as --mask-tile in train (below "
                    "128 with a max-autotune --compile-mode)")
    ap.add_argument("--markov-rank", type=int, default=0, help="as --markov-rank in train (its head's teacher-forced "
                    "bias joins the loss: its W2 gradient keeps each chunk's logit gradient under --loss-backward fused)")
    ap.add_argument("--profile", type=int, default=0, help="profile this many steps; print the top ops")
    ap.add_argument("--profile-from", default="memory", choices=("memory", "store"),
                    help="the profiled steps' batches: in GPU memory, or read from the store and copied on the side "
                         "stream as the trainer does (its copies and fp8 dequantization in the profile)")
    ap.add_argument("--trace", default="", help="with --profile: the profiled steps' timeline as a Chrome trace "
                    "(.json or .json.gz), for `python -m bench trace`")
    ap.add_argument("--sync-debug", action="store_true", help="with --profile: warn at each host-device sync inside "
                    "the profiled steps")
    return ap


def _setup(a, dev: torch.device):
    """The bench's store, drafter, optimizer, micro-batches and loss: what python -m train builds."""
    make_store(a.store, a.shape, a.samples, a.seq, dtype=a.dtype, min_seq=a.min_seq)
    dc = drafter_config(a.shape, a.layers, a.block_size, a.draft_vocab, a.markov_rank)
    fr = StoreReader(a.store).frozen()
    model = DFlashDrafter(dc, fr["embed_tokens.weight"], fr["lm_head.weight"],
                          torch.arange(a.draft_vocab) if a.draft_vocab else None).to(dev)
    if a.compile:
        model.compile_layers(a.compile_mode, a.compile_scope)
    opt = make_optimizer(model, lr=1e-4, weight_decay=0.0)  # what python -m train uses
    ds = bench_batches(a.store, dc, token_budget=a.token_budget, anchors=a.anchors, count=a.steps + a.warmup,
                       verify_shards=a.verify_shards)
    loss = LossSettings(block_size=dc.block_size, gamma=default_gamma(dc.block_size), use_flex=dev.type == "cuda",
                        chunk=a.loss_chunk, backward=a.loss_backward, compiled=a.compile, context_tile=a.context_tile,
                        split_blocks=a.split_blocks, mask_tile=a.mask_tile,
                        flex_kernel=a.flex_kernel, ce_kernel=a.ce_kernel, residual=a.residual_dtype,
                        pad_shapes=a.compile)  # as python -m train gives a compiled drafter
    return dc, model, opt, ds, loss


def main() -> None:
    a = _parser().parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dc, model, opt, ds, loss = _setup(a, dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def step(batch):
        opt.zero_grad(set_to_none=True)
        out = forward_backward(model, batch, loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return out

    # Rounds alternate the three variants (in GPU memory; from the store with the copy on the compute
    # stream; from the store with the copy on a side stream, as the trainer copies), so that a drift in
    # the GPU's clocks over the run cannot pass for a difference between them: single 12-step runs of
    # the same command gave from-store ratios of 89.9% to 98.5%.
    gpu = [to_device(ds[i], dev) for i in range(len(ds))]  # an fp8 store's taps: dequantized once, here
    positions = sum(int((b["labels"] != -100).sum()) for b in gpu[a.warmup:])
    flops = sum(flops_per_step(dc, b, a.anchors) for b in gpu[a.warmup:])

    warmup_s: list[float] = []  # each in-memory round's warm-up: the first holds the compile

    def in_memory() -> tuple[float, float]:
        t0 = time.perf_counter()
        for b in gpu[: a.warmup]:
            step(b)
        sync()
        warmup_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for b in gpu[a.warmup:]:
            step(b)
        sync()
        return time.perf_counter() - t0, 0.0

    def from_store(copy_stream) -> tuple[float, float]:
        """DataLoader workers with pinned memory over the same micro-batches: (seconds, seconds waited)."""
        it = _store_loader(ds, a, dev)
        for _ in range(a.warmup):
            step(to_device(next(it), dev, copy_stream))
        sync()
        t0, wait = time.perf_counter(), 0.0
        for _ in range(a.steps):
            tw = time.perf_counter()
            b = next(it)
            wait += time.perf_counter() - tw
            step(to_device(b, dev, copy_stream))
        sync()
        return time.perf_counter() - t0, wait

    side = torch.cuda.Stream(dev) if dev.type == "cuda" else None
    variants = {"memory": in_memory, "store": lambda: from_store(None), "store_side_stream": lambda: from_store(side)}
    times, waits, peak_gib = _rounds(variants, a.rounds, dev)
    if a.profile:
        _profile(step, _profiled_batches(a, gpu, ds, dev, side), dev, sync, a.trace, a.sync_debug)
    row = _report(a, times, waits, peak_gib, positions=positions, flops=flops, model=model, dev=dev)
    gemm = gemm_ceiling_tflops(dev)  # after the rounds: the same clocks the step ran at
    print(json.dumps({**row, "warmup_s": warmup_s, "gemm_tflops": gemm,
                      "mfu_vs_gemm": row["tflops_memory"] / gemm if gemm else None}))

if __name__ == "__main__":
    main()
