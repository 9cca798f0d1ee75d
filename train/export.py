"""python -m train.export: a run's drafter in the DFlash Hugging Face layout, self-contained.

    python -m train.export --run runs/demo --out exports/demo

Writes config.json (Qwen3-style dims, block_size, num_target_layers, dflash_config with
target_layer_ids, mask_token_id and the mask token's text, eagle_aux_hidden_state_layer_ids,
layer_types, architectures DFlashDraftModel, auto_map), model.safetensors (bf16: `layers.*`,
`fc.weight`, `hidden_norm.weight`, `norm.weight`; no embedding and no lm_head: the server takes
the target's) and modeling_dflash.py, so that
`AutoModel.from_pretrained(out, trust_remote_code=True)` gives a draft model whose
`spec_generate(target, input_ids)` decodes with the target.

Layer ids: `target_layer_ids` use the HF convention of the store (id i = output of decoder layer
i = hidden_states[i+1]), as the DFlash reference and SGLang read them. vLLM captures *before* a
layer, so it reads `eagle_aux_hidden_state_layer_ids`, the same ids + 1.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import click
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from runtime.cli import config_command
from train.checkpoint import load_checkpoint, resolve_checkpoint
from train.model import DrafterConfig
from train.modeling_dflash import DFlashDraftModel
from train.speculators_layout import write_speculators

__all__ = ["SERVED_FILES", "ExportConfig", "export_config", "export_run", "from_export_names",
           "hf_drafter", "to_export_names", "write_export"]

# the export's code: the modeling file AutoModel loads and the modules it imports (relative imports,
# which transformers copies along with trust_remote_code)
# the Markov head's map onto the logits: its rows follow the output vocabulary
MARKOV_W2 = "markov_head.markov_w2.weight"
SERVED_FILES = ("modeling_dflash.py", "decoding_state.py", "draft_tree.py", "markov_head.py")
DEFAULT_TREE_BUDGET = 512
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
_MLP = ("gate_proj", "up_proj", "down_proj")


def to_export_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        parts = k.split(".")
        if parts[0] == "layers" and parts[2] in _ATTN:
            k = ".".join(parts[:2] + ["self_attn"] + parts[2:])
        elif parts[0] == "layers" and parts[2] in _MLP:
            k = ".".join(parts[:2] + ["mlp"] + parts[2:])
        out[k] = v
    return out


def from_export_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.replace(".self_attn.", ".").replace(".mlp.", "."): v for k, v in state.items()}


def export_run(run: str, out: str, checkpoint: str = "", *, overwrite: bool = False,
               whole_head: bool = True, layout: str = "dflash") -> Path:
    """Write the run's chosen checkpoint to `out`; a non-empty `out` is refused unless `overwrite`
    (files of another export beside ours would be served with it). `whole_head`: a drafter trained
    with a draft vocabulary is exported to draft from the target's whole lm_head (no draft_ids):
    its head is the target's own, and drafting over every row decoded better than over the trained
    subset (on the H200 τ 2.201 vs 2.184, docs/benchmarks/2026-12-03_vocab-size_h200.md); servers
    then need no draft-vocabulary path, and `--init-from` takes it for a run with any draft
    vocabulary. False keeps the draft vocabulary (`draft_ids`, config `draft_vocab_size`). `layout`
    "speculators" writes speculators' checkpoint layout (train.speculators_layout) instead of ours.

    Nothing is deleted before its replacement is complete: the checkpoint is read and checked
    first, the export is written beside `out` (`.NAME.partial`) and swapped in by renames, and only
    then is the old export removed. `out` may not be the run directory, lie inside it or hold it.
    """
    dst, run_dir = Path(out).resolve(), Path(run).resolve()
    if dst == run_dir or run_dir in dst.parents or dst in run_dir.parents:
        raise ValueError(f"--out {out}: is, holds or lies inside the run directory {run}; choose "
                         "another --out")
    occupied = dst.exists() and (not dst.is_dir() or any(dst.iterdir()))
    if occupied and not overwrite:
        raise ValueError(f"{out}: exists and is not empty; pass --overwrite to replace it, or "
                         "another --out")
    weights, _, state = load_checkpoint(resolve_checkpoint(run, checkpoint))
    if whole_head:
        state, weights = as_whole_head(state, weights)
    bad = [k for k, v in weights.items() if not torch.isfinite(v).all()]
    if bad:
        raise ValueError(f"{run}: the checkpoint's {bad[0]} holds NaN or inf (a diverged run); not "
                         "exported")
    tmp, old = dst.with_name(f".{dst.name}.partial"), dst.with_name(f".{dst.name}.old")
    for p in (tmp, old):  # left by an export killed midway
        shutil.rmtree(p, ignore_errors=True)
    try:
        if layout == "speculators":
            write_speculators(tmp, state, to_export_names(weights))
        else:
            write_export(tmp, state, weights)
    except ValueError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except Exception as e:  # a full disk reaches us as OSError or safetensors' own error
        shutil.rmtree(tmp, ignore_errors=True)
        raise ValueError(f"{out}: the export could not be written "
                         f"({' '.join(str(e).split())[:200]}); the previous export, if any, is "
                         "untouched") from None
    if dst.exists():
        dst.rename(old)
    tmp.rename(dst)
    shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
    return Path(out)


def as_whole_head(state: dict,
                  weights: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """A checkpoint's (state, weights) drafting from the target's whole lm_head: no draft
    vocabulary. A Markov head's rows onto the draft vocabulary go to those tokens' rows; the others
    get no bias."""
    out = {k: v for k, v in weights.items() if k != "draft_ids"}
    w2, ids = weights.get(MARKOV_W2), weights.get("draft_ids")
    if w2 is not None and ids is not None:
        vocab = state["drafter"]["vocab_size"]
        out[MARKOV_W2] = w2.new_zeros(vocab, w2.shape[1]).index_copy_(0, ids.long(), w2)  # [V, r]
    return {**state, "drafter": {**state["drafter"], "draft_vocab_size": 0}}, out


def write_export(dst: Path, state: dict, weights: dict[str, torch.Tensor]) -> Path:
    """config.json, bf16 model.safetensors and the served code (SERVED_FILES) of a drafter (a
    checkpoint's state.json and weights) into `dst`."""
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(export_config(state), indent=2))
    # draft_ids stay ids
    save_file({k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
               for k, v in to_export_names(weights).items()},
              str(dst / "model.safetensors"), metadata={"format": "pt"})
    for name in SERVED_FILES:  # the modeling file and the tree maths it imports
        shutil.copyfile(Path(__file__).with_name(name), dst / name)
    return dst


