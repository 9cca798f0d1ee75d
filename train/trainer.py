"""Stage two, per rank: train a DFlash drafter from the store with DDP (one process per GPU).

    python -m train --store stores/demo.zarr --out runs/demo
    torchrun --nproc-per-node 8 -m train --store /dev/shm/q8b.zarr --out runs/q8b --num-layers 5
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from cache_format import StoreReader
from cache_format.checksums import CREATION_FILES, check_checksums
from cache_format.cli import to_toml
from train.checkpoint import best_checkpoint, latest_checkpoint, load_checkpoint, save_best, save_checkpoint
from train.config import RESUME_FREE, TrainConfig
from train.data import BatchDataset, holdout_mask, plan_epoch, plan_holdout, to_device
from train.data_parallel import data_parallel
from train.follow import StoreView, agree_view, view_of, wait_for_store
from train.losses import LossOut, acceptance_from_acc, default_gamma, draft_loss
from train.masks import dense_mask, flex_block_mask, use_flex_attention
from train.metrics import MetricsLog, plot_metrics, trim_metrics
from train.model import DFlashDrafter, DrafterConfig

__all__ = ["build_drafter", "drafter_config", "train"]


def drafter_config(cfg: TrainConfig, reader: StoreReader) -> tuple[DrafterConfig, list[int]]:
    """Drafter dims from the target's config in the manifest; checks layers against the store."""
    m = reader.manifest
    tc = m.target.config
    taps = list(cfg.layers) or list(m.layer_ids)
    missing = [x for x in taps if x not in m.layer_ids]
    if missing:
        raise ValueError(f"{reader.root}: layer ids {missing} are not stored (store has {list(m.layer_ids)})")
    heads = tc.get("num_attention_heads", 8)
    dc = DrafterConfig(
        hidden_size=m.target.hidden_size, intermediate_size=cfg.intermediate_size or tc.get("intermediate_size", 4 * m.target.hidden_size),
        num_layers=cfg.num_layers, num_heads=heads, num_kv_heads=tc.get("num_key_value_heads") or heads,
        head_dim=tc.get("head_dim") or m.target.hidden_size // heads, vocab_size=m.target.vocab_size,
        num_taps=len(taps), block_size=cfg.block_size,
        mask_token_id=cfg.mask_token_id if cfg.mask_token_id >= 0 else m.mask_token_id,
        rope_theta=float(tc.get("rope_theta") or (tc.get("rope_parameters") or {}).get("rope_theta") or 10000.0),
        rms_eps=float(tc.get("rms_norm_eps", 1e-6)),
    )
    if not 0 <= dc.mask_token_id < dc.vocab_size:
        raise ValueError(f"mask_token_id {dc.mask_token_id} is outside the vocabulary (0..{dc.vocab_size - 1})")
    return dc, [m.layer_ids.index(x) for x in taps]


def build_drafter(dc: DrafterConfig, frozen: dict[str, torch.Tensor]) -> DFlashDrafter:
    emb, head = frozen["embed_tokens.weight"], frozen["lm_head.weight"]
    if emb.shape != (dc.vocab_size, dc.hidden_size):
        raise ValueError(f"embedding shape {tuple(emb.shape)} does not fit vocab {dc.vocab_size} x hidden {dc.hidden_size}")
    return DFlashDrafter(dc, emb, head)


