"""What a run starts from: the store opened and checked, the drafter it defines (dims from the
target's config in the manifest, taps, draft vocabulary), and the checks that a checkpoint may be
resumed. Everything here runs once, before the first step."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cache_format import CacheFormatError, StoreReader
from cache_format.checksums import CREATION_FILES, check_checksums
from cache_format.layout import KEPT_LAYER_PREFIX
from cache_format.schema import Manifest
from chat.prompts import DOMAINS, heldout_domains
from train.checkpoint import load_checkpoint
from train.config import RESUME_FREE, TrainConfig
from train.export import start_weights
from train.follow import WriterWatch, wait_for_store
from train.liger_ce import liger_available
from train.losses import Weighting, default_gamma
from train.masks import use_flex_attention
from train.model import DFlashDrafter, DrafterConfig
from train.step import LossSettings
from train.vocab import answer_token_counts, coverage, draft_vocab

__all__ = ["BEST_BY", "best_by", "best_state", "build_drafter", "check_creation_files",
           "check_resume", "check_same_vocab", "domain_groups", "draft_vocab_of", "drafter_config",
           "initial_weights",
           "load_drafter_weights", "loss_settings", "open_store", "open_val_store", "run_record",
           "start_from_weights", "target_layer_weights"]

# The held-out figure the best checkpoint is kept by: decoding's τ replayed along the stored
# responses, not the teacher-forced sim_tau, which weighs every anchor alike (decoding visits the
# hard ones).
BEST_BY = "val_decode_tau"


def drafter_config(cfg: TrainConfig, reader: StoreReader) -> tuple[DrafterConfig, list[int]]:
    """Drafter dims from the target's config in the manifest; checks layers against the store."""
    m = reader.manifest
    tc = m.target.config
    taps = list(cfg.layers) or list(m.layer_ids)
    missing = [x for x in taps if x not in m.layer_ids]
    if missing:
        raise ValueError(f"{reader.root}: layer ids {missing} are not stored (store has "
                         f"{list(m.layer_ids)})")
    heads = tc.get("num_attention_heads", 8)
    dc = DrafterConfig(
        hidden_size=m.target.hidden_size, intermediate_size=(cfg.intermediate_size
                           or tc.get("intermediate_size", 4 * m.target.hidden_size)),
        num_layers=cfg.num_layers, num_heads=heads,
        num_kv_heads=tc.get("num_key_value_heads") or heads,
        head_dim=tc.get("head_dim") or m.target.hidden_size // heads,
        vocab_size=m.target.vocab_size, num_taps=len(taps), block_size=cfg.block_size,
        mask_token_id=cfg.mask_token_id if cfg.mask_token_id >= 0 else m.mask_token_id,
        rope_theta=float(tc.get("rope_theta")
                         or (tc.get("rope_parameters") or {}).get("rope_theta") or 10000.0),
        rms_eps=float(tc.get("rms_norm_eps", 1e-6)), markov_rank=cfg.markov_rank,
    )
    if not 0 <= dc.mask_token_id < dc.vocab_size:
        raise ValueError(f"mask_token_id {dc.mask_token_id} is outside the vocabulary "
                         f"(0..{dc.vocab_size - 1})")
    return dc, [m.layer_ids.index(x) for x in taps]


def build_drafter(dc: DrafterConfig, frozen: dict[str, torch.Tensor],
                  draft_ids: torch.Tensor | None = None) -> DFlashDrafter:
    emb, head = frozen["embed_tokens.weight"], frozen["lm_head.weight"]
    if emb.shape != (dc.vocab_size, dc.hidden_size):
        raise ValueError(f"embedding shape {tuple(emb.shape)} does not fit vocab {dc.vocab_size} x "
                         f"hidden {dc.hidden_size}")
    return DFlashDrafter(dc, emb, head, draft_ids)


def target_layer_weights(kept: dict[str, torch.Tensor], ids: tuple[int, ...],
                         store: str) -> dict[str, torch.Tensor]:
    """Drafter weights `layers.{j}.*` from the target's decoder layer ids[j] and `norm.weight` from
    its final norm, as the store keeps them (StoreReader.kept_layers); ValueError naming a layer it
    lacks."""
    have = sorted({int(k.split(".")[1]) for k in kept if k.startswith(KEPT_LAYER_PREFIX)})
    out = {"norm.weight": kept["norm.weight"].float()}
    for j, lid in enumerate(ids):
        head = f"{KEPT_LAYER_PREFIX}{lid}."
        got = {k[len(head):]: v for k, v in kept.items() if k.startswith(head)}
        if not got:
            raise ValueError(f"{store}: --init-layers: target layer {lid} is not kept in the store "
                             f"(it keeps {have or 'none'}; extract with --keep-layers)")
        out.update({f"layers.{j}.{k}": v.float() for k, v in got.items()})
    return out