def export_config(state: dict) -> dict:
    """config.json of a checkpoint's drafter (its state.json: drafter dims, layer ids, mask
    token)."""
    dc = DrafterConfig(**state["drafter"])
    head = {}
    if dc.markov_rank:
        # a drafter with a dependence head is not a plain DFlash drafter: an engine that knows only
        # those must refuse it (by the architecture's name) rather than serve its backbone without
        # the head
        head = {"markov_rank": dc.markov_rank, "markov_head_type": "vanilla"}
    return {
        "architectures": ["DFlashMarkovDraftModel" if dc.markov_rank else "DFlashDraftModel"],
        "auto_map": {"AutoModel": "modeling_dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "hidden_size": dc.hidden_size,
        "intermediate_size": dc.intermediate_size,
        "num_hidden_layers": dc.num_layers,
        "num_attention_heads": dc.num_heads,
        "num_key_value_heads": dc.num_kv_heads,
        "head_dim": dc.head_dim,
        "vocab_size": dc.vocab_size,
        "rms_norm_eps": dc.rms_eps,
        "rope_theta": dc.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": dc.rope_theta},
        "max_position_embeddings": state.get("target_config", {}).get("max_position_embeddings",
                                                                      32768),
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "dtype": "bfloat16",
        "torch_dtype": "bfloat16",
        "block_size": dc.block_size,
        # the tokens it may propose (model.safetensors "draft_ids": draft index -> target id); 0 =
        # all
        "draft_vocab_size": dc.draft_vocab_size,
        "num_target_layers": state.get("num_target_layers", 0),
        "layer_types": ["full_attention"] * dc.num_layers,
        **head,
        # tree_budget: spec_generate's default draft tree (0: the chain); the budget of the best
        # measured speedup at batch 1 (docs/benchmarks/2026-12-04_trees-large-budgets_h200.md); a
        # call's tree_budget overrides it
        "dflash_config": {"mask_token_id": dc.mask_token_id,
                          "mask_token": state.get("mask_token", ""),
                          "target_layer_ids": list(state["layer_ids"]),
                          "tree_budget": DEFAULT_TREE_BUDGET},
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in state["layer_ids"]],
        # the target it drafts for: train.eval --export finds it by this (the path where it was
        # trained is only a hint: the sha256 says whether a file is that target)
        "draftcache_target": {"name": Path(state.get("target", "")).name,
                              "sha256": state.get("target_sha256", ""),
                              "path_hint": state.get("target", "")},
    }


def hf_drafter(state: dict, weights: dict[str, torch.Tensor]):
    """A checkpoint as the exported model class (float32): what the export serves, before bf16."""
    model = DFlashDraftModel(Qwen3Config(**export_config(state)))
    model.load_state_dict(to_export_names(weights))
    return model


