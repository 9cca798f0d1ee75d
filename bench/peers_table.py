"""The side by side's one table: each drafter's decoding figures from its `train.eval --json` report.

`python -m bench peers table --eval ours=E1/eval.json --eval dspark=E2/eval.json` prints a markdown
table of τ overall and per domain, as a chain and at each tree budget the reports share, with the
lossless check, so a run's exports (ours and the peers', converted) read as one table.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["budget_figures", "budgets_of", "decode_rows", "load_reports", "markdown_table"]


def budget_figures(report: dict) -> dict[int, dict]:
    """A report's figures by tree budget (0: the chain); a report without a tree curve holds its one
    budget's."""
    curve = report.get("tree_curve") or {}
    if curve:
        return {int(b): fig for b, fig in curve.items()}
    return {int(report.get("tree_budget", 0)): report}


def budgets_of(reports: dict[str, dict]) -> list[int]:
    """Every tree budget any of the reports holds, in order."""
    return sorted({b for r in reports.values() for b in budget_figures(r)})


def decode_rows(reports: dict[str, dict]) -> tuple[list[str], list[list[str]]]:
    """reports {name: eval report} -> (header, rows): per drafter, τ and each domain's τ at every
    budget any report holds ("—" where its report lacks that budget), then lossless (yes where every
    budget it decoded was)."""
    budgets = budgets_of(reports)
    domains: list[str] = []
    for r in reports.values():
        for fig in budget_figures(r).values():
            domains += [d for d in fig.get("tau_by_domain", {}) if d not in domains]
    header = ["drafter"]
    for b in budgets:
        label = "chain" if b == 0 else f"tree {b}"
        header += [f"{label} τ"] + [f"{label} {d}" for d in domains]
    rows = []
    for name, r in reports.items():
        figs, row = budget_figures(r), [name]
        for b in budgets:
            fig = figs.get(b)
            by = fig.get("tau_by_domain", {}) if fig else {}
            row += [f"{fig['tau']:.3f}" if fig else "—"] + [f"{by[d]:.3f}" if d in by else "—" for d in domains]
        rows.append(row + ["yes" if all(f.get("lossless") for f in figs.values()) else "NO"])
    return header + ["lossless"], rows


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table: the header, the rule, one line a row."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def load_reports(pairs: list[str]) -> dict[str, dict]:
    """NAME=PATH pairs -> {name: report}; a malformed pair or a file that is no eval report: one
    line naming it."""
    out = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--eval {pair!r}: give NAME=PATH (e.g. ours=run/eval.json)")
        try:
            report = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(report, dict) or not isinstance(report.get("tau"), (int, float)):
            raise ValueError(f"{path}: not a train.eval --json report (no tau)")
        if name in out:
            raise ValueError(f"--eval {name} given twice")
        out[name] = report
    return out
