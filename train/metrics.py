"""Training metrics: one JSON object per line in RUN/metrics.jsonl (rank 0), and PNG plots."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["MetricsLog", "plot_metrics", "trim_metrics"]


class MetricsLog:
    """Appends metric rows; a no-op on ranks other than 0 (no scattered `if rank == 0`)."""

    def __init__(self, run: str | os.PathLike, enabled: bool) -> None:
        self.path = Path(run) / "metrics.jsonl"
        self.enabled = enabled

    def write(self, row: dict[str, Any]) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")


def trim_metrics(run: str | os.PathLike, step: int) -> None:
    """Keep only the rows of steps <= `step` (the step training restarts from; 0 = a fresh run), so
    a resumed run's curve has each step once. Rewritten whole: a temp file and a rename."""
    path = Path(run) / "metrics.jsonl"
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a torn last line of a killed run
    tmp = path.with_suffix(".jsonl.partial")
    tmp.write_text("".join(x + "\n" for x in keep))
    os.replace(tmp, path)


def plot_metrics(run: str | os.PathLike) -> list[Path]:
    """loss.png and sim_tau.png from metrics.jsonl (training rows, and held-out rows if any)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(x) for x in (Path(run) / "metrics.jsonl").read_text().splitlines() if x.strip()]
    out = []
    for key, label in (("loss", "loss"), ("sim_tau", "teacher-forced expected acceptance τ")):
        fig, ax = plt.subplots(figsize=(7, 4))
        for k, name in ((key, "training batches"), (f"val_{key}", "held-out samples")):
            pts = [(r["step"], r[k]) for r in rows if k in r]  # held-out rows are their own lines
            if pts:
                ax.plot(*zip(*pts), label=name, marker="o" if k.startswith("val_") else None)
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
