"""Checkpoints: RUN/checkpoints/step-N/ with drafter weights (safetensors), optimizer, scheduler,
sampler position and config; written to a .partial directory and renamed, the last few kept."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

__all__ = ["latest_checkpoint", "load_checkpoint", "save_checkpoint"]


def save_checkpoint(run: str | os.PathLike, step: int, *, model: torch.nn.Module, optimizer, scheduler,
                    state: dict[str, Any], keep: int) -> Path:
    root = Path(run) / "checkpoints"
    final, tmp = root / f"step-{step}", root / f"step-{step}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, str(tmp / "model.safetensors"))
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps(state, indent=2))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    steps = sorted(int(p.name[5:]) for p in root.glob("step-*") if p.name[5:].isdigit())
    for old in steps[:-keep]:
        shutil.rmtree(root / f"step-{old}", ignore_errors=True)
    return final


def latest_checkpoint(run: str | os.PathLike) -> Path | None:
    root = Path(run) / "checkpoints"
    steps = sorted(int(p.name[5:]) for p in root.glob("step-*") if p.name[5:].isdigit())
    return root / f"step-{steps[-1]}" if steps else None


def load_checkpoint(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(model state, optimizer+scheduler state, state.json) of a checkpoint directory."""
    path = Path(path)
    if not (path / "state.json").is_file():
        raise ValueError(f"{path}: not a checkpoint (no state.json)")
    opt = torch.load(path / "optimizer.pt", weights_only=False) if (path / "optimizer.pt").exists() else {}
    return load_file(str(path / "model.safetensors")), opt, json.loads((path / "state.json").read_text())
