"""One training step's pieces: the loss settings (built once per run), forward and backward of a
micro-batch, the held-out evaluation, the optimizer and its schedule, and the running sums a
metrics row is made of (named, all-reduced together)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from train.anchors import IGNORE, previous_tokens
from train.attention import SplitMask
from train.data import BatchDataset, to_device
from train.losses import LossOut, Weighting, acceptance_from_acc, draft_loss
from train.masks import (
    FLEX_KERNELS,
    FLEX_TILE,
    FlexMask,
    dense_context_mask,
    dense_mask,
    flex_block_mask,
    flex_context_mask,
)
from train.model import DFlashDrafter
from train.replay import decode_visits, replay_counts, tree_accepts, visited_tree_accepts
from train.shapes import distinct_sizes, padded_model_inputs

__all__ = ["LossSettings", "StepStats", "evaluate_holdout", "fitted_steps", "forward_backward",
           "forward_loss", "lr_lambda", "make_optimizer"]


@dataclass(frozen=True, kw_only=True)
class LossSettings:
    """How a micro-batch becomes a loss: the same for every step of a run."""

    block_size: int
    gamma: float
    """Position decay of the loss weights exp(-(k-1)/gamma)."""
    kl_weight: float = 0.0
    """Share of the divergence from the stored teacher (0: CE on the target's tokens only)."""
    divergence: str = "kl"
    """kl (forward KL) or tv (total variation): the soft term train.losses.draft_loss adds."""
    confidence_penalty: float = 0.0
    """Weight of the drafter's entropy subtracted from each row's loss (0: none)."""
    use_flex: bool = False
    """FlexAttention block mask (GPU), else a dense boolean mask."""
    chunk: int = 2048
    """Draft positions per lm_head + loss chunk."""
    backward: str = "fused"
    """fused, recompute or keep: how the lm_head chunks get their gradients."""
    compiled: bool = False
    """The per-chunk softmax and gradient compiled (with --compile)."""
    ce_kernel: str = "torch"
    """torch (ours) or liger (Liger's kernel): the fused path's per-chunk softmax and gradient."""
    split_blocks: bool = False
    """Attend to the context and to the own block apart and merge them (train.attention), so the
    attention kernels visit no tile of the blocks' keys."""
    context_tile: int = 1
    """Pad the context with hidden keys to a multiple of this many tokens, so the draft blocks start
    on a FlexAttention tile: 0 = mask_tile with use_flex, none without; 1 = never (default)."""
    residual: str = "float32"
    """The drafter's residual stream under autocast: float32 (the weights') or bfloat16 (half the
    bytes its elementwise kernels move; not exact)."""
    flex_kernel: str = "default"
    """FlexAttention's kernel tiles: inductor's defaults, or "tuned" (train.masks.FLEX_KERNELS)."""
    mask_tile: int = FLEX_TILE
    """FlexAttention's BlockMask tile (query rows x keys taken or skipped as one): a smaller tile
    skips more of the mostly hidden tiles at the blocks' diagonal, at smaller kernel tiles."""
    weighting: Weighting = Weighting()
    """The rows' loss weights: the fixed decay, or decode-aware ones from the step's own hits."""
    pad_shapes: bool = False
    """Give the drafter at least 2 rows and 2 query tiles, traced with distinct sizes
    (train.shapes), so a compiled drafter meets no size-1 dimension nor a parting of equal sizes,
    each of which would compile it again mid-run."""


def forward_loss(model, batch: dict[str, torch.Tensor], loss: LossSettings, *, replay: bool = False,
                 tree_budgets: tuple[int, ...] = (), training_graph: bool = False) -> LossOut:
    """One micro-batch (already on the device): drafter forward and chunked loss (bf16 autocast on
    GPU); with `replay`, also the accepted drafts per block (LossOut "accepts"); for each of
    `tree_budgets`, also those of a draft tree of that many nodes ("tree_accepts": budget -> [b, N],
    train.replay.tree_accepts), from the same forward.

    training_graph: the drafter runs with autograd on even under no_grad, and its output is
    detached. torch.compile guards on the grad mode, so a no_grad forward of a compiled drafter
    compiles it a second time; this one reuses the graph the steps run."""
    taps = batch["hidden"]  # [b, T, K*H]: the tapped layers' states
    tile = loss.context_tile or (loss.mask_tile if loss.use_flex else 1)
    # keys past the last anchor are never seen, so padding the context changes nothing but where the
    # blocks' keys start: on a tile boundary each 128-row query tile (16 blocks of 8) meets its own
    # blocks in one kv tile instead of two, a quarter fewer tiles for the attention kernels to visit
    if taps.shape[1] % tile:
        taps = F.pad(taps, (0, 0, 0, -taps.shape[1] % tile))  # [b, T', K*H], T' a multiple of tile
    b, q = batch["block_ids"].shape
    ids, pos, anchors = batch["block_ids"], batch["block_pos"], batch["anchors"]
    if loss.pad_shapes:  # [b', T', K*H], [b', Q'] x 2, [b', N']: no size-1 dimension (train.shapes)
        taps, ids, pos, anchors = padded_model_inputs(
            taps, ids, pos, anchors, block_size=loss.block_size, tile=loss.mask_tile)
    t = taps.shape[1]
    ctx_pos = torch.arange(t, device=taps.device)[None].expand(taps.shape[0], t)
    mask = _attention_mask(anchors, t, loss)
    core = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    with torch.autocast(taps.device.type, dtype=torch.bfloat16, enabled=taps.device.type == "cuda"):
        residual = getattr(torch, loss.residual) if loss.residual != "float32" else None
        grad = torch.enable_grad() if training_graph else contextlib.nullcontext()
        with grad, distinct_sizes(loss.pad_shapes):  # [b, Q, H]: the real rows and anchors only
            hidden = model(taps, ctx_pos, ids, pos, mask, residual)[:b, :q]
        if training_graph:  # frees what autograd kept for a backward that never comes
            hidden = hidden.detach()
        labels = core.labels(batch["labels"], IGNORE)  # [b, Q] lm_head rows
        mh, head_terms = core.markov_head, {}
        # each slot's true previous token, embedded: teacher forcing (train.markov_head)
        if mh is not None:
            # [b, Q] target ids
            prev = previous_tokens(batch["block_ids"], batch["labels"], loss.block_size)
            head_terms = {"bias_rows": mh.markov_w1(prev), "bias_head": mh.markov_w2.weight}
        out = draft_loss(hidden, labels, core.lm_head, block_size=loss.block_size, gamma=loss.gamma,
                         teacher=batch.get("block_last_hidden"), kl_weight=loss.kl_weight,
                         divergence=loss.divergence, confidence_penalty=loss.confidence_penalty,
                         chunk=loss.chunk, backward=loss.backward, compiled=loss.compiled,
                         ce_kernel=loss.ce_kernel,
                         weighting=loss.weighting,
                         anchors=batch["anchors"], spans=batch.get("anchor_span"), replay=replay,
                         labelled=batch.get("labelled"), **head_terms)
        if tree_budgets:
            out["tree_accepts"] = _tree_replays(core, hidden.detach(), labels, batch,
                                                loss.block_size, tree_budgets)
        return out


def _attention_mask(anchors: torch.Tensor, t: int, loss: LossSettings):
    """The drafter's attention mask for anchors [b, N] over a context of t keys, as `loss` says:
    split (context apart from the own blocks), a FlexAttention BlockMask, or dense bool."""
    if loss.split_blocks:
        context = flex_context_mask(anchors, t, loss.block_size, loss.mask_tile) \
            if loss.use_flex else dense_context_mask(anchors, t, loss.block_size)
        return SplitMask(context, loss.block_size)
    if not loss.use_flex:
        return dense_mask(anchors, t, loss.block_size)
    mask = flex_block_mask(anchors, t, loss.block_size, loss.mask_tile)
    options = FLEX_KERNELS[loss.flex_kernel]
    # inductor's own tiles take the bare mask
    return mask if options is None else FlexMask(mask, options)


def _tree_replays(core, hidden: torch.Tensor, labels: torch.Tensor, batch: dict[str, torch.Tensor],
                  block_size: int, budgets: tuple[int, ...]) -> dict[int, torch.Tensor]:
    """forward_loss's tree_accepts, budget -> [b, N]. With a dependence head only the blocks
    decoding visits get trees (train.replay.visited_tree_accepts: its trees score each kept
    prefix's children over the whole vocabulary); plain trees are cheap, all in one batched pass."""
    mh = core.markov_head
    kw = {"block_size": block_size, "head": mh, "roots": batch["block_ids"],
          "draft_ids": core.draft_ids if core.c.draft_vocab_size else None}
    if mh is None:
        return {n: tree_accepts(hidden, labels, core.lm_head, budget=n, **kw) for n in budgets}
    return {n: visited_tree_accepts(hidden, labels, core.lm_head, batch["anchors"],
                                    batch["anchor_span"], budget=n, **kw) for n in budgets}


def forward_backward(model, batch: dict[str, torch.Tensor], loss: LossSettings,
                     grad_scale: float = 1.0) -> LossOut:
    """forward_loss, then backward of loss x grad_scale."""
    out = forward_loss(model, batch, loss)
    (out["loss"] * grad_scale).backward()
    return out


# val_decode_tau_96: decoding replayed over each answer's first 96 new tokens only, the length the
# goal's evaluation decodes (scripts/scale_run.sh eval); whole answers of a small target end in
# loops that any drafter follows, so the whole-answer figure reads well above the evaluation's.
DECODE_WINDOW = 96


def _replay_sums(stats: StepStats, prefix: str, walk: tuple, groups: dict[str, torch.Tensor],
                 sample_ids: torch.Tensor) -> None:
    """Add one micro-batch's replayed decoding, whole answers and the window (and the window per
    group), to stats.sums under `prefix` (walk: anchors, accepts, spans [b, N])."""
    visits = decode_visits(*walk)  # [b, N]: shared by the whole answers and the window
    for key, window in (("replay", 0), ("window", DECODE_WINDOW)):
        tokens, forwards = replay_counts(*walk, window=window, visits=visits)
        stats.add_sum(f"{prefix}{key}_tokens", tokens)
        stats.add_sum(f"{prefix}{key}_forwards", forwards)
    for g, ids in groups.items():
        rows = torch.isin(sample_ids, ids)  # [b]: this group's answers of the micro-batch
        tokens, forwards = replay_counts(*(t[rows] for t in walk), window=DECODE_WINDOW,
                                         visits=visits[rows])
        stats.add_sum(f"{prefix}{g}:tokens", tokens)
        stats.add_sum(f"{prefix}{g}:forwards", forwards)


def _tau_keys(s: _Reduced, prefix: str, name: str, groups) -> dict[str, Any]:
    """val_{name}, val_{name}_96 (and _by_domain) from the sums under `prefix`."""
    ratio = lambda t, f: float(s[prefix + t] / s[prefix + f].clamp(min=1))  # noqa: E731
    row = {f"val_{name}": ratio("replay_tokens", "replay_forwards"),
           f"val_{name}_{DECODE_WINDOW}": ratio("window_tokens", "window_forwards")}
    if groups:
        row[f"val_{name}_{DECODE_WINDOW}_by_domain"] = {g: ratio(f"{g}:tokens", f"{g}:forwards")
                                                        for g in groups}
    return row


@torch.no_grad()
def evaluate_holdout(model: DFlashDrafter, ds: BatchDataset, device: torch.device, *, world: int,
                     loss: LossSettings, groups: dict[str, torch.Tensor] | None = None,
                     tree_budgets: tuple[int, ...] = (), limit: int = 0,
                     training_graph: bool = False) -> dict[str, Any]:
    """Over the held-out micro-batches (the first `limit`, 0: all; all ranks; an anchor at every
    response position): the teacher-forced loss, per-slot accuracy and sim_tau, and
    val_decode_tau, speculative decoding replayed along the stored responses
    (train.replay.replay_counts), whole and over the first DECODE_WINDOW tokens of each answer. The
    loss is the plain decayed one whatever the run trains with, so runs with other weightings
    compare.

    groups: name -> int64 sample ids (e.g. the held-out prompts' domains); the window's τ is also
    given per group, as val_decode_tau_96_by_domain (the same names on every rank).
    tree_budgets: the same for decoding that verifies a draft tree of that many nodes per step
    (train.replay.tree_accepts), from the same forwards: the first budget's as val_tree_budget,
    val_tree_tau, val_tree_tau_96 (and _by_domain); with several, every budget's in
    val_tree_curve.
    training_graph: forward_loss's, for a drafter compiled for its steps (an eager one gains nothing
    from it and would keep autograd's tensors for the forward's length)."""
    model.eval()
    # no backward here
    plain = dataclasses.replace(loss, backward="fused", compiled=False, weighting=Weighting())
    stats = StepStats(loss.block_size, device)
    groups = {g: ids.to(device) for g, ids in (groups or {}).items()}
    prefixes = ("", *(f"tree{n}:" for n in tree_budgets))
    # before any batch, so every rank's sums hold the same names in the same order
    for p in prefixes:
        for name in ("replay_tokens", "replay_forwards", "window_tokens", "window_forwards",
                     *(f"{g}:{n}" for g in groups for n in ("tokens", "forwards"))):
            stats.add_sum(p + name, 0)
    for i in range(min(limit, len(ds)) if limit else len(ds)):
        batch = to_device(ds[i], device)
        out = forward_loss(model, batch, plain, replay=True, tree_budgets=tree_budgets,
                           training_graph=training_graph)
        stats.add(out, batch, by_weight=True)
        for p, accepts in zip(prefixes, (out["accepts"], *out.get("tree_accepts", {}).values())):
            _replay_sums(stats, p, (batch["anchors"], accepts, batch["anchor_span"]), groups,
                         batch["sample_id"])
    s = stats.reduced(world)
    model.train()
    acc = s.acc()
    row = {"val_loss": float(s["loss"] / s["weight"].clamp(min=1e-12)), "val_acc": acc,
           "val_sim_tau": acceptance_from_acc(acc), **_tau_keys(s, "", "decode_tau", groups)}
    curve = {str(n): _tau_keys(s, f"tree{n}:", "tree_tau", groups) for n in tree_budgets}
    if tree_budgets:
        row.update({"val_tree_budget": tree_budgets[0], **curve[str(tree_budgets[0])]})
    if len(tree_budgets) > 1:
        row["val_tree_curve"] = curve
    return row


def make_optimizer(model: DFlashDrafter, *, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; on a GPU the fused kernel (one launch for all tensors:
    the foreach update was 5.8% of an eager 8B-shaped step's CUDA time, docs/benchmarks/)."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = all(p.is_cuda for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95),
                             fused=fused or None)


def lr_lambda(total: int, warmup: float):
    """Linear warmup over `warmup` of the steps, then cosine to 0 at step `total`."""
    w = max(1, int(total * warmup))

    def f(step: int) -> float:
        if step < w:
            return (step + 1) / w
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - w) / max(1, total - w))))
    return f