def initial_weights(cfg: TrainConfig, dc: DrafterConfig, layer_ids: list[int],
                    reader: StoreReader) -> tuple[str, dict[str, torch.Tensor]]:
    """(the option that gives them, the weights) a fresh run starts from: an export (--init-from) or
    the target's layers kept in the store (--init-layers)."""
    if cfg.init_from:
        return f"--init-from {cfg.init_from}", start_weights(cfg.init_from, dc, layer_ids)
    weights = target_layer_weights(reader.kept_layers(), cfg.init_layers, cfg.store)
    return f"--init-layers {list(cfg.init_layers)}", weights


def check_same_vocab(model: DFlashDrafter, weights: dict[str, torch.Tensor], what: str,
                     store: str) -> None:
    """Loaded weights must draft from this run's draft vocabulary: its lm_head rows were taken by
    it."""
    mine = getattr(model, "draft_ids", None)
    theirs = weights.get("draft_ids")
    if mine is not None and theirs is not None and not torch.equal(theirs.to(mine.device), mine):
        raise ValueError(f"{what}: its draft vocabulary is not the one this run counts from "
                         f"{store} (other training data); start without it, or train from the "
                         "store it was trained on")


def start_from_weights(model: DFlashDrafter, cfg: TrainConfig, dc: DrafterConfig,
                       layer_ids: list[int], reader: StoreReader) -> None:
    """Load what a fresh run starts from (--init-from or --init-layers: initial_weights) into
    `model`, refusing weights of another shape or vocabulary, and an export that lacks a trainable
    tensor."""
    what, weights = initial_weights(cfg, dc, layer_ids, reader)
    check_same_vocab(model, weights, what, cfg.store)
    w2, mine = weights.get("markov_head.markov_w2.weight"), getattr(model, "draft_ids", None)
    # a whole-head export's head
    if w2 is not None and mine is not None and w2.shape[0] == dc.vocab_size:
        # this run's rows
        weights = {**weights, "markov_head.markov_w2.weight": w2[mine.to(w2.device)]}
    # a drafter without a Markov head starts a run with one: the head starts as a new run's (adding
    # nothing)
    new_head = set() if any(k.startswith("markov_head.") for k in weights) else \
        {n for n, _ in model.named_parameters() if n.startswith("markov_head.")}
    load_drafter_weights(model, weights, what, complete=bool(cfg.init_from), may_lack=new_head)


def load_drafter_weights(model: DFlashDrafter, weights: dict[str, torch.Tensor], what: str, *,
                         complete: bool = True, may_lack: set[str] = frozenset()) -> None:
    """Load `weights` into `model`: one ValueError naming `what` for a tensor of another shape, an
    unknown tensor, or (`complete`) a trainable tensor the weights lack, but those in `may_lack`
    (an export leaves out only frozen buffers; --init-layers fills the layers alone)."""
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as e:  # a shape that differs (another intermediate size, head layout)
        raise ValueError(f"{what}: the weights do not fit this drafter "
                         f"({str(e).splitlines()[-1].strip()})") from None
    names = {n for n, _ in model.named_parameters()}
    lacking = sorted((names & set(missing)) - may_lack) if complete else []
    if unexpected or lacking:
        raise ValueError(f"{what}: weights lack {lacking[:3]} or hold unknown "
                         f"{sorted(unexpected)[:3]}")


def draft_vocab_of(n: int, reader: StoreReader, held: np.ndarray | None, vocab_size: int, *,
                   announce: bool) -> tuple[torch.Tensor | None, float]:
    """With --draft-vocab n: the n most frequent answer tokens of the training samples (held-out
    ones left out) and the share of those samples' answer tokens they cover; else (None, 1.0).
    Every rank counts the same committed samples, so every rank gets the same ids."""
    if not n:
        return None, 1.0
    if n > vocab_size:
        raise ValueError(f"--draft-vocab {n}: larger than the target's vocabulary ({vocab_size})")
    train_rows = ~held if held is not None else np.ones(len(reader), dtype=bool)
    counts = answer_token_counts(reader, train_rows, vocab_size)
    ids = draft_vocab(counts, n)
    share = coverage(counts, ids)
    if announce:
        print(f"draft vocabulary: {n} of {vocab_size} tokens, {share:.2%} of the training answers' "
              "tokens", flush=True)
    return ids, share


