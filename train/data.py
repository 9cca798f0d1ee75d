"""Batches from the store: a pure plan of micro-batches per rank, and a Dataset that reads them.

The plan depends only on (sample lengths, buckets, token budget, seed, epoch, world shape), so
every rank computes the same plan without communicating, and a resumed run skips exactly the
micro-batches already trained. Anchors are drawn in the Dataset from a Generator seeded by
(seed, epoch, micro-batch index), so worker processes and resumes draw the same anchors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from cache_format import StoreReader
from cache_format.codec import dequantize
from train.anchors import IGNORE, build_blocks, sample_anchors
from train.replay import anchor_spans

__all__ = ["BatchDataset", "CollateSettings", "collate", "holdout_mask", "node_shares",
           "plan_epoch", "plan_holdout", "replay_dataset", "to_device"]


def _micro_batches(sample_ids: np.ndarray, lengths: np.ndarray, buckets: np.ndarray,
                   token_budget: int, g: np.random.Generator) -> list[list[int]]:
    """Micro-batches of one length bucket each, at most token_budget context tokens (count x
    longest), samples shuffled within their bucket, micro-batches shuffled."""
    micro: list[list[int]] = []
    for b in np.unique(buckets):
        sel = np.flatnonzero(buckets == b)
        sel = sel[g.permutation(len(sel))]
        cur, longest = [], 0
        for i in sel:
            n = int(lengths[i])
            if cur and (len(cur) + 1) * max(longest, n) > token_budget:
                micro.append(cur)
                cur, longest = [], 0
            cur.append(int(sample_ids[i]))
            longest = max(longest, n)
        if cur:
            micro.append(cur)
    return [micro[i] for i in g.permutation(len(micro))]


def plan_epoch(sample_ids: np.ndarray, lengths: np.ndarray, buckets: np.ndarray, *,
               token_budget: int, seed: int,
               epoch: int, ranks: int, grad_accum: int, node_of: np.ndarray | None = None,
               nodes: int = 1) -> list[list[list[int]]]:
    """Steps of one epoch: steps[s][r*grad_accum + a] = sample ids of micro-batch a of rank r.

    Each micro-batch comes from one length bucket and holds at most token_budget context tokens
    (count x longest). Micro-batch order is shuffled; the last partial step is dropped (its
    samples come first in another epoch's shuffle). With node_of (int [n]: the node whose share
    each sample is in, see node_shares) the ranks of node k (ranks k*ranks/nodes ..) draw only from
    share k, shuffled within it every epoch; the epoch ends with the share that runs out first.
    """
    g = np.random.default_rng([seed, epoch])
    # by id first: the plan depends on the set of samples, not on the order the index lists them
    # (which follows writer ids, i.e. how many writers stage one ran)
    order = np.argsort(sample_ids, kind="stable")
    sample_ids, lengths, buckets = sample_ids[order], lengths[order], buckets[order]
    if node_of is None:
        micro = _micro_batches(sample_ids, lengths, buckets, token_budget, g)
        per_step = ranks * grad_accum
        return [micro[i: i + per_step] for i in range(0, len(micro) - per_step + 1, per_step)]
    if ranks % nodes:
        raise ValueError(f"{ranks} ranks do not split over {nodes} nodes evenly")
    node_of = node_of[order]
    shares = [_micro_batches(sample_ids[node_of == k], lengths[node_of == k], buckets[node_of == k],
                             token_budget, g)
              for k in range(nodes)]
    per = ranks // nodes * grad_accum  # micro-batches a node takes per step
    n_steps = min(len(m) // per for m in shares)
    return [[mb for m in shares for mb in m[s * per:(s + 1) * per]] for s in range(n_steps)]


def node_shares(home: np.ndarray, lengths: np.ndarray, nodes: int) -> np.ndarray:
    """int [n]: the node whose share each sample is in. home (int64 [n]): the shard each sample
    starts in (StoreReader.home_shards). The shards, in order, are cut into `nodes` runs of about
    equal tokens (a shard goes to the run its middle token falls in): whole shards per node, and
    neighbouring shards on one node, as a sample that runs past its shard's end reads the next
    one."""
    codes, inverse = np.unique(home, return_inverse=True)
    tokens = np.bincount(inverse, weights=lengths, minlength=len(codes))
    middle = np.cumsum(tokens) - tokens / 2
    owner = np.minimum(nodes - 1, (middle * nodes / max(tokens.sum(), 1)).astype(np.int64))
    return owner[inverse]


def holdout_mask(sample_ids: np.ndarray, n: int, seed: int,
                 prompt_keys: np.ndarray | None = None) -> np.ndarray:
    """bool [len(sample_ids)]: True for the samples held out of training (a seeded choice).

    Without prompt keys: n samples, chosen by id. With them (int64 [len(sample_ids)], equal = one
    prompt): whole prompts in a seeded order until at least n samples are held out, so no response
    to a held-out prompt is trained on; the count overshoots n by less than one prompt's responses.
    Chosen from sorted ids/keys, so the same store and seed hold out the same samples whatever
    order the index lists them in.
    """
    if not 0 <= n < len(sample_ids):
        raise ValueError(f"cannot hold out {n} of {len(sample_ids)} samples: keep at least one for "
                         "training")
    rng = np.random.default_rng([seed, 7])
    mask = np.zeros(len(sample_ids), dtype=bool)
    if prompt_keys is None:
        order = np.argsort(sample_ids, kind="stable")
        mask[order[rng.permutation(len(order))[:n]]] = True
        return mask
    # keys sorted
    keys, inverse, counts = np.unique(prompt_keys, return_inverse=True, return_counts=True)
    perm = rng.permutation(len(keys))
    taken = np.cumsum(counts[perm])  # samples held out by the first 1, 2, ... prompts of the order
    # the shortest prefix holding >= n
    chosen = perm[: int(np.searchsorted(taken, n)) + 1] if n else perm[:0]
    mask[np.isin(inverse, chosen)] = True
    if mask.all():
        raise ValueError(f"cannot hold out {n} of {len(sample_ids)} samples by whole prompt "
                         f"({len(keys)} prompts): none would be left for training")
    return mask


def plan_holdout(sample_ids: np.ndarray, lengths: np.ndarray, buckets: np.ndarray, *,
                 token_budget: int, ranks: int, rank: int) -> list[list[int]]:
    """This rank's micro-batches of the held-out samples: every sample in exactly one rank's
    list."""
    micro = plan_epoch(sample_ids, lengths, buckets, token_budget=token_budget, seed=0, epoch=0,
                       ranks=1, grad_accum=1)
    return [s[0] for s in micro[rank::ranks]]


@dataclass(frozen=True, kw_only=True)
class CollateSettings:
    """How stored samples become a micro-batch: the same for every batch of a run (see collate)."""

    tap_index: tuple[int, ...]
    """Which of the stored taps the drafter reads, by position in the store's layer_ids."""
    num_stored_taps: int
    num_anchors: int
    block_size: int
    mask_token_id: int
    with_last_hidden: bool
    """Also collate the final hidden state (the KL loss's teacher) for every block slot."""


