"""python -m train.export: a run's drafter in the z-lab DFlash Hugging Face layout.

    python -m train.export --run runs/demo --out exports/demo

Writes config.json (Qwen3-style dims, block_size, num_target_layers, dflash_config with
mask_token_id and target_layer_ids, layer_types, architectures DFlashDraftModel) and
model.safetensors with `layers.*`, `fc.weight`, `hidden_norm.weight`, `norm.weight`; no embedding
and no lm_head (the server takes the target's).

Layer ids: `target_layer_ids` use the HF convention of the store (id i = output of decoder layer
i = hidden_states[i+1]), as z-lab and SGLang expect. vLLM captures *before* a layer, so its
`eagle_aux_hidden_state_layer_ids` are these ids + 1.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import click
import torch
from safetensors.torch import load_file, save_file

from train.model import DrafterConfig

__all__ = ["export_run", "from_export_names", "to_export_names"]

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


def export_run(run: str, out: str, checkpoint: str = "", *, overwrite: bool = False) -> Path:
    """Write the run's chosen checkpoint to `out`; a non-empty `out` is refused unless `overwrite`
    (files of another export beside ours would be served with it)."""
    from train.checkpoint import load_checkpoint, resolve_checkpoint

    dst = Path(out)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        if not overwrite:
            raise ValueError(f"{dst}: exists and is not empty; pass --overwrite to replace it, or another --out")
        shutil.rmtree(dst) if dst.is_dir() else dst.unlink()

    ck = resolve_checkpoint(run, checkpoint)
    weights, _, state = load_checkpoint(ck)
    dc = DrafterConfig(**state["drafter"])
    target_cfg = state.get("target_config", {})
    config = {
        "architectures": ["DFlashDraftModel"],
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
        "max_position_embeddings": target_cfg.get("max_position_embeddings", 32768),
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        "block_size": dc.block_size,
        "num_target_layers": state.get("num_target_layers", 0),
        "layer_types": ["full_attention"] * dc.num_layers,
        "dflash_config": {"mask_token_id": dc.mask_token_id, "target_layer_ids": state["layer_ids"]},
    }
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in to_export_names(weights).items()},
              str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def load_export(path: str) -> tuple[DrafterConfig, dict[str, torch.Tensor], list[int]]:
    """(drafter config, our state dict, target layer ids) of an exported directory."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    dc = DrafterConfig(hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
                       num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
                       num_kv_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"], vocab_size=cfg["vocab_size"],
                       num_taps=len(cfg["dflash_config"]["target_layer_ids"]), block_size=cfg["block_size"],
                       mask_token_id=cfg["dflash_config"]["mask_token_id"], rope_theta=cfg["rope_theta"],
                       rms_eps=cfg["rms_norm_eps"])
    return dc, from_export_names(load_file(str(Path(path) / "model.safetensors"))), cfg["dflash_config"]["target_layer_ids"]


@click.command()
@click.option("--run", required=True, help="Training run directory.")
@click.option("--out", required=True, help="Export directory.")
@click.option("--checkpoint", default="", help="'best', 'latest' or a checkpoint directory [default: best if the "
              "run validated, else latest].")
@click.option("--overwrite", is_flag=True, help="Replace a non-empty --out.")
def main(run: str, out: str, checkpoint: str, overwrite: bool) -> None:
    """Export a trained drafter for SGLang / vLLM (z-lab DFlash layout)."""
    try:
        dst = export_run(run, out, checkpoint, overwrite=overwrite)
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"exported to {dst}")


if __name__ == "__main__":
    main()