def check_resume(cfg: TrainConfig, saved: dict[str, Any], store_identity: str) -> None:
    if saved.get("store_identity") != store_identity:  # same path, other content: another dataset
        raise ValueError(f"cannot resume {cfg.out}: {cfg.store} is not the store it was trained on "
                         "(its manifest differs: another target, dataset or layout); train into "
                         "another --out")
    # a field newer than the checkpoint counts as its default: the run trained as the default does
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)
                if f.default is not dataclasses.MISSING}
    now, old = cfg.to_dict(), {**defaults, **saved["config"]}
    diffs = [f"{k}: checkpoint has {old.get(k)!r}, now {now[k]!r}" for k in now
             if k not in RESUME_FREE and old.get(k) != now[k]]
    if diffs:
        raise ValueError(f"cannot resume {cfg.out}: config differs ({'; '.join(diffs)})")


def best_by(cfg: TrainConfig) -> str:
    """The held-out figure the best checkpoint is chosen by: the tree's replayed τ when trees are
    scored."""
    return "val_tree_tau_96" if cfg.val_tree_budget > 0 else BEST_BY


def best_state(ck: Path, key: str = BEST_BY) -> dict[str, Any]:
    """The best checkpoint's step and score `key`, checked like any checkpoint (a damaged one: one
    line naming it)."""
    _, _, state = load_checkpoint(ck)
    if not isinstance(state.get("step"), int) or key not in state:
        raise ValueError(f"{ck / 'state.json'}: not a best checkpoint's state (no step or {key}); "
                         "move it aside to resume")
    return state


def check_creation_files(reader: StoreReader, store: str) -> None:
    """The files written when the store was made (frozen weights, prompt keys, manifest, tokenizer)
    intact."""
    damaged = check_checksums(reader.root, only=CREATION_FILES)
    if damaged:
        raise ValueError(f"{store}/{damaged[0][0]}: {damaged[0][1]}; the store is damaged "
                         f"(python -m cache_format verify {store} lists every problem)")


def open_store(cfg: TrainConfig, rank: int, watch: WriterWatch) -> StoreReader:
    """The store, checked: finalized (unless following), creation files intact, holding what the
    loss needs."""
    # started beside stage one: the store may not exist yet (here or on the object server)
    if cfg.follow:
        wait_for_store(cfg.store, announce=rank == 0, watch=watch)
    # a URL: metadata copied into the cache, shards on use
    reader = StoreReader(cfg.store, cache=cfg.cache_dir)
    if not reader.finalized and not cfg.follow:
        raise ValueError(f"{cfg.store}: store is not finalized (stage one still running or "
                         "killed); pass --follow to train while it is written")
    check_creation_files(reader, cfg.store)
    if cfg.loss != "ce" and not reader.manifest.last_hidden:
        raise ValueError(f"{cfg.store}: --loss {cfg.loss} needs last_hidden, which this store does "
                         "not hold")
    return reader


