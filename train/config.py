"""TrainConfig: every knob of stage two; the CLI maps onto it 1:1 and it is saved with
checkpoints."""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import Any

from runtime.numbers import check_numbers

__all__ = ["TrainConfig"]


# How the chunked lm_head + loss makes its gradients (train.losses.draft_loss).
LOSS_BACKWARDS = ("fused", "recompute", "keep")
# The dtype DDP all-reduces gradients in (train.data_parallel).
GRAD_REDUCES = ("fp32", "bf16")
# Per-slot loss weights (train.losses.Weighting): the fixed decay, or each slot's share of the
# batch's acceptance.
POSITION_WEIGHTS = ("decay", "reach")
# The soft-label term of --loss kl and mix (train.losses): forward KL, or total variation.
DIVERGENCES = ("kl", "tv")
# torch.compile modes for the drafter layers (train.model.DFlashDrafter.compile_layers); CUDA
# graphs are left out: the layers' shapes change with every batch's context length.
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
# What --compile compiles (train.model.DFlashDrafter.compile_layers): each layer, or the whole
# training forward.
COMPILE_SCOPES = ("layers", "model")
# The fused loss's per-chunk softmax and gradient (train.losses): ours, or Liger's kernel
# (train.liger_ce).
CE_KERNELS = ("torch", "liger")
# FlexAttention kernel options by name (train.masks.FLEX_KERNELS holds them).
FLEX_KERNEL_NAMES = ("default", "tuned")
# The drafter's residual stream under autocast (train.model.DFlashDrafter.draft).
RESIDUAL_DTYPES = ("float32", "bfloat16")
# FlexAttention BlockMask tiles (train.masks): inductor's one default kernel takes 128-row tiles, so
# a smaller one needs the autotuned modes. Their kernels need the tile to be a multiple of their own
# BLOCK_M and BLOCK_N, which a 32-row tile is not (torch 2.11 refuses it while lowering on a GPU).
MASK_TILES = (64, 128)