class BatchDataset(torch.utils.data.Dataset):
    """Item i = the collated micro-batch i of a list; the reader opens lazily in each worker."""

    def __init__(self, store: str, micro: list[list[int]], keys: list[int],
                 settings: CollateSettings, *, seed: int,
                 epoch: int, verify_shards: bool = False, remote: str = "",
                 verified_dir: str = "") -> None:
        """store: a store directory; remote: the URL it is the local copy of (shards fetched on
        use); verified_dir: where the run's readers mark the shards they checked (StoreReader)."""
        self.store, self.micro, self.keys, self.verify_shards = store, micro, keys, verify_shards
        self.remote, self.verified_dir = remote, verified_dir
        self.kw = {**dataclasses.asdict(settings), "tap_index": list(settings.tap_index)}
        self.seed, self.epoch = seed, epoch
        self._reader: StoreReader | None = None

    def __len__(self) -> int:
        return len(self.micro)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self._reader is None:
            self._reader = StoreReader(self.store, verify_shards=self.verify_shards,
                                       remote=self.remote, verified_dir=self.verified_dir)
        # a fixed mix of (seed, epoch, key): Python's hash() of ints is stable across processes
        mix = (self.seed * 1_000_003 + self.epoch) * 1_000_003 + self.keys[i]
        g = torch.Generator().manual_seed(mix)
        # a quantized store's states stay quantized until to_device: fewer bytes to pin and copy,
        # and the dequantization runs on the GPU, not in this worker (3/4 of its time on a CPU,
        # docs/benchmarks/)
        return collate(self._reader.get_batch(self.micro[i], quant_bits=True),
                       generator=g, **self.kw)


def replay_dataset(reader: StoreReader, rows: np.ndarray, settings: CollateSettings, *,
                   token_budget: int,
                   ranks: int, rank: int, seed: int, verify_shards: bool = False) -> BatchDataset:
    """This rank's micro-batches of `reader`'s samples where `rows` (bool [len(reader)]) is set,
    with an anchor at every response position, so decoding can be replayed along the stored
    responses (train.replay); the same blocks at every evaluation."""
    lengths = reader.lengths()[rows]
    micro = plan_holdout(reader.sample_ids[rows], lengths, reader.buckets()[rows],
                         token_budget=token_budget, ranks=ranks, rank=rank)
    every = dataclasses.replace(settings, num_anchors=int(lengths.max(initial=1)))
    return BatchDataset(str(reader.root), micro, list(range(len(micro))), every, seed=seed,
                        remote=reader.url, epoch=-1, verify_shards=verify_shards)


