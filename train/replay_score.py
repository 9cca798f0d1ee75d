"""python -m train.replay_score: a drafter's decoding τ replayed on a store, without the target.

    python -m train.replay_score --store /dev/shm/val.zarr --export runs/x/export
    python -m train.replay_score --store val.zarr --run runs/x --checkpoint latest --json

A store of the target's greedy answers holds everything speculative decoding would see: at each
position the target's hidden states and its next token. One batched drafter forward with an anchor
at every answer position gives each anchor's accepted length, and decoding's path follows from
those (train.replay). The figures are `train --val-store`'s held-out row (val_decode_tau, over the
first 96 answer tokens val_decode_tau_96, and the teacher-forced val_loss and val_sim_tau), over
every sample of the store: a checkpoint or export scored in seconds on the prompts its store holds
(e.g. `scripts/scale_run.sh valstore`'s), where `train.eval` decodes with the target for minutes.
Answers to the evaluation's held-out prompts are also scored per domain
(val_decode_tau_96_by_domain). `--tree-budget 32,128` replays draft-tree decoding the same way
(train.replay.tree_accepts). A checkpoint drafts from the target's whole lm_head, as its default
export serves it (--draft-head: from its draft vocabulary); an export drafts as it is exported.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click
import numpy as np
import torch

from cache_format import CacheFormatError, StoreReader
from train.checkpoint import load_checkpoint, resolve_checkpoint
from train.data import CollateSettings, replay_dataset
from train.export import as_whole_head, read_export
from train.losses import Weighting, default_gamma
from train.masks import use_flex_attention
from train.model import DrafterConfig
from train.start import build_drafter, check_creation_files, domain_groups, load_drafter_weights
from train.step import LossSettings, evaluate_holdout

__all__ = ["replay_score"]


def _drafter_of(run: str, checkpoint: str, export: str,
                whole_head: bool) -> tuple[DrafterConfig, dict, list[int], str]:
    """(config, weights, target layer ids, target sha256 or "") of a checkpoint or an export."""
    if export:
        dc, weights, layer_ids = read_export(export)
        cfg = json.loads((Path(export) / "config.json").read_text())
        sha = cfg.get("draftcache_target", {}).get("sha256", "")
        return dc, weights, list(layer_ids), sha
    weights, _, state = load_checkpoint(resolve_checkpoint(run, checkpoint))
    if whole_head:
        state, weights = as_whole_head(state, weights)
    return (DrafterConfig(**state["drafter"]), weights, list(state["layer_ids"]),
            state.get("target_sha256", ""))


def replay_score(store: str, *, run: str = "", checkpoint: str = "", export: str = "",
                 whole_head: bool = True,
                 token_budget: int = 8192, cache: str = "", samples: tuple[int, ...] = (),
                 tree_budgets: tuple[int, ...] = ()) -> dict[str, Any]:
    """The held-out row of `train --val-store` for one drafter over every sample of `store` (or the
    sample ids `samples`); with `tree_budgets`, also tree decoding replayed at each node budget
    ("tree_curve": budget -> val_tree_tau, val_tree_tau_96 and its domains)."""
    if bool(run) == bool(export):
        raise ValueError("give --run (a training run) or --export (an exported directory)")
    if any(n < 1 for n in tree_budgets):
        raise ValueError("tree budgets must be >= 1 (the chain is always scored), got "
                         f"{list(tree_budgets)}")
    dc, weights, layer_ids, sha = _drafter_of(run, checkpoint, export, whole_head)
    reader = StoreReader(store, cache=cache)
    m, what = reader.manifest, export or run
    if not reader.finalized:
        raise ValueError(f"{store}: store is not finalized (stage one still running or killed)")
    if sha and sha != m.target.sha256:
        raise ValueError(f"{store}: written by another target ({m.target.name}) than {what}'s")
    missing = [i for i in layer_ids if i not in m.layer_ids]
    if missing or dc.mask_token_id != m.mask_token_id:
        raise ValueError(f"{store}: lacks what {what} reads (target layers {missing or 'present'}, "
                         f"mask token {m.mask_token_id} vs {dc.mask_token_id})")
    check_creation_files(reader, store)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_drafter(dc, reader.frozen(), weights.get("draft_ids"))
    # what --init-from refuses, refused here too: a config that claims weights the file lacks
    load_drafter_weights(model, {k: v for k, v in weights.items() if k != "draft_ids"}, what)
    model = model.to(device=device, dtype=torch.float32)
    keep = np.isin(reader.sample_ids,
                   samples) if samples else np.ones(len(reader.sample_ids), dtype=bool)
    unknown = sorted(set(samples) - set(reader.sample_ids.tolist()))
    if unknown:
        raise ValueError(f"{store}: holds no sample {unknown[0]}")
    # every shard read, checked first (CacheFormatError: one line)
    reader.verify_samples(reader.sample_ids[keep])
    settings = CollateSettings(tap_index=tuple(list(m.layer_ids).index(i) for i in layer_ids),
                               # replay_dataset: every position
                               num_stored_taps=len(m.layer_ids), num_anchors=1,
                               block_size=dc.block_size, mask_token_id=dc.mask_token_id,
                               with_last_hidden=False)
    longest = int(reader.lengths()[keep].max(initial=1))
    ds = replay_dataset(reader, keep, settings, token_budget=max(token_budget, longest), ranks=1,
                        rank=0, seed=0)
    loss = LossSettings(block_size=dc.block_size, gamma=default_gamma(dc.block_size),
                        weighting=Weighting(),
                        use_flex=use_flex_attention("auto", device.type, dc.head_dim))
    groups = domain_groups(reader, keep)
    with torch.no_grad():  # one forward a micro-batch, every budget's tree built from it
        got = evaluate_holdout(model, ds, device, world=1, loss=loss, groups=groups,
                               tree_budgets=tree_budgets)
    row = {k: v for k, v in got.items() if not k.startswith("val_tree_")}
    if tree_budgets:
        row["tree_curve"] = got.get("val_tree_curve") or {
            str(tree_budgets[0]): {k: v for k, v in got.items() if k.startswith("val_tree_tau")}}
    return {**row, "samples": int(keep.sum()), "store": store, "drafter": what}


@click.command()
@click.option("--store", required=True,
              help="A store of the target's greedy answers (a path or URL).")
@click.option("--run", default="", help="A training run directory (with --checkpoint).")
@click.option("--checkpoint", default="",
              help="'best', 'latest' or a checkpoint directory [default: best if the "
              "run validated, else latest].")
@click.option("--export", default="", help="An exported directory (instead of --run).")
@click.option("--whole-head/--draft-head", default=True, show_default=True,
              help="A checkpoint trained with --draft-vocab drafts from the target's whole "
              "lm_head, as its default export serves it, or from its draft vocabulary.")
@click.option("--samples", default="",
              help="Score only these sample ids (comma-separated), e.g. one source's.")
@click.option("--token-budget", default=8192, show_default=True, help="Tokens per forward.")
@click.option("--tree-budget", default="",
              help="Also replay tree decoding at these node budgets (comma-separated, "
              "each >= 1; train.eval --tree-budget decodes the same trees with the target).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def main(store: str, run: str, checkpoint: str, export: str, whole_head: bool, samples: str,
         token_budget: int, tree_budget: str, as_json: bool) -> None:
    """A drafter's decoding τ replayed along a store's answers (no target needed)."""
    try:
        ids = tuple(int(x) for x in samples.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"not a comma-separated list of sample ids: {samples!r}",
                                 param_hint="--samples") from None
    try:
        budgets = tuple(int(x) for x in tree_budget.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"not a comma-separated list of node budgets: {tree_budget!r}",
                                 param_hint="--tree-budget") from None
    try:
        res = replay_score(store, run=run, checkpoint=checkpoint, export=export,
                           whole_head=whole_head,
                           token_budget=token_budget, samples=ids, tree_budgets=budgets)
    except (CacheFormatError, ValueError, OSError) as e:
        click.echo(f"error: {str(e).splitlines()[0]}", err=True)
        sys.exit(2)
    if as_json:
        click.echo(json.dumps(res))
        return
    click.echo(f"{res['drafter']} on {store} ({res['samples']} samples): val_decode_tau "
               f"{res['val_decode_tau']:.3f}, first 96 tokens {res['val_decode_tau_96']:.3f}, "
               f"val_sim_tau {res['val_sim_tau']:.3f}, val_loss {res['val_loss']:.3f}")
    for domain, tau in res.get("val_decode_tau_96_by_domain", {}).items():
        click.echo(f"  {domain}: first 96 tokens {tau:.3f}")
    for n, t in res.get("tree_curve", {}).items():
        by = ", ".join(f"{d} {v:.3f}" for d, v in t.get("val_tree_tau_96_by_domain", {}).items())
        click.echo(f"tree of {n} nodes: val_tree_tau {t['val_tree_tau']:.3f}, first 96 tokens "
                   f"{t['val_tree_tau_96']:.3f}" + (f" ({by})" if by else ""))


if __name__ == "__main__":
    main()
