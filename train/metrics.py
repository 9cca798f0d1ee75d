"""Training metrics: one JSON object per line in RUN/metrics.jsonl (rank 0), PNG plots, and on
request the same rows as TensorBoard event files (RUN/tensorboard) and a Weights & Biases run."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["MetricsLog", "plot_metrics", "trim_metrics"]


class MetricsLog:
    """Appends metric rows; a no-op on ranks other than 0 (no scattered `if rank == 0`).

    With `tensorboard`, every number of a row is also a scalar of RUN/tensorboard (per-position
    lists such as acc as tag/k); a resumed run purges the events past its checkpoint's step, as
    trim_metrics does for the jsonl. With `wandb`, the rows go to a wandb run (project from
    WANDB_PROJECT, default draftcache; WANDB_MODE=offline works without a network).
    """

    def __init__(self, run: str | os.PathLike, enabled: bool, *, step: int = 0,
                 tensorboard: bool = False,
                 wandb: bool = False, config: dict[str, Any] | None = None) -> None:
        self.path = Path(run) / "metrics.jsonl"
        self.enabled = enabled
        self._tb = self._wb = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # a resume from step N keeps the rows up to N (trim_metrics): events from N + 1 on are
            # redone
            self._tb = SummaryWriter(log_dir=str(Path(run) / "tensorboard"),
                                     purge_step=step + 1 if step else None)
        if enabled and wandb:
            import wandb as wb

            self._wb = wb.init(project=os.environ.get("WANDB_PROJECT", "draftcache"), dir=str(run),
                               config=config, name=Path(run).name, resume="allow")

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is None and self._wb is None:
            return
        scalars = {}
        for k, v in row.items():
            if k in ("step", "epoch"):
                continue
            if isinstance(v, (int, float)):
                scalars[k] = float(v)
            elif isinstance(v, list):
                scalars.update({f"{k}/{i + 1}": float(x) for i, x in enumerate(v)})
            elif isinstance(v, dict):  # e.g. val_decode_tau_96_by_domain: one scalar a domain
                scalars.update({f"{k}/{n}": float(x) for n, x in v.items()})
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, row["step"])
            self._tb.flush()
        if self._wb is not None:
            self._wb.log(scalars, step=row["step"])

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wb is not None:
            self._wb.finish()


def _rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(line, row) of each sound row of a metrics file; a torn last line of a killed run, or any
    line damaged otherwise (not JSON, not UTF-8, no integer step), is left out: the metrics are a
    record, never a reason for a run to fail."""
    out = []
    for line in path.read_bytes().decode("utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            out.append((line, row))
    return out


def trim_metrics(run: str | os.PathLike, step: int) -> None:
    """Keep only the rows of steps <= `step` (the step training restarts from; 0 = a fresh run), so
    a resumed run's curve has each step once. Rewritten whole: a temp file and a rename."""
    path = Path(run) / "metrics.jsonl"
    if not path.exists():
        return
    keep = [line for line, row in _rows(path) if row["step"] <= step]
    tmp = path.with_suffix(".jsonl.partial")
    tmp.write_text("".join(x + "\n" for x in keep))
    os.replace(tmp, path)


def plot_metrics(run: str | os.PathLike) -> list[Path]:
    """loss.png and sim_tau.png from metrics.jsonl (training rows, and held-out rows if any; the
    replayed decoding τ beside sim_tau)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for _, row in _rows(Path(run) / "metrics.jsonl")]
    out = []
    for key, label in (("loss", "loss"), ("sim_tau", "teacher-forced expected acceptance τ")):
        fig, ax = plt.subplots(figsize=(7, 4))
        series = [(key, "training batches"), (f"val_{key}", "held-out samples")]
        if key == "sim_tau":
            series.append(("val_decode_tau", "held-out decoding τ (replayed)"))
        for k, name in series:
            pts = [(r["step"], r[k]) for r in rows if k in r]  # held-out rows are their own lines
            if pts:
                ax.plot(*zip(*pts), label=name, marker="o" if k.startswith("val_") else None)
        # a validation store of the evaluation's prompts: one line a domain
        by = "val_decode_tau_96_by_domain"
        for d in (dict.fromkeys(g for r in rows for g in r.get(by, {}))
                  if key == "sim_tau" else ()):
            pts = [(r["step"], r[by][d]) for r in rows if d in r.get(by, {})]
            ax.plot(*zip(*pts), label=f"held-out decoding τ, {d} (first 96 tokens)", marker=".",
                    linestyle="--")
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        p = Path(run) / f"{key}.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        out.append(p)
    return out