def fitted_steps(step: int, seconds_left: float, step_s: float, *, pause_s: float = 0.0,
                 pause_every: int = 0, cap: int) -> int:
    """The steps a run can plan when `seconds_left` remain after `step` (--schedule-seconds): those
    done plus the most r that fit, at `step_s` a step and a held-out pass of `pause_s` after every
    multiple of `pause_every` (0: none) reached, capped by `cap`; never fewer than `step`."""
    if step_s <= 0:
        raise ValueError(f"a step takes a positive time, got {step_s}")

    def cost(r: int) -> float:  # seconds of the next r steps and the passes they reach
        passes = (step + r) // pause_every - step // pause_every if pause_every else 0
        return r * step_s + passes * pause_s

    lo, hi = 0, max(0, cap - step)  # the largest r in [lo, hi] with cost(r) <= seconds_left
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if cost(mid) <= seconds_left else (lo, mid - 1)
    return max(step, min(cap, step + lo))


class _Reduced(dict):
    """StepStats.reduced(): the all-reduced sums by name."""

    def acc(self) -> list[float]:
        """Accuracy per block slot after the anchor (slot 0 is the anchor itself)."""
        return (self["correct"] / self["count"].clamp(min=1)).tolist()[1:]


class StepStats:
    """Sums since the last metrics row, kept on the device (no host sync per step) and
    all-reduced together by name: correct/count per block slot, loss (and its weight),
    micro-batches, supervised positions, and the seconds spent waiting for data."""

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size, self.device = block_size, device
        self.reset()

    def reset(self) -> None:
        z = lambda *n: torch.zeros(*n, device=self.device)  # noqa: E731
        self.sums = {"correct": z(self.block_size), "count": z(self.block_size), "loss": z(1),
                     "weight": z(1), "positions": z(1)}
        self.micro_batches, self.wait = 0, 0.0
        # the start of the row's time (validation and checkpoints are left out)
        self.since = time.time()

    def add(self, out: LossOut, batch: dict[str, torch.Tensor], *, by_weight: bool = False) -> None:
        """One micro-batch's loss output: its loss as is (training rows: a mean over micro-batches)
        or weighted by its loss weight (held-out: a mean over positions)."""
        s = self.sums
        s["correct"] += out["correct"]
        s["count"] += out["count"]
        w = out["weight_sum"].float() if by_weight else 1.0
        s["loss"] += out["loss"].detach().float() * w
        s["weight"] += w
        s["positions"] += (batch["labels"] != IGNORE).sum()
        self.micro_batches += 1

    def add_sum(self, name: str, value) -> None:
        """Add to a named scalar sum, made at its first use (held-out decoding's tokens and
        forwards)."""
        if name not in self.sums:
            self.sums[name] = torch.zeros(1, device=self.device)
        self.sums[name] += value

    def pause(self, seconds: float) -> None:
        """Leave `seconds` (a validation, a checkpoint) out of the row's rates."""
        self.since += seconds

    def reduced(self, world: int) -> _Reduced:
        named = {**self.sums, "wait": torch.tensor([self.wait], device=self.device)}
        flat = torch.cat([v.reshape(-1).float() for v in named.values()])
        if world > 1:
            dist.all_reduce(flat)
        out, i = _Reduced(), 0
        for k, v in named.items():
            n = v.numel()
            out[k] = flat[i:i + n] if n > 1 else flat[i]
            i += n
        return out