def open_val_store(cfg: TrainConfig, train: StoreReader) -> StoreReader:
    """--val-store, checked against the training store: finalized, intact, of the same target,
    tokenizer, tapped layers and mask token (the drafter reads its taps by position and drafts with
    the training store's frozen weights), and sharing no prompt with the training store."""
    val = StoreReader(cfg.val_store, cache=cfg.cache_dir)
    where = f"--val-store {cfg.val_store}"
    if not val.finalized:
        raise ValueError(f"{where}: store is not finalized (stage one still running or killed)")
    check_creation_files(val, cfg.val_store)
    a, b = train.manifest, val.manifest
    for what, mine, theirs in (("target weights", a.target.sha256, b.target.sha256),
                               ("tokenizer files", a.tokenizer_sha256, b.tokenizer_sha256),
                               ("tapped layers", list(a.layer_ids), list(b.layer_ids)),
                               ("mask token ids", a.mask_token_id, b.mask_token_id)):
        if mine != theirs:
            raise ValueError(f"{where}: its {what} ({theirs}) differ from the training store's "
                             f"({mine}); extract it with the same target and --layers")
    if cfg.effective_kl_weight > 0 and not b.last_hidden:
        raise ValueError(f"{where}: --loss {cfg.loss} needs last_hidden, which this store does not "
                         "hold")
    if len(val) == 0:
        raise ValueError(f"{where}: the store holds no samples")
    # a held-out store is small: a damaged shard is named now, not at the first evaluation
    if cfg.check_shards:
        try:
            val.verify_samples(val.sample_ids)
        except CacheFormatError as e:
            raise ValueError(f"{where}: {e}") from None
    keys, train_keys = val.prompt_keys(), train.prompt_keys()
    if keys is not None and train_keys is not None:  # keys are content hashes: equal across stores
        shared = np.intersect1d(keys[keys >= 0], train_keys[train_keys >= 0])
        if len(shared):
            raise ValueError(f"{where}: {len(shared)} of its prompts are in the training store "
                             "too, so they are not held out; extract it from prompts the training "
                             "data lacks")
    return val


def domain_groups(reader: StoreReader, rows: np.ndarray) -> dict[str, torch.Tensor]:
    """Sample ids [n] int64 per domain of the held-out prompts among `reader`'s samples where `rows`
    (bool [len(reader)]) is set, matched by prompt key (a validation store of the evaluation's
    prompts): what evaluate_holdout scores per domain. Empty where none match (a user's own
    validation data), the store holds no prompt keys, or the packaged prompts are not installed."""
    keys = reader.prompt_keys()
    if keys is None:
        return {}
    try:
        domains = np.array(heldout_domains(keys[rows]), dtype=object)
    except (ValueError, OSError):
        # the packages holding the held-out prompts are not installed or readable
        return {}
    ids = reader.sample_ids[rows]
    return {d: torch.as_tensor(ids[domains == d], dtype=torch.long) for d in DOMAINS
            if (domains == d).any()}


def loss_settings(cfg: TrainConfig, device: torch.device, dc: DrafterConfig) -> LossSettings:
    """How every micro-batch of the run becomes a loss (train.step.LossSettings) from the config."""
    # what the machine has is checked here, at the run's start, not in the config: a config (a
    # preset, --print-config) is valid on a machine without the GPU or the package
    if cfg.ce_kernel == "liger":
        if device.type != "cuda":
            raise ValueError("ce_kernel liger needs a GPU (Liger's kernel is Triton); use torch")
        if not liger_available():
            raise ValueError("ce_kernel liger needs the liger-kernel package: pip install "
                             "'draftcache[liger]'")
    return LossSettings(block_size=cfg.block_size, gamma=cfg.gamma or default_gamma(cfg.block_size),
                        kl_weight=cfg.effective_kl_weight, divergence=cfg.divergence,
                        confidence_penalty=cfg.confidence_penalty,
                        use_flex=use_flex_attention(cfg.attention, device.type, dc.head_dim),
                        split_blocks=cfg.split_blocks, context_tile=cfg.context_tile,
                        mask_tile=cfg.mask_tile, flex_kernel=cfg.flex_kernel,
                        ce_kernel=cfg.ce_kernel, residual=cfg.residual_dtype,
                        chunk=cfg.loss_chunk, backward=cfg.loss_backward, compiled=cfg.compile,
                        pad_shapes=cfg.compile,
                        weighting=Weighting(position=cfg.position_weights,
                                            visit_weight=cfg.visit_weight))


def run_record(cfg: TrainConfig, dc: DrafterConfig, m: Manifest, layer_ids: list[int], *,
               total_steps: int, draft_vocab_coverage: float) -> dict[str, Any]:
    """What every checkpoint's state.json records of the run: the config, the drafter, the store's
    identity and the target (export and eval read these)."""
    return {"train": cfg.to_dict(), "drafter": dc.to_dict(), "layer_ids": layer_ids,
            "mask_token": m.mask_token if dc.mask_token_id == m.mask_token_id else "",
            "store": str(cfg.store), "store_identity": m.identity(), "target": m.target.name,
            "target_sha256": m.target.sha256, "total_steps": total_steps,
            "num_target_layers": m.target.num_layers, "draft_vocab_coverage": draft_vocab_coverage,
            "target_config": {k: m.target.config.get(k)
                              for k in ("max_position_embeddings", "architectures")}}

