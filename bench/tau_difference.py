"""Whether two drafters' τ differ by more than the choice of prompts: their paired difference over
the prompts both decoded, with a bootstrap interval.

τ over a set of prompts is their new tokens over their target forwards (train.eval's pooled τ).
The bootstrap draws the prompts again with replacement, the same draw for both drafters (paired:
a hard prompt is hard for both), and takes the difference's quantiles over the draws. The interval
says how much the 48 held-out prompts alone move the difference. It says nothing of the spread
between two trainings of one setup, which only more runs measure.

`python -m bench peers table` prints, under its table of τ, each drafter's difference from the
first at every budget whose reports hold per-prompt counts (train.eval --json).
"""

from __future__ import annotations

import numpy as np

from bench.peers_table import budget_figures, budgets_of

__all__ = ["difference_rows", "prompt_counts", "tau_difference"]


def prompt_counts(report: dict, budget: int) -> dict[str, tuple[int, int]] | None:
    """A train.eval report's {prompt: (new tokens, target forwards)} at tree `budget` (0: the
    chain); None where the report holds no per-prompt counts for it."""
    rows = (budget_figures(report).get(budget) or {}).get("prompts")
    if not rows and budget == report.get("tree_budget", 0):
        rows = report.get("prompts")  # a curve written without them: the report's rows are its first budget's
    if not rows:
        return None
    return {r["prompt"]: (int(r["new_tokens"]), int(r["target_forwards"])) for r in rows}


def tau_difference(a: dict[str, tuple[int, int]], b: dict[str, tuple[int, int]], *,
                   resamples: int = 10000, level: float = 0.95, seed: int = 0
                   ) -> tuple[float, float, float]:
    """a, b {prompt: (new tokens, target forwards)} over the same prompts -> (τ_b - τ_a, low,
    high): the difference and its `level` bootstrap interval over `resamples` draws."""
    if set(a) != set(b):
        odd = sorted(set(a) ^ set(b))[0]
        raise ValueError(f"the two reports decoded different prompts ({odd} is in one only)")
    if not a or not 0 < level < 1 or resamples < 1:
        raise ValueError("need prompts, a level in (0, 1) and at least one resample")
    keys = sorted(a)
    ca = np.array([a[k] for k in keys], dtype=np.float64)  # [n, 2]: tokens, forwards
    cb = np.array([b[k] for k in keys], dtype=np.float64)
    if (ca[:, 1] <= 0).any() or (cb[:, 1] <= 0).any():
        raise ValueError("a prompt with no target forward")
    n = len(keys)
    draws = np.random.default_rng(seed).integers(0, n, size=(resamples, n))  # [R, n] prompt indices

    def tau(c: np.ndarray, idx: np.ndarray) -> np.ndarray:
        return c[idx, 0].sum(-1) / c[idx, 1].sum(-1)

    diffs = tau(cb, draws) - tau(ca, draws)  # [R]
    tail = (1 - level) / 2
    low, high = np.quantile(diffs, [tail, 1 - tail])
    whole = np.arange(n)
    return float(tau(cb, whole) - tau(ca, whole)), float(low), float(high)


def difference_rows(reports: dict[str, dict]) -> tuple[list[str], list[list[str]]]:
    """reports {name: train.eval report} -> (header, rows): each drafter after the first, its τ
    minus the first's at every budget the reports hold, with the 95% interval over the prompts ("—"
    where either report lacks that budget's per-prompt counts)."""
    budgets = budgets_of(reports)
    first, *rest = list(reports)
    header = [f"drafter − {first}"] + [("chain" if b == 0 else f"tree {b}") + " Δτ [95%]"
                                       for b in budgets]
    rows = []
    for name in rest:
        row = [name]
        for b in budgets:
            a, c = prompt_counts(reports[first], b), prompt_counts(reports[name], b)
            if a is None or c is None:
                row.append("—")
                continue
            try:
                d, lo, hi = tau_difference(a, c)
            except ValueError as e:
                raise ValueError(f"{first} and {name}: {e}") from None
            row.append(f"{d:+.3f} [{lo:+.3f}, {hi:+.3f}]")
        rows.append(row)
    return header, rows
