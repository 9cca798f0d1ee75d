"""Stage two, per rank: train a DFlash drafter from the store with DDP (one process per GPU).

    python -m train --store stores/demo.zarr --out runs/demo
    torchrun --nproc-per-node 8 -m train --store /dev/shm/q8b.zarr --out runs/q8b --num-layers 5
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from cache_format.layout import atomic_write_bytes
from cache_format.lock import WriterLock
from runtime.cli import to_toml
from runtime.preemption import Preemption
from runtime.world import World, any_rank
from train.checkpoint import best_checkpoint, save_best, save_checkpoint
from train.config import TrainConfig
from train.data import CollateSettings, holdout_mask, to_device
from train.data_parallel import data_parallel
from train.follow import WriterWatch
from train.losses import acceptance_from_acc
from train.metrics import MetricsLog, plot_metrics
from train.resume import resumed_state
from train.run_data import RunData
from train.start import (
    best_by,
    best_state,
    build_drafter,
    draft_vocab_of,
    drafter_config,
    loss_settings,
    open_store,
    open_val_store,
    run_record,
)
from train.state import HeldOut, ScheduleClock, TrainState, any_rank_past
from train.step import (
    StepStats,
    evaluate_holdout,
    fitted_steps,
    forward_backward,
    lr_lambda,
    make_optimizer,
)

__all__ = ["Trainer", "train"]


# Steps before an epoch's end at which the next epoch's DataLoader workers start: fresh workers need
# seconds for their first batch, which the GPU would otherwise wait for at every epoch start. The
# cost is one more set of workers' prefetched batches in memory meanwhile.
AHEAD_STEPS = 8


class Trainer:
    """One rank's training run: the store and its plan, the drafter and its optimizer, the loop
    state.

    The constructor builds them and touches no checkpoint: `resume()` says where the run starts
    (loading a checkpoint or first weights into the drafter, optimizer and schedule), and
    `fit(state)` runs epochs of `train_step`s from there, with metrics rows, held-out `validate()`s
    and `save()`d checkpoints on their schedules.
    """

    def __init__(self, cfg: TrainConfig, preempt: Preemption | None = None) -> None:
        self.cfg, self.t_start = cfg, time.time()
        self.preempt = preempt or Preemption()  # one not entered never notes a signal
        world = World.from_env()
        self.rank, self.world_size = world.rank, world.world_size
        self.device = world.join()
        # batch copies on a side stream overlap the step (docs/BENCHMARKS.md: the copy paths side by
        # side)
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        torch.manual_seed(cfg.seed)

        coverage = self._open_store(cfg, world.local_world_size)
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        self.opt = make_optimizer(self.model, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.data.view = self.data.first_view()
        # refuses a store too small for one step, with --max-steps too
        per_epoch = self.data.steps_per_epoch()
        self.total = cfg.max_steps or max(1, per_epoch * cfg.epochs)
        self.clock = ScheduleClock(cap=self.total)  # --schedule-seconds plans self.total anew

        def lr_at(step: int) -> float:  # the cosine over the steps planned now
            return lr_lambda(self.total, cfg.warmup)(step)

        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_at)
        self.record = run_record(cfg, self.dc, self.data.reader.manifest, self.layer_ids,
                                 total_steps=self.total, draft_vocab_coverage=coverage)
        self.loss = loss_settings(cfg, self.device, self.dc)
        self.stats = StepStats(cfg.block_size, self.device)
        # the step last checkpointed: a run's end often falls on a --checkpoint-every step
        self.saved_at = -1
        # the first step whose loss or gradient norm was not finite (0: none), kept on the device so
        # the check costs no host sync per step; read before every row, evaluation and checkpoint
        self.diverged_at = torch.zeros((), dtype=torch.long, device=self.device)

    def _open_store(self, cfg: TrainConfig, local_world_size: int) -> float | None:
        """The store, its held-out split, the drafter's config, vocabulary and model; returns the
        draft vocabulary's coverage of the held-out answers (None without one)."""
        watch = WriterWatch(cfg.store, cfg.follow_timeout, announce=self.rank == 0)
        reader = open_store(cfg, self.rank, watch)
        m = reader.manifest
        self.dc, tap_index = drafter_config(cfg, reader)
        self.layer_ids = [m.layer_ids[i] for i in tap_index]  # the target layers the drafter reads
        try:
            held = (holdout_mask(reader.sample_ids, cfg.val_samples, cfg.seed, reader.prompt_keys())
                    if cfg.val_samples else None)
        except ValueError as e:
            raise ValueError(f"{cfg.store}: --val-samples: {e}") from None
        draft_ids, coverage = draft_vocab_of(cfg.draft_vocab, reader, held,
                                                        self.dc.vocab_size, announce=self.rank == 0)
        if draft_ids is not None:
            self.dc = dataclasses.replace(self.dc, draft_vocab_size=len(draft_ids))
        self.model = build_drafter(self.dc, reader.frozen(), draft_ids).to(self.device)
        collate = CollateSettings(tap_index=tuple(tap_index), num_stored_taps=len(m.layer_ids),
                                  num_anchors=cfg.num_anchors, block_size=cfg.block_size,
                                  mask_token_id=self.dc.mask_token_id,
                                  with_last_hidden=cfg.effective_kl_weight > 0)
        self.data = RunData(
            cfg=cfg, reader=reader, watch=watch, held=held, collate=collate,
            val_reader=open_val_store(cfg, reader) if cfg.val_store else None,
            rank=self.rank, world_size=self.world_size, local_world_size=local_world_size,
            device=self.device, preempt=self.preempt,
            verified_dir=str(Path(cfg.out) / ".verified-shards" / socket.gethostname()))
        return coverage

    def resume(self) -> TrainState:
        """Where the run starts (train.resume.resumed_state): a new run's refusal of a used run
        directory, or the checkpoint it continues loaded into the drafter, optimizer and
        schedule."""
        return resumed_state(self.cfg, self.model, self.opt, self.sched, reader=self.data.reader,
                             dc=self.dc, layer_ids=self.layer_ids, total=self.total,
                             rank=self.rank, world=self.world_size)

    def _begin(self, state: TrainState) -> None:
        """From `state` on: the drafter compiled and wrapped for DDP, the resolved config beside
        the metrics (`python -m train --config RUN/config.toml`), the run's records opened."""
        cfg, self.state = self.cfg, state
        # --schedule-seconds: the checkpoint's plan until this process has timed its own steps
        if cfg.schedule_seconds and state.planned:
            self.total = min(self.clock.cap, max(state.planned, state.step))
        # in place: parameter names (checkpoints, export) stay those of the eager model
        if cfg.compile:
            self.model.compile_layers(cfg.compile_mode, cfg.compile_scope)
        self.ddp = (data_parallel(self.model, grad_reduce=cfg.grad_reduce)
                    if self.world_size > 1 else self.model)
        if self.rank == 0:
            # never torn: `python -m train --config RUN/config.toml` reruns it
            atomic_write_bytes(Path(cfg.out) / "config.toml", to_toml(cfg.to_dict()).encode())
        self._open_records(cfg)
        if self.held_out.ds is not None and (cfg.time_limit or cfg.schedule_seconds):
            # what a first held-out pass pays once falls before the step rate's first row: the time
            # limit's room and the schedule's plan count steady passes, not the first one's cost
            self.holdout_row(limit=1)

    def _open_records(self, cfg: TrainConfig) -> None:
        """The metrics log, the held-out set and the best score so far."""
        shown = {k: self.record[k] for k in ("train", "drafter")}
        self.log = MetricsLog(cfg.out, self.rank == 0, step=self.step, tensorboard=cfg.tensorboard,
                              wandb=cfg.wandb, config=shown)
        by, best_ck = best_by(cfg), best_checkpoint(cfg.out) if cfg.resume else None
        best = best_state(best_ck, by) if best_ck else {"step": self.step, by: float("-inf")}
        self.held_out = HeldOut(*self.data.holdout_set(), by=by, best=best[by],
                                stale=max(0, self.step - best["step"]) // cfg.val_every)

    @property
    def step(self) -> int:
        """Optimizer steps done (the state's)."""
        return self.state.step

    # ------------------------------------------------------------------ the steps
    def train_step(self, batches) -> None:
        """One optimizer step over --grad-accum micro-batches of `batches` (synced at the last)."""
        cfg = self.cfg
        self.opt.zero_grad(set_to_none=True)
        for a in range(cfg.grad_accum):
            t_wait = time.time()
            batch = to_device(next(batches), self.device, self.copy_stream)
            self.stats.wait += time.time() - t_wait
            sync = a == cfg.grad_accum - 1 or self.world_size == 1
            with self.ddp.no_sync() if not sync else contextlib.nullcontext():
                out = forward_backward(self.ddp, batch, self.loss, grad_scale=1.0 / cfg.grad_accum)
            self.stats.add(out, batch)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip)
        self.state.step += 1
        bad = ~torch.isfinite(norm) | ~torch.isfinite(out["loss"].detach())
        self.diverged_at = torch.where(bad & (self.diverged_at == 0), self.step, self.diverged_at)
        self.opt.step()
        self.sched.step()

    def check_finite(self) -> None:
        """Stop with one line if any step so far had a non-finite loss or gradient norm: the weights
        after it are not to be evaluated, saved or exported (every rank raises alike)."""
        bad = self.diverged_at.clone()
        if self.world_size > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if int(bad):
            raise ValueError(f"{self.cfg.out}: training diverged at step {int(bad)} (a loss or "
                             "gradient norm that is NaN or inf); nothing after it was saved. Lower "
                             "--lr or --clip, or resume from an earlier checkpoint")

    def plan_steps(self) -> None:
        """--schedule-seconds: the run's steps planned anew (train.step.fitted_steps) from the step
        rate since the first row, each pass to come at the latest one's seconds and room for the
        longest (a resumed process: its checkpoint's from the start); every rank plans alike from
        the slowest rank's figures."""
        now = time.time()
        step_s = self.clock.step_seconds(now, self.step)
        if step_s is None:
            return
        fig = torch.tensor([now - self.t_start, step_s, self.state.pause_s, self.state.pass_s],
                           dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            dist.all_reduce(fig, op=dist.ReduceOp.MAX)
        elapsed, step_s, longest, latest = fig.tolist()
        every = self.cfg.val_every if self.held_out.ds is not None else 0
        # room for the closing pass, and for the one right after this row on a --val-every step
        pending = every > 0 and self.step % every == 0
        left = self.cfg.schedule_seconds - elapsed - longest - latest * pending
        self.total = fitted_steps(self.step, left, max(step_s, 1e-9), pause_s=latest,
                                  pause_every=every, cap=self.clock.cap)
        self.bar.total = self.total

    def log_row(self, epoch: int) -> None:
        """One metrics row over the steps since the last one (all ranks take part)."""
        self.check_finite()
        s = self.stats.reduced(self.world_size)
        dt = time.time() - self.stats.since
        acc = s.acc()
        row = {"step": self.step, "epoch": epoch, "loss": float(s["loss"] / s["weight"]),
               "lr": self.sched.get_last_lr()[0], "acc": acc, "sim_tau": acceptance_from_acc(acc),
               "positions_per_s": float(s["positions"]) / dt,
               "data_wait_frac": float(s["wait"]) / self.world_size / dt,
               # wall seconds since this process's trainer began: the rates leave out held-out
               # passes and saving, this does not (a wall-clock comparison between runs needs it)
               "elapsed_s": time.time() - self.t_start,
               **({"planned_steps": self.total} if self.cfg.schedule_seconds else {})}
        self.log.write(row)
        self.bar.set_postfix(loss=f"{row['loss']:.3f}", tau=f"{row['sim_tau']:.2f}")
        self.stats.reset()

    def validate(self, epoch: int) -> None:
        """Held-out loss, accuracy, sim_tau and decode τ; a new best decode τ is kept as
        checkpoints/best-STEP."""
        self.check_finite()
        row = self.holdout_row()
        self.log.write({"step": self.step, "epoch": epoch, **row})
        # every rank holds the all-reduced row: all agree
        if self.held_out.note(row[self.held_out.by]):
            if self.rank == 0:
                save_best(self.cfg.out, self.step, model=self.model,
                          state={"step": self.step, "epoch": epoch, **row,
                                 "config": self.cfg.to_dict(), **self.record})
            if self.world_size > 1:
                dist.barrier()

    def holdout_row(self, limit: int = 0) -> dict[str, Any]:
        """The held-out figures over the first `limit` micro-batches (0: all)."""
        c, held = self.cfg, self.held_out
        trees = (c.val_tree_budget,) if c.val_tree_budget else ()
        return evaluate_holdout(self.model, held.ds, self.device, world=self.world_size,
                                loss=self.loss, groups=held.groups, tree_budgets=trees,
                                limit=limit, training_graph=c.compile)

    def save(self) -> None:
        """A step-N checkpoint that resumes at the state's (epoch, step in epoch); once per step."""
        # the same weights again (GBs at the 8B shape); every rank skips alike
        if self.saved_at == self.step:
            return
        self.check_finite()
        self.saved_at = self.step
        if self.rank == 0:
            save_checkpoint(self.cfg.out, self.step, model=self.model, optimizer=self.opt,
                            scheduler=self.sched, keep=self.cfg.keep_checkpoints,
                            state={"step": self.step, "epoch": self.state.epoch,
                                   "step_in_epoch": self.state.in_epoch,
                                   "config": self.cfg.to_dict(), **self.record,
                                   "pause_seconds": self.state.pause_s,
                                   "pass_seconds": self.state.pass_s,
                                   **({"planned_steps": self.total}
                                      if self.cfg.schedule_seconds else {})})
        if self.world_size > 1:
            dist.barrier()

    # ------------------------------------------------------------------ the loop
    def _start_next_epoch_early(self, epoch: int, s_idx: int, first: int, n_steps: int) -> bool:
        cfg = self.cfg
        left = n_steps - s_idx  # steps of this epoch still to run, this one included
        # in follow mode not the last epoch: it waits for the finalized store
        last_follow = cfg.follow and epoch + 1 == cfg.epochs - 1
        return (s_idx == max(first, n_steps - AHEAD_STEPS) and cfg.workers > 0
                and epoch + 1 < cfg.epochs and self.step + left < self.total and not last_follow)

    def run_epoch(self, epoch: int, first: int, steps, batches) -> tuple[bool, Any]:
        """Steps `first`.. of an epoch: (whether the run is done, the next epoch's loader if
        started)."""
        cfg, ahead = self.cfg, None
        for s_idx in range(first, len(steps)):
            if self._start_next_epoch_early(epoch, s_idx, first, len(steps)):
                # in follow mode from what is committed then (not for the last epoch)
                if cfg.follow:
                    self.data.view = self.data.follow_view(epoch + 1)
                ahead = self.data.loader(epoch + 1, 0, self.data.view)
            self.train_step(batches)
            self.bar.update(1)
            if self.step % cfg.log_every == 0 or self.step == self.total:
                if cfg.schedule_seconds:
                    self.plan_steps()
                self.log_row(epoch)
                # the closing held-out pass and checkpoint must fit in the limit too: stop that much
                # early
                limit = cfg.time_limit or cfg.schedule_seconds
                deadline = self.t_start + limit - self.state.pause_s
                if (limit and self.step < self.total
                        and any_rank_past(deadline, self.device, self.world_size)):
                    self.state.stopping("time limit")  # the closing checkpoint is this step's
                if any_rank(self.preempt.requested(), self.device, self.world_size):
                    self.state.stopping("signal")  # SIGTERM, SIGINT: this step's checkpoint is last
            self.state.epoch, self.state.in_epoch = epoch, s_idx + 1
            t_pause = time.time()
            validated = self.held_out.ds is not None and self.step % cfg.val_every == 0
            if validated:
                self.validate(epoch)
                if cfg.patience and self.held_out.stale >= cfg.patience:
                    self.state.stopping("patience")  # this step's checkpoint closes the run
            if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                self.save()
            paused = time.time() - t_pause
            self.stats.pause(paused)  # a row rates training steps, not validation or saving
            self.clock.paused += paused
            self.state.paused(paused, validated)
            if self.step >= self.total:
                self.state.stopping("steps")
            if self.state.stop:
                return True, ahead
        return False, ahead

    def fit(self, state: TrainState) -> dict[str, Any]:
        """Train from `state` (Trainer.resume's) to the run's end; returns its summary."""
        self._begin(state)
        cfg = self.cfg
        drafter = "the drafter layers" if cfg.compile_scope == "layers" else "the whole drafter"
        compiled = [name for name, on in (("FlexAttention", self.loss.use_flex),
                                          (drafter, cfg.compile)) if on]
        if self.rank == 0 and compiled:  # a silent first step of minutes looks like a hang
            print(f"the first step compiles {' and '.join(compiled)} (minutes on a machine's first "
                  "run; the inductor cache makes later runs quick)", flush=True)
        self.bar = tqdm(total=self.total, initial=self.step, disable=self.rank != 0, desc="train",
                        unit="step")
        self.stats.reset()
        start_epoch, skip = self.state.epoch, self.state.in_epoch
        epoch, done, ahead = start_epoch, self.step >= self.total, None
        while not done and epoch < cfg.epochs:
            if cfg.follow and ahead is None:
                self.data.view = self.data.follow_view(epoch)
            first = skip if epoch == start_epoch else 0
            steps, batches = ahead or self.data.loader(epoch, first, self.data.view)
            done, ahead = self.run_epoch(epoch, first, steps, batches)
            del batches
            if not done:
                self.state.epoch, self.state.in_epoch = epoch + 1, 0
            epoch += 1
        self.bar.close()
        # steps since the last row (a run ended by its epochs between rows)
        if self.stats.micro_batches:
            self.log_row(epoch - 1)
        if self.held_out.ds is not None and self.step % cfg.val_every:
            self.validate(epoch - 1)  # the epoch of the last step (the loop counted one past it)
        self.save()
        self.log.close()
        if self.rank == 0 and (Path(cfg.out) / "metrics.jsonl").exists():
            plot_metrics(cfg.out)
        stop = self.state.stop
        return {"steps": self.step, "run": cfg.out, "samples_last_epoch": len(self.data.reader),
                "finalized": self.data.reader.finalized, "stopped_early": stop == "patience",
                "patience": cfg.patience, "stopped_by_time": self.state.stop == "time limit",
                "stopped_by_signal": self.preempt.signum if self.state.stop == "signal" else 0}


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train a drafter as `cfg` says (one rank; under torchrun every rank calls it). Rank 0 holds
    RUN.lock for the run's life: a second run into the same --out is refused at once, naming the
    first."""
    Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
    first = World.from_env().rank == 0
    lock = WriterLock(cfg.out, what="run directory") if first else contextlib.nullcontext()
    with lock, Preemption() as preempt:
        trainer = Trainer(cfg, preempt)
        return trainer.fit(trainer.resume())