@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    # ------------------------------------------------------------------ the store and the run
    store: str
    """The draftcache store to train from (the target is never loaded)."""
    out: str
    """Run directory: metrics.jsonl, plots, checkpoints/."""
    cache_dir: str = ""
    """For a store read by URL (s3://...): the local directory its metadata and fetched shards go
    under (default: $DRAFTCACHE_STORE_CACHE, else ~/.cache/draftcache/stores); one per node."""
    workers: int = 2
    """DataLoader worker processes per rank (0 = read in the training process)."""
    verify_shards: str = "on"
    """Check each data shard's checksums the first time this run reads it on a node: on (default),
    off, or auto (on only with follow, where the store may still change). A store read by URL is
    checked whatever this says (every fetched shard is).
    A mismatch stops training with one line naming shard and array. A checked shard leaves a
    marker in out/.verified-shards/HOST, so later epochs and workers do not read it again; on the
    100K-sample store on an H200 the first epoch (every shard checked) trained at 100.0% of the
    second's rate (docs/BENCHMARKS.md)."""
    follow: bool = False
    """Train while stage one is still writing; the last epoch waits for the store to be
    finalized."""
    follow_timeout: float = 300.0
    """With --follow: seconds to keep waiting once the store's writer is known to be gone (its pid
    on this host no longer runs) and the store is not finalized; then stop with one line (0 = wait
    forever)."""
    node_affine: bool = False
    """Several nodes: each node's ranks train on a fixed share of the store's shards (whole shards,
    balanced by tokens), reshuffled within the share every epoch, so a node reading a store by URL
    fetches and caches its share, 1/nodes of the store, instead of all of it over the epochs. Every
    step still draws from every share. One node: no effect. Not with follow (the shares would
    move)."""
    # ------------------------------------------------------------------ the drafter
    num_layers: int = 1
    """Drafter depth D (DFlash uses 5; 1 trains fast on CPU)."""
    layers: tuple[int, ...] = ()
    """Subset of the store's layer ids the drafter reads (empty = all)."""
    block_size: int = 16
    """Tokens per draft block (anchor + block_size - 1 drafted)."""
    intermediate_size: int = 0
    """Drafter MLP width; 0 = the target's."""
    draft_vocab: int = 0
    """Tokens the drafter may propose: the N most frequent answer tokens of the store's training
    samples (0 = the target's whole vocabulary). The lm_head and the loss's softmax then cost N/V of
    theirs; a token outside can never be drafted (the run logs the share of answer tokens
    inside)."""
    markov_rank: int = 0
    """A Markov dependence head over the block (DSpark's, train.markov_head) of this rank: each
    slot's logits get a bias read from the token before it, so drafting is sequential over the
    block's slots and a draft tree scores each child after its parent's token; 0 = none (independent
    slots)."""
    mask_token_id: int = -1
    """Embedding row used as MASK; -1 = the store's (a row the target never emits: its first
    vocabulary padding row, else an unused special token; see target.loader.choose_mask_token)."""
    init_from: str = ""
    """An exported drafter (train.export's directory) whose weights start this run, with a fresh
    optimizer and schedule: to go on training it on new data or on another machine. Its shape, taps
    and mask token must be this run's. A --resume that finds a checkpoint takes that instead."""
    init_layers: tuple[int, ...] = ()
    """Target decoder layers (kept in the store by extract --keep-layers) whose weights start the
    drafter's layers, one id per drafter layer, and the target's final norm its own; empty = random
    layers. The context projection (fc) starts random either way."""
    # ------------------------------------------------------------------ the loss
    num_anchors: int = 512
    """Anchors per sequence, capped by its valid positions; resampled every epoch."""
    gamma: float = 0.0
    """Loss decay exp(-(k-1)/gamma); 0 = 7 for block 16, 5 for 10, 4 for 8."""
    loss: str = "ce"
    """ce, kl (a divergence from the target's distribution, read from the stored final state: see
    divergence) or mix (CE and that divergence)."""
    kl_weight: float = 0.5
    """Weight of the divergence in mix (CE gets 1 - kl_weight)."""
    divergence: str = "kl"
    """The soft term of kl and mix: kl (forward KL(target || drafter)) or tv (total variation,
    0.5 * sum |target - drafter|: one minus the chance that a draft token sampled from the drafter
    is accepted when verification samples from the target)."""
    confidence_penalty: float = 0.0
    """Subtract this times the drafter's entropy from every slot's loss (the confidence penalty of
    Pereyra et al. 2017): a drafter less sure of its first choice leaves its runners-up the
    probability a draft tree's best-first expansion ranks siblings by; 0 = none."""
    position_weights: str = "decay"
    """Loss weight of block slot k: decay (exp(-(k-1)/gamma), DFlash Eq. 4) or reach (the tokens
    decoding accepts at slot k or later, measured on the step's own predictions: train.replay)."""
    visit_weight: float = 0.0
    """Extra loss weight of the blocks whose anchors speculative decoding with the current drafter
    would visit (the positions right after a rejection), found from the step's own predictions
    (train.replay); 0 = every anchor alike."""
    # ------------------------------------------------------------------ schedule and optimizer
    epochs: int = 6
    """Passes over the store (the cosine spans them unless max_steps is set)."""
    max_steps: int = 0
    """Stop after this many optimizer steps (0 = run all epochs)."""
    time_limit: float = 0.0
    """Seconds this process may train (0 = no limit): the run stops at the last --log-every step
    whose closing held-out pass and checkpoint (timed as the longest so far, a resumed run's from
    its checkpoint; the first held-out micro-batch runs before the first step, so what a first
    pass pays once is not taken for a pass's cost) still end within it, and exits 0; --resume
    continues it (for job schedulers' time limits)."""
    schedule_seconds: float = 0.0
    """Fit the cosine to this many seconds of this process, compilation and held-out passes
    included (0 = by steps): at every --log-every row the run's steps are planned anew as those
    done plus what fits in the seconds left at the step rate so far (at most --max-steps or the
    epochs' steps), and the run ends there with its cosine at 0. Until the second row (the first
    one's steps hold the compilation) the schedule is that cap's: set --max-steps near the steps
    expected. Stands for --time-limit when that is 0; a resumed run fits the rest of its cosine
    into its own seconds, on its checkpoint's plan until its second row (a run made in several
    calls: the first plans the whole, cut by --time-limit)."""
    token_budget: int = 8192
    """Context tokens per micro-batch (batch size x longest sample)."""
    grad_accum: int = 1
    """Micro-batches per rank per optimizer step."""
    lr: float = 6e-4
    """Peak AdamW learning rate (cosine decay after the warmup)."""
    warmup: float = 0.04
    """Fraction of steps of linear warmup before cosine decay."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    clip: float = 1.0
    """Gradient-norm clip."""
    seed: int = 0
    """Seed of the weights' init, the anchors and the batch order."""
    # ------------------------------------------------------------------ held-out evaluation
    val_samples: int = 0
    """Samples held out of training (a seeded choice; whole prompts when the store has prompt keys,
    so at least this many). Every val_every steps their teacher-forced loss, acc and sim_tau (an
    anchor at every response position) are logged as val_*, and val_decode_tau: speculative
    decoding replayed along the stored responses (train.replay); the best val_decode_tau's weights
    are kept."""
    val_store: str = ""
    """A store (path or URL) of the same target and tapped layers whose every sample is held out:
    the held-out evaluations read it instead of val_samples of the training store. For prompts in
    the format the drafter will be served, answered by the target and kept out of the training data
    (`scripts/scale_run.sh valstore` makes one from the evaluation's spare held-out prompts)."""
    val_every: int = 100
    """Steps between held-out evaluations (and one at the end)."""
    patience: int = 0
    """Stop once this many held-out evaluations in a row bring no new best val_decode_tau (0 =
    never); needs val_samples or val_store. The best weights are kept either way
    (checkpoints/best-STEP)."""
    val_tree_budget: int = 0
    """Also replay tree decoding at each held-out evaluation: a draft tree of this many nodes per
    step (train.draft_tree, as `train.eval --tree-budget` decodes), logged as val_tree_tau and
    val_tree_tau_96. The best checkpoint (and patience) then go by val_tree_tau_96. 0 = the chain
    only."""
    # ------------------------------------------------------------------ checkpoints and logs
    log_every: int = 10
    """Metrics line every N steps."""
    checkpoint_every: int = 0
    """Checkpoint every N steps (0 = only at the end)."""
    keep_checkpoints: int = 3
    """step-N checkpoints kept (older ones are deleted; best-N is kept apart)."""
    resume: bool = False
    """Continue from the newest checkpoint in out/checkpoints."""
    resume_from: str = ""
    """With --resume: continue from this checkpoint directory instead of the newest step-N (an
    earlier good one, when the newest is damaged); the later step-N of the run are set aside
    (step-N.superseded)."""
    tensorboard: bool = False
    """Also write the metric rows as TensorBoard event files under out/tensorboard."""
    wandb: bool = False
    """Also log the metric rows to Weights & Biases (needs the wandb package)."""
    # ------------------------------------------------------------------ speed (same training)
    attention: str = "auto"
    """auto (flex on GPU, dense SDPA on CPU), flex, or sdpa."""
    split_blocks: bool = False
    """Attend to the context and to each draft block's own keys apart and merge the two by their
    log-sum-exps (train.attention): the same attention, with no kernel tile spent on the blocks'
    keys."""
    context_tile: int = 1
    """Pad the context with keys no query sees to a multiple of this many tokens, so the draft
    blocks' keys start on a FlexAttention tile (fewer tiles visited): 1 never pads (default: the
    path the preset's figures were measured on), 0 pads to FlexAttention's 128-token tile when it
    runs. Exact (tests/train/test_step.py); the H200 preset pads
    (docs/benchmarks/2026-12-05_step-levers_h200.md)."""
    compile_scope: str = "layers"
    """What --compile compiles of the drafter: each layer (default), or the whole training
    forward as one graph, the context's projection, norms and RoPE and the final norm included."""
    residual_dtype: str = "float32"
    """The drafter's residual stream under the GPU's bf16 autocast: float32 (the weights', default)
    or bfloat16 (half the bytes of the elementwise kernels around the layers; changes the numerics,
    so it is judged by τ at equal steps as well as by speed). No effect on a CPU."""
    flex_kernel: str = "default"
    """FlexAttention's kernel tiles: default (inductor's) or tuned (what max-autotune picked for the
    H200 preset's step, without its minutes of autotuning: train.masks.FLEX_KERNELS)."""
    mask_tile: int = 128
    """FlexAttention's BlockMask tile, 64 or 128 (default): a smaller one skips more of the
    mostly hidden tiles around the draft blocks (exact); below 128 it needs a max-autotune
    --compile-mode, whose kernels come in the smaller tiles."""
    compile: bool = False
    """torch.compile the drafter layers and the fused loss's per-chunk softmax and gradient
    (GPU)."""
    compile_mode: str = "default"
    """The drafter layers' torch.compile mode: default, or max-autotune-no-cudagraphs (inductor
    times its candidate kernels, FlexAttention's tile sizes among them, for each new shape: a
    longer first compile for a possibly faster step; bench train --compile-mode compares them)."""
    loss_chunk: int = 2048
    """Draft positions per lm_head + loss chunk (logits exist for one chunk at a time)."""
    ce_kernel: str = "torch"
    """The fused loss's per-chunk softmax and gradient: torch (ours; compiled with --compile) or
    liger (Liger's Triton kernel, `pip install 'draftcache[liger]'`; plain CE on a GPU:
    train.liger_ce)."""
    loss_backward: str = "fused"
    """How the lm_head chunks get their gradients: fused (formed in the forward pass; no logits
    kept, no extra matmul; with --markov-rank it keeps every chunk's logit gradient for the head's
    W2, the size of all rows' logits), recompute (checkpointed: logits rebuilt in backward, one more
    lm_head matmul, one chunk's memory), keep (every chunk's logits stay alive until backward)."""
    grad_reduce: str = "fp32"
    """dtype of DDP's gradient all-reduce: fp32, or bf16 (half the bytes on the wire; gradients are
    rounded to bf16 and summed in bf16). One rank: no effect."""

    def __post_init__(self) -> None:
        # every number finite and >= 0; the ranges below
        check_numbers(self, negative_ok=("mask_token_id",))
        if not self.store or not self.out:
            raise ValueError("store and out are required")
        if any(layer < 0 for layer in self.layers) or len(set(self.layers)) != len(self.layers):
            raise ValueError(f"layer ids must be distinct and >= 0, got {list(self.layers)}")
        if self.init_layers and (len(self.init_layers) != self.num_layers
                                 or min(self.init_layers) < 0):
            raise ValueError(f"init_layers needs one layer id >= 0 per drafter layer "
                             f"({self.num_layers}), got {list(self.init_layers)}")
        if self.init_layers and self.init_from:
            raise ValueError("init_layers and init_from both start the drafter's weights: give one")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.num_layers < 1 or self.num_anchors < 1 or self.epochs < 1:
            raise ValueError("num_layers, num_anchors and epochs must be >= 1")
        if self.kl_weight > 1:
            raise ValueError(f"kl_weight must be in [0, 1], got {self.kl_weight}")
        if self.lr == 0 or self.warmup >= 1 or self.clip == 0:  # finite and >= 0: check_numbers
            raise ValueError(f"lr and clip must be finite and > 0 and warmup in [0, 1), got lr "
                             f"{self.lr}, clip {self.clip}, warmup {self.warmup}")
        if self.resume_from and not self.resume:
            raise ValueError("resume_from names the checkpoint a --resume continues from: pass "
                             "--resume too")
        if self.keep_checkpoints < 1:
            raise ValueError("keep_checkpoints must be >= 1 (0 would keep no checkpoint), got "
                             f"{self.keep_checkpoints}")
        if self.loss_chunk < 1:
            raise ValueError(f"loss_chunk must be >= 1, got {self.loss_chunk}")
        if self.val_every < 1:
            raise ValueError(f"val_every must be >= 1, got {self.val_every}")
        self._check_held_out()
        if self.token_budget < 16 or self.grad_accum < 1 or self.log_every < 1:
            raise ValueError("token_budget >= 16, grad_accum >= 1, log_every >= 1")
        self._check_choices()
        if self.compile_mode != "default" and not self.compile:
            raise ValueError(f"compile_mode {self.compile_mode} needs --compile")
        if self.compile_scope != "layers" and not self.compile:
            raise ValueError(f"compile_scope {self.compile_scope} needs --compile")
        self._check_ce_kernel()
        if self.mask_tile not in MASK_TILES:
            raise ValueError(f"mask_tile must be one of {MASK_TILES}, got {self.mask_tile}")
        if self.mask_tile != 128 and self.compile_mode == "default":
            raise ValueError(f"mask_tile {self.mask_tile} needs --compile with a max-autotune "
                             "--compile-mode (the default kernel takes 128-row tiles only)")
        for flag, module in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
            if getattr(self, flag) and importlib.util.find_spec(module) is None:
                raise ValueError(f"--{flag} needs the {module} package: pip install {module}")

    def _check_held_out(self) -> None:
        """The held-out options agree with each other and with --follow."""
        if self.val_samples and self.val_store:
            raise ValueError("give val_samples (held out of the training store) or val_store, not "
                             "both (--val-samples 0 beside --val-store where a config file sets "
                             "val_samples)")
        if self.val_tree_budget and not (self.val_samples or self.val_store):
            raise ValueError(f"val_tree_budget {self.val_tree_budget} needs val_samples > 0 or a "
                             "val_store")
        if self.patience and not (self.val_samples or self.val_store):
            raise ValueError(f"patience {self.patience} needs val_samples > 0 or a val_store")
        if self.node_affine and self.follow:
            raise ValueError("node_affine splits a finished store's shards among nodes: not with "
                             "follow")
        if self.val_samples and self.follow:
            raise ValueError("val_samples needs the whole store to choose from: not with follow")

    def _check_ce_kernel(self) -> None:
        """--ce-kernel liger: plain CE through the fused path (the GPU and the package are the run's
        checks: train.start.loss_settings)."""
        if self.ce_kernel != "liger":
            return
        if self.loss != "ce" or self.confidence_penalty or self.markov_rank or \
                self.loss_backward != "fused":
            raise ValueError("ce_kernel liger computes plain cross-entropy in the fused backward: "
                             "not with --loss kl/mix, --confidence-penalty, --markov-rank or "
                             f"--loss-backward {self.loss_backward} (--ce-kernel torch with them)")

    def _check_choices(self) -> None:
        """Each option with a fixed set of values holds one of them."""
        for name, allowed in (("loss", ("ce", "kl", "mix")), ("divergence", DIVERGENCES),
                              ("position_weights", POSITION_WEIGHTS),
                              ("loss_backward", LOSS_BACKWARDS), ("grad_reduce", GRAD_REDUCES),
                              ("verify_shards", ("auto", "on", "off")),
                              ("attention", ("auto", "flex", "sdpa")),
                              ("compile_mode", COMPILE_MODES),
                              ("compile_scope", COMPILE_SCOPES), ("ce_kernel", CE_KERNELS),
                              ("flex_kernel", FLEX_KERNEL_NAMES),
                              ("residual_dtype", RESIDUAL_DTYPES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {tuple(allowed)}, got "
                                 f"{getattr(self, name)!r}")

    @property
    def effective_kl_weight(self) -> float:
        return {"ce": 0.0, "kl": 1.0, "mix": self.kl_weight}[self.loss]

    @property
    def check_shards(self) -> bool:
        """Whether readers check each shard on first read (verify_shards, auto resolved)."""
        return self.verify_shards == "on" or (self.verify_shards == "auto" and self.follow)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layers"] = list(self.layers)
        d["init_layers"] = list(self.init_layers)
        return d


# Fields that may change on --resume without changing what is trained (the store is checked by its
# content's identity instead of its path: a store moved elsewhere resumes, another at the same path
# does not).
RESUME_FREE = ("store", "cache_dir", "resume", "resume_from",
               "follow_timeout", "max_steps", "time_limit", "schedule_seconds",
               "tensorboard", "wandb", "verify_shards",
               "epochs", "log_every", "checkpoint_every", "keep_checkpoints", "workers",
               "val_every", "patience", "loss_chunk", "loss_backward", "grad_reduce",
               "follow", "compile", "compile_mode", "compile_scope", "mask_tile", "flex_kernel",
               "ce_kernel", "out")