def make_optimizer(model: DFlashDrafter, *, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; on a GPU the fused kernel (one launch for all tensors:
    the foreach update was 5.8% of an eager 8B-shaped step's CUDA time, docs/BENCHMARKS.md)."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = all(p.is_cuda for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95), fused=fused or None)


def forward_loss(model, batch: dict[str, torch.Tensor], *, block_size: int, gamma: float, kl_weight: float,
                 use_flex: bool, loss_chunk: int = 2048, loss_backward: str = "fused",
                 compiled_loss: bool = False) -> LossOut:
    """One micro-batch (already on the device): drafter forward and chunked loss (bf16 autocast on GPU)."""
    taps = batch["taps"]  # [b, T, K*H]
    t = taps.shape[1]
    ctx_pos = torch.arange(t, device=taps.device)[None].expand(taps.shape[0], t)
    mask = (flex_block_mask if use_flex else dense_mask)(batch["anchors"], t, block_size)
    core = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    with torch.autocast(taps.device.type, dtype=torch.bfloat16, enabled=taps.device.type == "cuda"):
        hidden = model(taps, ctx_pos, batch["block_ids"], batch["block_pos"], mask)  # [b, Q, H]
        return draft_loss(hidden, batch["labels"], core.lm_head, block_size=block_size, gamma=gamma,
                          teacher=batch.get("teacher"), kl_weight=kl_weight, chunk=loss_chunk,
                          backward=loss_backward, compiled=compiled_loss)


def forward_backward(model, batch: dict[str, torch.Tensor], *, block_size: int, gamma: float, kl_weight: float,
                     use_flex: bool, grad_scale: float = 1.0, loss_chunk: int = 2048,
                     loss_backward: str = "fused", compiled_loss: bool = False) -> LossOut:
    """forward_loss, then backward of loss x grad_scale."""
    out = forward_loss(model, batch, block_size=block_size, gamma=gamma, kl_weight=kl_weight, use_flex=use_flex,
                       loss_chunk=loss_chunk, loss_backward=loss_backward, compiled_loss=compiled_loss)
    (out["loss"] * grad_scale).backward()
    return out


@torch.no_grad()
def evaluate_holdout(model: DFlashDrafter, ds: BatchDataset, device: torch.device, *, world: int, block_size: int,
                     gamma: float, kl_weight: float, use_flex: bool, loss_chunk: int = 2048) -> dict[str, Any]:
    """Teacher-forced loss, per-slot accuracy and sim_tau over the held-out micro-batches (all ranks)."""
    model.eval()
    acc = torch.zeros(block_size, device=device)
    cnt = torch.zeros(block_size, device=device)
    tot = torch.zeros(2, device=device)  # weighted loss sum, weight sum
    for i in range(len(ds)):
        batch = to_device(ds[i], device)
        out = forward_loss(model, batch, block_size=block_size, gamma=gamma, kl_weight=kl_weight, use_flex=use_flex,
                           loss_chunk=loss_chunk)
        acc += out["correct"]
        cnt += out["count"]
        tot += torch.stack([out["loss"].float() * out["weight_sum"], out["weight_sum"]])
    stats = torch.cat([acc, cnt, tot])
    if world > 1:
        dist.all_reduce(stats)
    model.train()
    a = (stats[:block_size] / stats[block_size:2 * block_size].clamp(min=1)).tolist()[1:]
    return {"val_loss": float(stats[-2] / stats[-1].clamp(min=1e-12)), "val_acc": a, "val_sim_tau": acceptance_from_acc(a)}


# Steps before an epoch's end at which the next epoch's DataLoader workers start (memory: one more
# set of workers' prefetched batches for that long).
AHEAD_STEPS = 8


def _lr_lambda(total: int, warmup: float):
    w = max(1, int(total * warmup))

    def f(step: int) -> float:
        if step < w:
            return (step + 1) / w
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - w) / max(1, total - w))))
    return f


def _check_resume(cfg: TrainConfig, saved: dict[str, Any]) -> None:
    now, old = cfg.to_dict(), saved["config"]
    diffs = [f"{k}: checkpoint has {old.get(k)!r}, now {now[k]!r}" for k in now if k not in RESUME_FREE and old.get(k) != now[k]]
    if diffs:
        raise ValueError(f"cannot resume {cfg.out}: config differs ({'; '.join(diffs)})")


