"""bench.tau_difference: two drafters' τ difference paired over the prompts, with its bootstrap
interval, checked against every resample enumerated."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.tau_difference import difference_rows, prompt_counts, tau_difference

ROOT = Path(__file__).resolve().parents[1]

A = {"p0": (96, 40), "p1": (96, 30), "p2": (50, 25), "p3": (96, 60)}
B = {"p0": (96, 35), "p1": (96, 31), "p2": (50, 20), "p3": (96, 50)}


def _exact(a: dict, b: dict) -> np.ndarray:
    """Every one of the n^n resamples of the prompts, each equally likely: the difference of each."""
    keys = sorted(a)
    out = []
    def tau(c: dict, draw: tuple) -> float:
        return sum(c[k][0] for k in draw) / sum(c[k][1] for k in draw)

    for draw in itertools.product(keys, repeat=len(keys)):
        out.append(tau(b, draw) - tau(a, draw))
    return np.sort(np.array(out))


def test_the_interval_is_the_enumerated_resamples_quantiles():
    d, lo, hi = tau_difference(A, B, resamples=200_000, seed=1)
    whole = sum(v[0] for v in B.values()) / sum(v[1] for v in B.values()) - \
        sum(v[0] for v in A.values()) / sum(v[1] for v in A.values())
    assert d == pytest.approx(whole, rel=1e-12)
    exact = _exact(A, B)  # 256 resamples
    # the sampled 2.5% and 97.5% quantiles land within a point of the exact distribution's
    assert np.quantile(exact, 0.015) <= lo <= np.quantile(exact, 0.035)
    assert np.quantile(exact, 0.965) <= hi <= np.quantile(exact, 0.985)
    assert lo < d < hi


def test_equal_reports_differ_by_zero_and_a_paired_shift_is_seen():
    assert tau_difference(A, A) == (0.0, 0.0, 0.0)
    # B is ahead on three prompts and level on one: pairing keeps every draw's difference >= 0
    ahead = {k: (t, f - 5) if k != "p1" else (t, f) for k, (t, f) in A.items()}
    d, lo, hi = tau_difference(A, ahead)
    assert d > 0 and lo >= 0


def test_bad_input_is_one_line_naming_what():
    with pytest.raises(ValueError, match="p9 is in one only"):
        tau_difference(A, {**A, "p9": (1, 1)})
    with pytest.raises(ValueError, match="no target forward"):
        tau_difference(A, {**A, "p0": (0, 0)})
    with pytest.raises(ValueError, match="level"):
        tau_difference(A, B, level=1.0)


def _report(counts: dict, tree: dict | None = None) -> dict:
    rows = [{"prompt": k, "new_tokens": t, "target_forwards": f} for k, (t, f) in counts.items()]
    r = {"tau": 2.0, "tree_budget": 0, "prompts": rows, "lossless": True, "tau_by_domain": {}}
    if tree is not None:
        trows = [{"prompt": k, "new_tokens": t, "target_forwards": f} for k, (t, f) in tree.items()]
        r["tree_curve"] = {"0": {"tau": 2.0}, "512": {"tau": 3.0, "prompts": trows}}
    return r


def test_rows_pair_each_drafter_with_the_first_at_every_budget():
    reports = {"base": _report(A, tree=B), "new": _report(B, tree=A), "chain only": _report(B)}
    assert prompt_counts(reports["base"], 512) == B and prompt_counts(reports["chain only"], 512) is None
    header, rows = difference_rows(reports)
    assert header == ["drafter − base", "chain Δτ [95%]", "tree 512 Δτ [95%]"]
    d0, _, _ = tau_difference(A, B)
    d1, _, _ = tau_difference(B, A)
    assert rows[0][0] == "new" and rows[0][1].startswith(f"{d0:+.3f} [") and rows[0][2].startswith(f"{d1:+.3f} [")
    assert rows[1] == ["chain only", rows[0][1], "—"]


def test_the_table_command_prints_the_paired_rows(tmp_path):
    for name, counts in (("a", A), ("b", B)):
        (tmp_path / f"{name}.json").write_text(json.dumps(_report(counts)))
    out = subprocess.run([sys.executable, "-m", "bench", "peers", "table", "--eval", f"a={tmp_path / 'a.json'}",
                          "--eval", f"b={tmp_path / 'b.json'}"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "| drafter − a | chain Δτ [95%] |" in out.stdout and "| b | +" in out.stdout
