"""Where a run starts: a new run's refusal of a used run directory, or the newest checkpoint of the
run it continues (`--resume`, `--resume-from`) loaded into the drafter, optimizer and schedule."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from cache_format import StoreReader
from train.checkpoint import best_checkpoint, latest_checkpoint, load_checkpoint, set_aside_after
from train.config import TrainConfig
from train.metrics import trim_metrics
from train.model import DFlashDrafter, DrafterConfig
from train.start import check_resume, check_same_vocab, start_from_weights
from train.state import TrainState

__all__ = ["resumed_state"]


def resumed_state(cfg: TrainConfig, model: DFlashDrafter, opt: torch.optim.Optimizer,
                  sched: torch.optim.lr_scheduler.LRScheduler, *, reader: StoreReader,
                  dc: DrafterConfig,
                  layer_ids: list[int], total: int, rank: int, world: int) -> TrainState:
    """The state the loop starts from. With --resume, the newest checkpoint (or --resume-from's) is
    loaded into `model`, `opt` and `sched` after its run is checked to be this one; without it, a
    run directory holding checkpoints is refused, and --init-from / --init-layers set the first
    weights."""
    ck = latest_checkpoint(cfg.out)
    if not cfg.resume and (ck or best_checkpoint(cfg.out)):
        # else an earlier run's step-N (newer) or best-N would be what eval and export pick
        raise ValueError(f"{cfg.out} holds checkpoints of an earlier run: pass --resume to "
                         "continue it, or another --out")
    if cfg.resume and cfg.resume_from:
        ck = Path(cfg.resume_from)
    state = TrainState()
    if cfg.resume and ck is not None:
        weights, opt_state, saved = load_checkpoint(ck)
        check_resume(cfg, saved, reader.manifest.identity())
        # follow mode's total is an estimate
        if not cfg.follow and saved.get("total_steps") != total:
            raise ValueError(f"cannot resume {cfg.out}: its learning-rate schedule spans "
                             f"{saved.get('total_steps')} steps, these options make it {total} "
                             "(--max-steps or --epochs changed); resume with the same, or go on in "
                             "a new run with --init-from an export of this one")
        check_same_vocab(model, weights, str(ck), cfg.store)
        try:  # strict: a checkpoint missing a tensor would leave it at its random init
            model.load_state_dict(weights, strict=True)
        except RuntimeError as e:
            why = str(e).splitlines()[0]
            raise ValueError(f"{ck}: its weights do not fit this drafter ({why})") from None
        opt.load_state_dict(opt_state["optimizer"])
        sched.load_state_dict(opt_state["scheduler"])
        state = TrainState(step=saved["step"], epoch=saved["epoch"],
                           in_epoch=saved["step_in_epoch"], planned=saved.get("planned_steps", 0),
                           pause_s=saved.get("pause_seconds", 0.0),
                           pass_s=saved.get("pass_seconds", 0.0))
        if cfg.resume_from:  # the next resume would take the later step-N as the newest
            if rank == 0:
                set_aside_after(cfg.out, state.step)
            if world > 1:
                dist.barrier()
    elif cfg.init_from or cfg.init_layers:
        start_from_weights(model, cfg, dc, layer_ids, reader)
    if rank == 0:
        # rows a killed run logged after its last checkpoint are redone
        trim_metrics(cfg.out, state.step)
    return state