def load_export(path: str) -> tuple[DrafterConfig, dict[str, torch.Tensor], list[int]]:
    """(drafter config, our state dict, target layer ids) of an exported directory."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    dc = DrafterConfig(hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
                       num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
                       num_kv_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
                       vocab_size=cfg["vocab_size"],
                       num_taps=len(cfg["dflash_config"]["target_layer_ids"]),
                       block_size=cfg["block_size"],
                       mask_token_id=cfg["dflash_config"]["mask_token_id"],
                       rope_theta=cfg["rope_theta"],
                       rms_eps=cfg["rms_norm_eps"], draft_vocab_size=cfg.get("draft_vocab_size", 0),
                       markov_rank=cfg.get("markov_rank", 0))
    weights = from_export_names(load_file(str(Path(path) / "model.safetensors")))
    return dc, weights, cfg["dflash_config"]["target_layer_ids"]


def read_export(path: str) -> tuple[DrafterConfig, dict[str, torch.Tensor], list[int]]:
    """load_export, where a directory that is not a readable export, or one whose weights are not
    exactly the tensors its config describes, is one ValueError naming it: the check every entry
    point that reads an export makes (train.eval before it loads the export as served)."""
    if not all((Path(path) / name).is_file() for name in ("config.json", "model.safetensors")):
        raise ValueError(f"{path}: not an exported drafter (config.json and model.safetensors)")
    try:
        got = load_export(path)
        cfg = json.loads((Path(path) / "config.json").read_text())
        with torch.device("meta"):  # the served model's tensors, by name and shape, with no memory
            want = {k: tuple(v.shape)
                    for k, v in DFlashDraftModel(Qwen3Config(**cfg)).state_dict().items()}
    except Exception as e:  # noqa: BLE001 - json, safetensors and the config raise their own types
        raise ValueError(f"{path}: unreadable export ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200] if str(e) else ''})") from None
    held = {k: tuple(v.shape) for k, v in to_export_names(got[1]).items()}
    wrong = sorted({*want, *held} - {k for k in want if held.get(k) == want[k]})
    if wrong:  # a tensor the config claims and the weights lack would serve from its random init
        raise ValueError(f"{path}: model.safetensors does not hold what config.json describes "
                         f"({len(wrong)} tensors missing, unknown or of another shape, e.g. "
                         f"{wrong[0]})")
    return got


def start_weights(path: str, dc: DrafterConfig, layer_ids: list[int]) -> dict[str, torch.Tensor]:
    """The float32 weights of an exported drafter for a run whose drafter is `dc` on taps
    `layer_ids` (train --init-from); ValueError in one line naming what differs."""
    try:
        theirs, weights, their_ids = read_export(path)
    except ValueError as e:
        raise ValueError(f"--init-from {e}") from None
    # a whole-head export (draft_vocab_size 0, no draft_ids) starts a run with any draft vocabulary:
    # its head is the target's, and the run takes its own rows of it; one without a Markov head
    # starts a run with one (the head starts new)
    diffs = [f"{k} {v} vs {getattr(dc, k)}" for k, v in theirs.to_dict().items()
             if v != getattr(dc, k) and not (k in ("draft_vocab_size", "markov_rank") and v == 0)]
    if list(their_ids) != list(layer_ids):
        diffs.append(f"taps {list(their_ids)} vs {list(layer_ids)}")
    if diffs:
        raise ValueError(f"--init-from {path}: the export does not fit this run's drafter "
                         f"({'; '.join(diffs)})")
    return {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}


@dataclass(frozen=True, kw_only=True)
class ExportConfig:
    """python -m train.export: one option per field (runtime.cli)."""

    run: str
    """Training run directory."""
    out: str
    """Export directory."""
    checkpoint: str = ""
    """'best', 'latest' or a checkpoint directory (empty: best if the run validated, else
    latest)."""
    overwrite: bool = False
    """Replace a non-empty --out."""
    draft_head: bool = False
    """A drafter trained with --draft-vocab drafts from its draft vocabulary only when served
    (draft_ids in the export); by default it drafts from the target's whole lm_head (no
    draft_ids)."""
    layout: str = "dflash"
    """'dflash': the DFlash authors' Hugging Face layout with its modeling code (AutoModel, SGLang,
    vLLM); 'speculators': the checkpoint layout of vLLM's speculators (dflash, or dspark with a
    Markov head)."""

    def __post_init__(self) -> None:
        for name in ("run", "out"):
            if not (getattr(self, name) or "").strip():  # None: the option not given
                raise ValueError(f"--{name} must name a directory")
        if self.layout not in ("dflash", "speculators"):
            raise ValueError(f"--layout {self.layout!r}: must be dflash or speculators")
        if self.layout == "speculators" and self.draft_head:
            raise ValueError("--layout speculators is written for drafting over the target's whole "
                             "vocabulary: drop --draft-head")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@config_command(ExportConfig)
def main(cfg: ExportConfig) -> None:
    """Export a trained drafter for SGLang / vLLM (z-lab DFlash layout)."""
    try:
        dst = export_run(cfg.run, cfg.out, cfg.checkpoint, overwrite=cfg.overwrite,
                         whole_head=not cfg.draft_head, layout=cfg.layout)
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"exported to {dst}")


if __name__ == "__main__":
    main()
