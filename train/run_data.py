"""One rank's training data: the store and the view of it every rank agrees on, the held-out split,
each epoch's plan of steps and the DataLoader that reads this rank's share of it."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from cache_format import StoreReader
from runtime.preemption import Preemption
from train.config import TrainConfig
from train.data import BatchDataset, CollateSettings, node_shares, plan_epoch, replay_dataset
from train.follow import StoreView, WriterWatch, agree_view, view_of
from train.start import domain_groups

__all__ = ["RunData"]


@dataclass(kw_only=True)
class RunData:
    """What the training loop reads, and how: `view` is the samples this epoch trains on (in follow
    mode what the ranks agreed on last; else the whole store)."""

    cfg: TrainConfig
    reader: StoreReader
    watch: WriterWatch  # gives up on a dead writer's store
    held: np.ndarray | None  # [samples] bool: held out of training (--val-samples)
    val_reader: StoreReader | None  # --val-store
    collate: CollateSettings
    rank: int
    world_size: int  # ranks in all
    local_world_size: int  # ranks on this node
    device: torch.device
    preempt: Preemption
    # shards checked once per run and node, not once per worker process (workers start anew each
    # epoch)
    verified_dir: str
    view: StoreView | None = None

    def share(self, obj: list) -> list:
        """Rank 0's object on every rank."""
        if self.world_size > 1:
            dist.broadcast_object_list(obj, src=0)
        return obj

    def follow_view(self, epoch: int) -> StoreView:
        """The committed samples every rank agrees on; the last epoch waits for the finalized
        store."""
        return agree_view(self.reader, rank=self.rank, wait_final=epoch == self.cfg.epochs - 1,
                          share=self.share, watch=self.watch)

    def first_view(self) -> StoreView:
        if not self.cfg.follow:
            return view_of(self.reader)
        view = self.follow_view(0)
        while len(view.sample_ids) == 0:
            self.watch.check()
            time.sleep(1.0)
            view = self.follow_view(0)
        return view

    def steps_in(self, epoch: int, view: StoreView) -> list[list[list[int]]]:
        """The epoch's steps over the samples of `view` (held-out ones left out):
        [step][micro-batch][ids]."""
        cfg, r = self.cfg, self.reader
        ids, lens, bks = r.sample_ids, r.lengths(), r.buckets()
        # in follow mode the reader may hold more than the ranks agreed on
        keep = np.isin(ids, view.sample_ids)
        if self.held is not None:
            keep &= ~self.held
        nodes = self.world_size // self.local_world_size if cfg.node_affine else 1
        node_of = node_shares(r.home_shards()[keep], lens[keep], nodes) if nodes > 1 else None
        return plan_epoch(ids[keep], lens[keep], bks[keep], token_budget=cfg.token_budget,
                          seed=cfg.seed, epoch=epoch, ranks=self.world_size,
                          grad_accum=cfg.grad_accum, node_of=node_of, nodes=nodes)

    def steps_per_epoch(self) -> int:
        """Steps an epoch takes; in follow mode the first plan scaled by records expected / seen."""
        cfg, view = self.cfg, self.view
        n = len(self.steps_in(0, view))
        if n == 0 and view.finalized:  # else it would train 0 steps and say nothing was wrong
            raise ValueError(f"{cfg.store}: {len(self.reader)} samples make fewer micro-batches of "
                             f"--token-budget {cfg.token_budget} than one step needs "
                             f"({self.world_size} ranks x --grad-accum {cfg.grad_accum}); lower "
                             "the token budget or use fewer ranks")
        if not view.finalized:
            n = int(n * self.reader.manifest.dataset.num_records / max(1, len(view.sample_ids))) + 1
        return n

    def loader(self, epoch: int, first: int, view: StoreView):
        """This rank's micro-batches of an epoch from step `first` on: (the epoch's steps, a started
        iterator)."""
        cfg, ga = self.cfg, self.cfg.grad_accum
        steps = self.steps_in(epoch, view)
        micro = [mb for s in steps[first:] for mb in s[self.rank * ga:(self.rank + 1) * ga]]
        keys = [(first + i // ga) * self.world_size * ga + self.rank * ga + i % ga
                for i in range(len(micro))]
        # a store read by URL: this rank's shards of the epoch come now, in parallel, before the
        # workers fork
        self.reader.prefetch([s for mb in micro for s in mb])
        ds = BatchDataset(str(self.reader.root), micro, keys, self.collate, seed=cfg.seed,
                          epoch=epoch, remote=self.reader.url,
                          verify_shards=cfg.check_shards, verified_dir=self.verified_dir)
        workers = cfg.workers
        dl = torch.utils.data.DataLoader(ds, batch_size=None, shuffle=False, num_workers=workers,
                                         pin_memory=self.device.type == "cuda",
                                         prefetch_factor=4 if workers else None,
                                         persistent_workers=False,
                                         worker_init_fn=(self.preempt.worker_init if workers
                                                         else None))
        with self.preempt.forking():  # the workers fork here
            return steps, iter(dl)

    def holdout_set(self) -> tuple[BatchDataset | None, dict[str, torch.Tensor]]:
        """The held-out micro-batches of this rank (None without a held-out set) and, where its
        prompts are the evaluation's held-out ones, their sample ids per domain
        (train.start.domain_groups)."""
        if self.val_reader is None and self.held is None:
            return None, {}
        # --val-store: every sample of it
        r = self.reader if self.val_reader is None else self.val_reader
        held = self.held if self.val_reader is None else np.ones(len(r.sample_ids), dtype=bool)
        ds = replay_dataset(r, held, self.collate, token_budget=self.cfg.token_budget,
                            ranks=self.world_size, rank=self.rank, seed=self.cfg.seed,
                            verify_shards=self.cfg.check_shards)
        return ds, domain_groups(r, held)
