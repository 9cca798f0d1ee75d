"""τ and speedup by draft-tree budget from `train.eval --tree-budget ... --json` results, as one PNG.

    python scripts/plot_tree_curve.py OUT.png EVAL.json [EVAL.json ...]

Each file's `tree_curve` is one line per figure (τ is a count of tokens, equal across runs of the
same export; speedup is a timing, so each run keeps its own line and marker).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def curve(path: str) -> list[tuple[int, float, float]]:
    """(budget, tau, speedup) of one train.eval result, budgets ascending."""
    try:
        tc = json.loads(Path(path).read_text())["tree_curve"]
        return sorted((int(b), float(p["tau"]), float(p["speedup"])) for b, p in tc.items())
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"error: {path}: not a train.eval --json result with a tree_curve ({e})") from None


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit(__doc__.split("\n\n")[1].strip())
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tau, ax_speed) = plt.subplots(1, 2, figsize=(10, 3.8))
    for path in argv[1:]:
        pts = curve(path)
        x = [max(b, 1) for b, _, _ in pts]  # the chain (0) at 1 on the log axis
        label = Path(path).stem
        ax_tau.plot(x, [t for _, t, _ in pts], "o-", label=label)
        ax_speed.plot(x, [s for _, _, s in pts], "s--", label=label)
    for ax, name in ((ax_tau, "τ (tokens per target forward)"), (ax_speed, "speedup over the target alone")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree budget (nodes; 1 = the chain)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    ax_speed.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(argv[0], dpi=110)


if __name__ == "__main__":
    main(sys.argv[1:])
