"""Checkpoints: RUN/checkpoints/step-N/ with drafter weights (safetensors), optimizer, scheduler,
sampler position and config; written to a .partial directory and renamed, the last few kept.
RUN/checkpoints/best-N/ holds the weights of the best held-out score so far: on a small dataset
the drafter overfits (held-out sim_tau peaked at 13 of 31 epochs on the real target) and the last
step is not the one to serve."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from cache_format.checksums import sha256_file
from runtime.oserrors import write_failure

CHECKSUMS = "checksums.json"  # sha256 of each file of a checkpoint, written last before the rename

__all__ = ["best_checkpoint", "latest_checkpoint", "load_checkpoint", "resolve_checkpoint",
           "save_best", "save_checkpoint", "set_aside_after"]


def _steps(root: Path, prefix: str) -> list[int]:
    """The steps of the complete `prefix`N directories under root, ascending (.partial ones are not
    complete)."""
    n = len(prefix)
    return sorted(int(p.name[n:]) for p in root.glob(f"{prefix}*") if p.name[n:].isdigit())


def _write(root: Path, name: str, model: torch.nn.Module, state: dict[str, Any],
           extra: dict[str, Any] | None) -> Path:
    final, tmp = root / name, root / f"{name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
                  str(tmp / "model.safetensors"))
        if extra is not None:
            torch.save(extra, tmp / "optimizer.pt")
        (tmp / "state.json").write_text(json.dumps(state, indent=2))
        # a flipped byte in the weights would load as other weights: every file's sha256 beside them
        sums = {p.name: sha256_file(p) for p in sorted(tmp.iterdir())}
        (tmp / CHECKSUMS).write_text(json.dumps(sums, indent=1))
    except Exception as e:  # a full disk reaches us as OSError or safetensors' own error
        shutil.rmtree(tmp, ignore_errors=True)
        raise ValueError(f"the checkpoint could not be written: {write_failure(e, root / name)}; "
                         "the earlier checkpoints are untouched") from None
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def save_checkpoint(run: str | os.PathLike, step: int, *, model: torch.nn.Module,
                    optimizer, scheduler, state: dict[str, Any], keep: int) -> Path:
    root = Path(run) / "checkpoints"
    final = _write(root, f"step-{step}", model, state,
                   {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()})
    for old in _steps(root, "step-")[:-keep]:
        shutil.rmtree(root / f"step-{old}", ignore_errors=True)
    return final


def save_best(run: str | os.PathLike, step: int, *, model: torch.nn.Module,
              state: dict[str, Any]) -> Path:
    """Weights and state (with the score that made it best) as best-STEP; the older best goes only
    once this one is complete, so a crash always leaves one whole best checkpoint."""
    root = Path(run) / "checkpoints"
    final = _write(root, f"best-{step}", model, state, None)
    for old in _steps(root, "best-"):
        if old != step:
            shutil.rmtree(root / f"best-{old}", ignore_errors=True)
    return final


def _newest(run: str | os.PathLike, prefix: str) -> Path | None:
    root = Path(run) / "checkpoints"
    steps = _steps(root, prefix)
    return root / f"{prefix}{steps[-1]}" if steps else None


def latest_checkpoint(run: str | os.PathLike) -> Path | None:
    return _newest(run, "step-")


def best_checkpoint(run: str | os.PathLike) -> Path | None:
    return _newest(run, "best-")


def resolve_checkpoint(run: str | os.PathLike, which: str = "") -> Path:
    """`which`: "best" (best held-out score), "latest" (newest step-N), a directory, or "" = best if
    the run validated, else latest. ValueError naming the run if there is none."""
    if which not in ("", "best", "latest"):
        return Path(which)
    best = best_checkpoint(run) if which in ("", "best") else None
    ck = best or (latest_checkpoint(run) if which in ("", "latest") else None)
    if ck is None:
        kind = {"best": "best (train with --val-samples > 0)", "latest": "step-N"}.get(which, "")
        raise ValueError(f"{run}: no {kind + ' ' if kind else ''}checkpoint found (train first)")
    return ck


def set_aside_after(run: str | os.PathLike, step: int) -> None:
    """Rename the run's step-N checkpoints past `step` to step-N.superseded (--resume-from: the run
    goes on from an earlier checkpoint, and a later resume must not take the later ones as
    newest)."""
    for n in [n for n in _steps(Path(run) / "checkpoints", "step-") if n > step]:
        later = Path(run) / "checkpoints" / f"step-{n}"
        os.replace(later, later.with_name(later.name + ".superseded"))


def check_files(path: Path) -> None:
    """ValueError in one line if a file listed in the checkpoint's checksums.json is missing or
    changed (a checkpoint put together by hand, without the list, is taken as it is)."""
    listed = path / CHECKSUMS
    if not listed.is_file():
        return
    try:
        sums = json.loads(listed.read_text())
    except ValueError:
        raise ValueError(
            f"{listed}: damaged; name an earlier checkpoint with --resume-from") from None
    for name, want in sorted(sums.items()):
        if not (path / name).is_file() or sha256_file(path / name) != want:
            raise ValueError(f"{path / name}: "
                             f"{'missing' if not (path / name).is_file() else 'checksum mismatch'} "
                             "(a damaged checkpoint); name an earlier one with --resume-from")


def load_checkpoint(
        path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(model state, optimizer+scheduler state, state.json) of a checkpoint directory, its files
    checked."""
    path = Path(path)
    if not (path / "state.json").is_file():
        raise ValueError(f"{path}: not a checkpoint (no state.json)")
    check_files(path)
    part = "state.json"
    # a truncated or damaged file is one line naming it, not a traceback from torch or safetensors
    try:
        state = json.loads((path / part).read_text())
        part = "optimizer.pt"
        opt = torch.load(path / part, weights_only=False) if (path / part).exists() else {}
        part = "model.safetensors"
        weights = load_file(str(path / part))
    except Exception as e:  # noqa: BLE001 - pickle, safetensors and json each raise their own types
        raise ValueError(f"{path / part}: damaged or truncated ({type(e).__name__}); resume from "
                         "an earlier checkpoint: --resume takes the newest, so move this one "
                         "aside") from None
    if not isinstance(state, dict) or not isinstance(opt, dict):
        raise ValueError(f"{path}: damaged checkpoint (state.json or optimizer.pt is not what a "
                         "checkpoint holds)")
    return weights, opt, state