def collate(samples, *, tap_index: list[int], num_stored_taps: int, num_anchors: int,
            block_size: int, mask_token_id: int, generator: torch.Generator,
            with_last_hidden: bool) -> dict[str, torch.Tensor]:
    """Pad a micro-batch into the batch keys: "hidden" [b, T, K'*H] (the taps chosen by tap_index),
    "sample_id" [b], "anchors" [b, N] and "anchor_span" [b, N] (the response span of each anchor, -1
    for padding), "block_ids"/"block_pos"/"labels" [b, N*bs], "labelled" [n] (the flat indices of
    the labels that are not IGNORE, row-major), "ctx_len" [b], and with with_last_hidden
    "block_last_hidden" [b, N*bs, H] (the target's final state that teaches each slot).

    Samples read with quantized bits give "hidden" as the uint8 bits of the chosen taps and
    "hidden_scale" [b, T, K' x scales per tap] (fp8: float32, one per tap; mxfp4: uint8, one per 32
    values; padding 0); to_device dequantizes them.
    """
    b, t = len(samples), max(len(s.input_ids) for s in samples)
    # columns of one tap (bytes for mxfp4 bits)
    per_tap = samples[0].hidden.shape[1] // num_stored_taps
    quant = samples[0].hidden_scale is not None
    scale_per_tap = samples[0].hidden_scale.shape[1] // num_stored_taps if quant else 0
    per = []
    for s in samples:
        a = sample_anchors(s.loss_mask, num_anchors, generator)
        per.append((a, *build_blocks(s.input_ids, s.loss_mask, a, block_size, mask_token_id)))
    n = max(max(len(p[0]) for p in per), 1)
    hidden = torch.zeros(b, t, len(tap_index) * per_tap,
                         dtype=torch.uint8 if quant else torch.bfloat16)
    scales = torch.zeros(b, t, len(tap_index) * scale_per_tap,
                         dtype=samples[0].hidden_scale.dtype) if quant else None
    anchors = torch.full((b, n), -1, dtype=torch.long)
    spans = torch.full((b, n), -1, dtype=torch.long)
    ids = torch.full((b, n * block_size), mask_token_id, dtype=torch.long)
    pos = torch.zeros(b, n * block_size, dtype=torch.long)
    labels = torch.full((b, n * block_size), IGNORE, dtype=torch.long)
    hsz = samples[0].last_hidden.shape[1] if with_last_hidden else 0
    block_last = torch.zeros(b, n * block_size, hsz,
                             dtype=torch.bfloat16) if with_last_hidden else None
    for j, (s, (a, bi, bp, bl)) in enumerate(zip(samples, per)):
        L, m = len(s.input_ids), len(a) * block_size
        hidden[j, :L] = s.hidden.view(L, num_stored_taps, per_tap)[:, tap_index].reshape(L, -1)
        if scales is not None:
            scales[j, :L] = s.hidden_scale.view(L, num_stored_taps,
                                                scale_per_tap)[:, tap_index].reshape(L, -1)
        anchors[j, : len(a)] = a
        spans[j, : len(a)] = anchor_spans(s.loss_mask, a)
        ids[j, :m], pos[j, :m], labels[j, :m] = bi, bp, bl
        if block_last is not None and m:
            # slot k (token p+k) is taught by the target's final state at p+k-1
            block_last[j, :m] = s.last_hidden[(bp - 1).clamp(min=0, max=L - 1)]
    out = {"hidden": hidden, "ctx_len": torch.tensor([len(s.input_ids) for s in samples]),
           "anchors": anchors,
           "anchor_span": spans, "block_ids": ids, "block_pos": pos, "labels": labels,
           "sample_id": torch.tensor([s.sample_id for s in samples], dtype=torch.long),
           # found here, on the host: the loss gathers its rows by them with no read-back
           "labelled": torch.nonzero(labels.flatten() != IGNORE).squeeze(1)}
    if block_last is not None:
        out["block_last_hidden"] = block_last
    if scales is not None:
        out["hidden_scale"] = scales
    return out


def to_device(batch: dict[str, torch.Tensor], device: torch.device,
              copy_stream: torch.cuda.Stream | None = None) -> dict[str, torch.Tensor]:
    """A (pinned) host batch on `device`; on a GPU the copy runs on `copy_stream`.

    The training loop enqueues its steps ahead of the GPU. A copy on the compute stream waits behind
    the step before it (~170 MB of hidden states per 4096 tokens at the 8B shape, milliseconds). On
    a side stream it overlaps that step, and the compute stream waits only for the copy itself.
    Quantized hidden states ("hidden_scale" present) are dequantized to bf16 there too, after their
    copy.
    """
    if copy_stream is None:
        return _dequantized({k: v.to(device, non_blocking=True) for k, v in batch.items()})
    compute = torch.cuda.current_stream(device)
    with torch.cuda.stream(copy_stream):
        out = _dequantized({k: v.to(device, non_blocking=True) for k, v in batch.items()})
    compute.wait_stream(copy_stream)
    for v in out.values():
        # allocated on the copy stream, used on the compute stream: not freed early
        v.record_stream(compute)
    return out


def _dequantized(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Quantized hidden states and their scales -> bf16 "hidden" [b, T, K'*H], what the host reader
    would give."""
    if "hidden_scale" not in batch:
        return batch
    scale = batch.pop("hidden_scale")
    batch["hidden"] = dequantize(batch["hidden"], scale, torch.bfloat16)
    return batch
