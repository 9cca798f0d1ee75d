"""Training metrics: one JSON object per line in RUN/metrics.jsonl (rank 0), and PNG plots."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["MetricsLog", "plot_metrics"]


class MetricsLog:
    """Appends metric rows; a no-op on ranks other than 0 (no scattered `if rank == 0`)."""

    def __init__(self, run: str | os.PathLike, enabled: bool) -> None:
        self.path = Path(run) / "metrics.jsonl"
        self.enabled = enabled

    def write(self, row: dict[str, Any]) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")


def plot_metrics(run: str | os.PathLike) -> list[Path]:
    """loss.png and sim_tau.png from metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(x) for x in (Path(run) / "metrics.jsonl").read_text().splitlines() if x.strip()]
    out = []
    for key, label in (("loss", "training loss"), ("sim_tau", "teacher-forced expected acceptance τ")):
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([r["step"] for r in rows], [r[key] for r in rows])
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        p = Path(run) / f"{key}.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        out.append(p)
    return out
