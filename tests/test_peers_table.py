"""`python -m bench peers table`: the side by side's one table from train.eval reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.peers_table import decode_rows, load_reports, markdown_table

ROOT = Path(__file__).resolve().parents[1]


def _fig(tau: float, math: float, chat: float, lossless: bool = True) -> dict:
    return {"tau": tau, "tau_by_domain": {"math": math, "chat": chat}, "lossless": lossless}


def _reports() -> dict[str, dict]:
    tree = {"0": _fig(2.2, 2.4, 1.9), "512": _fig(3.8, 4.1, 3.3)}
    ours = {**_fig(2.2, 2.4, 1.9), "tree_budget": 0, "tree_curve": tree}
    peer = {**_fig(2.0, 2.25, 1.75), "tree_budget": 0}  # decoded as a chain only, no curve
    bad = {**_fig(1.5, 1.6, 1.4), "tree_curve": {"0": _fig(1.5, 1.6, 1.4), "512": _fig(2.5, 2.6, 2.4, False)}}
    return {"ours": ours, "peer": peer, "bad": bad}


def test_rows_hold_every_budget_and_domain_and_dashes_where_a_report_lacks_one():
    header, rows = decode_rows(_reports())
    assert header == ["drafter", "chain τ", "chain math", "chain chat", "tree 512 τ", "tree 512 math",
                      "tree 512 chat", "lossless"]
    # the oracle: each cell read straight from the reports by hand
    assert rows[0] == ["ours", "2.200", "2.400", "1.900", "3.800", "4.100", "3.300", "yes"]
    assert rows[1] == ["peer", "2.000", "2.250", "1.750", "—", "—", "—", "yes"]
    assert rows[2][-1] == "NO"  # one budget it decoded was not lossless
    table = markdown_table(header, rows).splitlines()
    assert len(table) == 2 + len(rows) and table[1] == "|" + "---|" * len(header)
    assert all(line.count("|") == len(header) + 1 for line in table)


def test_bad_pairs_and_files_get_one_line_naming_them(tmp_path):
    good = tmp_path / "e.json"
    good.write_text(json.dumps(_fig(2.0, 2.1, 1.9)))
    (tmp_path / "t.txt").write_text("not json")
    (tmp_path / "n.json").write_text(json.dumps({"speedup": 2.0}))
    assert load_reports([f"a={good}"])["a"]["tau"] == 2.0
    for pairs, match in (([str(good)], "give NAME=PATH"), ([f"a={tmp_path / 't.txt'}"], "t.txt: not JSON"),
                         ([f"a={tmp_path / 'n.json'}"], "n.json: not a train.eval --json report"),
                         ([f"a={good}", f"a={good}"], "a given twice")):
        with pytest.raises(ValueError, match=match):
            load_reports(pairs)


def test_the_command_prints_the_table_or_one_error_line(tmp_path):
    e = tmp_path / "eval.json"
    e.write_text(json.dumps(_reports()["ours"]))
    run = lambda *a: subprocess.run([sys.executable, "-m", "bench", "peers", "table", *a], cwd=ROOT,  # noqa: E731
                                    capture_output=True, text=True, timeout=120)
    ok = run("--eval", f"ours={e}")
    assert ok.returncode == 0 and ok.stdout.splitlines()[2].startswith("| ours | 2.200 |"), ok.stderr
    bad = run("--eval", f"ours={tmp_path / 'missing.json'}")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "missing.json" in bad.stderr