def train(cfg: TrainConfig) -> dict[str, Any]:
    t_start = time.time()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # batch copies overlap the step
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(cfg.seed)

    # ------------------------------------------------------------------ store and model
    if cfg.follow:  # started beside stage one: the store may not exist yet
        wait_for_store(Path(cfg.store), announce=rank == 0)
    reader = StoreReader(cfg.store)
    if not reader.finalized and not cfg.follow:
        raise ValueError(f"{cfg.store}: store is not finalized (stage one still running or killed); "
                         "pass --follow to train while it is written")
    damaged = check_checksums(cfg.store, only=CREATION_FILES)  # the frozen weights, prompt keys, manifest
    if damaged:
        raise ValueError(f"{Path(cfg.store) / damaged[0][0]}: {damaged[0][1]}; the store is damaged "
                         f"(python -m cache_format verify {cfg.store} lists every problem)")
    if cfg.loss != "ce" and not reader.manifest.last_hidden:
        raise ValueError(f"{cfg.store}: --loss {cfg.loss} needs last_hidden, which this store does not hold")
    dc, tap_index = drafter_config(cfg, reader)
    model = build_drafter(dc, reader.frozen()).to(device)
    gamma = cfg.gamma or default_gamma(cfg.block_size)
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    opt = make_optimizer(model, lr=cfg.lr, weight_decay=cfg.weight_decay)

    try:
        held = (holdout_mask(reader.sample_ids, cfg.val_samples, cfg.seed, reader.prompt_keys())
                if cfg.val_samples else None)
    except ValueError as e:
        raise ValueError(f"{cfg.store}: --val-samples: {e}") from None

    def steps_in(epoch: int, view: StoreView) -> list[list[list[int]]]:
        ids, lens, bks = reader.sample_ids, reader.lengths(), reader.buckets()
        keep = np.isin(ids, view.sample_ids)  # in follow mode the reader may hold more than the ranks agreed on
        if held is not None:
            keep &= ~held
        return plan_epoch(ids[keep], lens[keep], bks[keep], token_budget=cfg.token_budget, seed=cfg.seed, epoch=epoch,
                          ranks=world, grad_accum=cfg.grad_accum)

    def share(obj: list) -> list:  # rank 0's object on every rank
        if world > 1:
            dist.broadcast_object_list(obj, src=0)
        return obj

    def follow_view(epoch: int) -> StoreView:  # the last epoch sees everything: it waits for the finalized store
        return agree_view(reader, rank=rank, wait_final=epoch == cfg.epochs - 1, share=share)

    view = view_of(reader)
    if cfg.follow:
        view = follow_view(0)
        while len(view.sample_ids) == 0:
            time.sleep(1.0)
            view = follow_view(0)
    # In follow mode the store grows: scale the first plan by records expected / records seen.
    per_epoch = len(steps_in(0, view))
    if per_epoch == 0 and view.finalized:  # else it would train 0 steps and say nothing was wrong
        raise ValueError(f"{cfg.store}: {len(reader)} samples make fewer micro-batches of --token-budget "
                         f"{cfg.token_budget} than one step needs ({world} ranks x --grad-accum {cfg.grad_accum}); "
                         "lower the token budget or use fewer ranks")
    if not view.finalized:
        per_epoch = int(per_epoch * reader.manifest.dataset.num_records / max(1, len(view.sample_ids))) + 1
    total = cfg.max_steps or max(1, per_epoch * cfg.epochs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(total, cfg.warmup))
    step, start_epoch, skip = 0, 0, 0
    ck = latest_checkpoint(cfg.out)
    if not cfg.resume and (ck or best_checkpoint(cfg.out)):
        # else an earlier run's step-N (newer) or best-N would be what eval and export pick
        raise ValueError(f"{cfg.out} holds checkpoints of an earlier run: pass --resume to continue it, "
                         "or another --out")
    if cfg.resume and ck is not None:
        weights, opt_state, saved = load_checkpoint(ck)
        _check_resume(cfg, saved)
        model.load_state_dict(weights, strict=False)
        opt.load_state_dict(opt_state["optimizer"])
        sched.load_state_dict(opt_state["scheduler"])
        step, start_epoch, skip = saved["step"], saved["epoch"], saved["step_in_epoch"]
    if rank == 0:
        trim_metrics(cfg.out, step)  # rows a killed run logged after its last checkpoint are redone
    if cfg.compile:  # in place: parameter names (checkpoints, export) stay those of the eager model
        model.compile_layers()
    ddp = data_parallel(model, grad_reduce=cfg.grad_reduce) if world > 1 else model
    use_flex = use_flex_attention(cfg.attention, device.type, dc.head_dim)
    if rank == 0:  # the resolved config beside the metrics: `python -m train --config RUN/config.toml` reruns it
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        (Path(cfg.out) / "config.toml").write_text(to_toml(cfg.to_dict()))
    log = MetricsLog(cfg.out, rank == 0, step=step, tensorboard=cfg.tensorboard, wandb=cfg.wandb,
                     config={"train": cfg.to_dict(), "drafter": dc.to_dict()})
    config_record = {"train": cfg.to_dict(), "drafter": dc.to_dict(), "layer_ids": [reader.manifest.layer_ids[i] for i in tap_index],
                     "mask_token": reader.manifest.mask_token if dc.mask_token_id == reader.manifest.mask_token_id else "",
                     "store": str(cfg.store), "target": reader.manifest.target.name,
                     "num_target_layers": reader.manifest.target.num_layers,
                     "target_config": {k: reader.manifest.target.config.get(k) for k in ("max_position_embeddings",)}}

    saved_at = -1  # the step last checkpointed: the end of a run often falls on a --checkpoint-every step

    def checkpoint(epoch: int, in_epoch: int) -> None:
        nonlocal saved_at
        if saved_at == step:  # the same weights again (GBs at the 8B shape); every rank skips alike
            return
        saved_at = step
        if rank == 0:
            save_checkpoint(cfg.out, step, model=model, optimizer=opt, scheduler=sched, keep=cfg.keep_checkpoints,
                            state={"step": step, "epoch": epoch, "step_in_epoch": in_epoch, "config": cfg.to_dict(),
                                   **config_record})
        if world > 1:
            dist.barrier()

    val_ds = None
    if held is not None:
        val_micro = plan_holdout(reader.sample_ids[held], reader.lengths()[held], reader.buckets()[held],
                                 token_budget=cfg.token_budget, ranks=world, rank=rank)
        # fixed anchors (epoch -1 keys): every evaluation scores the same blocks
        val_ds = BatchDataset(cfg.store, val_micro, list(range(len(val_micro))), tap_index=tap_index,
                              num_stored_taps=len(reader.manifest.layer_ids), num_anchors=cfg.num_anchors,
                              block_size=cfg.block_size, mask_token_id=dc.mask_token_id, seed=cfg.seed, epoch=-1,
                              with_teacher=cfg.effective_kl_weight > 0, verify_shards=cfg.check_shards)

    best_ck = best_checkpoint(cfg.out) if cfg.resume else None
    best = json.loads((best_ck / "state.json").read_text()) if best_ck else {"step": step, "val_sim_tau": float("-inf")}
    best_score = best["val_sim_tau"]
    stale = max(0, step - best["step"]) // cfg.val_every  # evaluations since the best (patience)

    def validate(epoch: int) -> None:
        nonlocal best_score, stale
        row = evaluate_holdout(model, val_ds, device, world=world, block_size=cfg.block_size, gamma=gamma,
                               kl_weight=cfg.effective_kl_weight, use_flex=use_flex, loss_chunk=cfg.loss_chunk)
        log.write({"step": step, "epoch": epoch, **row})
        stale += 1
        if row["val_sim_tau"] > best_score:  # every rank holds the all-reduced row: all agree
            best_score, stale = row["val_sim_tau"], 0
            if rank == 0:
                save_best(cfg.out, step, model=model, state={"step": step, "epoch": epoch, "val_sim_tau": best_score,
                                                             "val_loss": row["val_loss"], "config": cfg.to_dict(),
                                                             **config_record})
            if world > 1:
                dist.barrier()

    # ------------------------------------------------------------------ loop
    compiled = [name for name, on in (("FlexAttention", use_flex), ("the drafter layers", cfg.compile)) if on]
    if rank == 0 and compiled:  # a silent first step of minutes looks like a hang
        print(f"the first step compiles {' and '.join(compiled)} (minutes on a machine's first run; the inductor "
              "cache makes later runs quick)", flush=True)
    bar = tqdm(total=total, initial=step, disable=rank != 0, desc="train", unit="step")
    acc_sum = torch.zeros(cfg.block_size, device=device)
    cnt_sum = torch.zeros(cfg.block_size, device=device)
    zero = lambda: torch.zeros((), device=device)  # noqa: E731
    loss_sum, n_loss, positions, wait, t_log = zero(), 0, zero(), 0.0, time.time()

    def loader(epoch: int, first: int, view: StoreView):
        """This rank's micro-batches of an epoch from step `first` on: (the epoch's steps, a started iterator)."""
        steps = steps_in(epoch, view)
        micro = [mb for s in steps[first:] for mb in s[rank * cfg.grad_accum:(rank + 1) * cfg.grad_accum]]
        keys = [(first + i // cfg.grad_accum) * world * cfg.grad_accum + rank * cfg.grad_accum + i % cfg.grad_accum
                for i in range(len(micro))]
        ds = BatchDataset(cfg.store, micro, keys, tap_index=tap_index, num_stored_taps=len(reader.manifest.layer_ids),
                          num_anchors=cfg.num_anchors, block_size=cfg.block_size, mask_token_id=dc.mask_token_id,
                          seed=cfg.seed, epoch=epoch, with_teacher=cfg.effective_kl_weight > 0,
                          verify_shards=cfg.check_shards)
        dl = torch.utils.data.DataLoader(ds, batch_size=None, shuffle=False, num_workers=cfg.workers,
                                         pin_memory=device.type == "cuda", prefetch_factor=4 if cfg.workers else None,
                                         persistent_workers=False)
        return steps, iter(dl)

    def log_row(epoch: int) -> None:
        """One metrics row over the steps since the last one (all ranks take part)."""
        nonlocal acc_sum, cnt_sum, loss_sum, n_loss, positions, wait, t_log
        stats = torch.cat([acc_sum, cnt_sum, loss_sum[None], torch.tensor([n_loss], device=device),
                           positions[None].float(), torch.tensor([wait], device=device)])
        if world > 1:
            dist.all_reduce(stats)
        bs = cfg.block_size
        acc = (stats[:bs] / stats[bs:2 * bs].clamp(min=1)).tolist()[1:]
        dt = time.time() - t_log
        row = {"step": step, "epoch": epoch, "loss": float(stats[2 * bs] / stats[2 * bs + 1]),
               "lr": sched.get_last_lr()[0], "acc": acc, "sim_tau": acceptance_from_acc(acc),
               "positions_per_s": float(stats[2 * bs + 2]) / dt, "data_wait_frac": float(stats[2 * bs + 3]) / world / dt}
        log.write(row)
        bar.set_postfix(loss=f"{row['loss']:.3f}", tau=f"{row['sim_tau']:.2f}")
        acc_sum.zero_(), cnt_sum.zero_()
        loss_sum, n_loss, positions, wait, t_log = zero(), 0, zero(), 0.0, time.time()

    epoch = start_epoch
    position = (start_epoch, skip)
    out_of_time = False
    done = step >= total
    ahead = None  # the next epoch's loader, started AHEAD_STEPS before this epoch ends
    while not done and epoch < cfg.epochs:
        if cfg.follow and ahead is None:
            view = follow_view(epoch)
        first = skip if epoch == start_epoch else 0
        steps, it = ahead or loader(epoch, first, view)
        ahead = None
        for s_idx in range(first, len(steps)):
            # Fresh workers need seconds for their first batch: at every epoch start the GPU waited
            # (8-20% of a 20-step log row in the real-target runs), and with the workers started 2 steps
            # early still up to 26% (SmolLM2 shape, 8 steps/s) and 9.9% (8B shape, DDP). The next epoch's
            # workers start AHEAD_STEPS before this epoch ends; in follow mode from what is committed
            # then, except for the last epoch, which waits for it all.
            left = len(steps) - s_idx  # steps of this epoch still to run, this one included
            if (s_idx == max(first, len(steps) - AHEAD_STEPS) and cfg.workers and epoch + 1 < cfg.epochs
                    and step + left < total and not (cfg.follow and epoch + 1 == cfg.epochs - 1)):
                if cfg.follow:
                    view = follow_view(epoch + 1)
                ahead = loader(epoch + 1, 0, view)
            opt.zero_grad(set_to_none=True)
            for a in range(cfg.grad_accum):
                t_wait = time.time()
                # on a side stream: in three runs of bench/train_bench.py that alternate both copy paths it
                # reached 98.6/98.5/99.6% of in-memory vs 95.9/98.3/99.2% on the compute stream
                batch = to_device(next(it), device, copy_stream)
                wait += time.time() - t_wait
                sync = (a == cfg.grad_accum - 1) or world == 1
                with ddp.no_sync() if not sync else contextlib.nullcontext():
                    out = forward_backward(ddp, batch, block_size=cfg.block_size, gamma=gamma,
                                           kl_weight=cfg.effective_kl_weight, use_flex=use_flex,
                                           grad_scale=1.0 / cfg.grad_accum, loss_chunk=cfg.loss_chunk,
                                           loss_backward=cfg.loss_backward, compiled_loss=cfg.compile)
                acc_sum += out["correct"]
                cnt_sum += out["count"]
                loss_sum += out["loss"].detach()  # device tensors: no host sync per step
                n_loss += 1
                positions += (batch["labels"] != -100).sum()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
            opt.step()
            sched.step()
            step += 1
            bar.update(1)
            if step % cfg.log_every == 0 or step == total:
                log_row(epoch)
                if cfg.time_limit and step < total and _past(t_start + cfg.time_limit, device, world):
                    total, out_of_time = step, True  # the checkpoint after the loop is this step's
            position = (epoch, s_idx + 1)
            t_pause = time.time()
            if val_ds is not None and step % cfg.val_every == 0:
                validate(epoch)
                if cfg.patience and stale >= cfg.patience:
                    total = step  # stop here: the checkpoint below and the final one are this step's
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                checkpoint(*position)
            # a row rates training steps: the seconds of validation and checkpoints are not in it
            t_log += time.time() - t_pause
            if step >= total:
                done = True
                break
        del it
        if not done:
            position = (epoch + 1, 0)
        epoch += 1
    bar.close()
    if n_loss:  # steps since the last row (a run ended by its epochs between --log-every steps)
        log_row(epoch - 1)
    if val_ds is not None and step % cfg.val_every:
        validate(epoch - 1)  # the epoch of the last step (the loop counted one past it)
    checkpoint(*position)
    log.close()
    if rank == 0 and (Path(cfg.out) / "metrics.jsonl").exists():
        plot_metrics(cfg.out)
    return {"steps": step, "run": cfg.out, "samples_last_epoch": len(reader), "finalized": reader.finalized,
            "stopped_early": bool(cfg.patience) and stale >= cfg.patience, "patience": cfg.patience,
            "stopped_by_time": out_of_time}


def _past(deadline: float, device: torch.device, world: int) -> bool:
    """Whether any rank is past `deadline` (every rank must stop at the same step)."""
    late = torch.tensor([float(time.time() > deadline)], device=device)
    if world > 1:
        dist.all_reduce(late, op=dist.ReduceOp.MAX)
    return bool(late.item())
