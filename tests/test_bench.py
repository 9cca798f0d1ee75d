"""`python -m bench`: suites run with their parameter files, flags on the command line win."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.__main__ import SUITES, flags_of

ROOT = Path(__file__).resolve().parents[1]


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_params_become_flags():
    assert flags_of({"steps": 3, "compile": True, "json": False, "gpus": [1, 2], "shape": "tiny"}) == [
        "--steps", "3", "--compile", "--gpus", "1,2", "--shape", "tiny"]


def test_every_suite_has_a_params_file_with_flags_its_module_knows():
    import importlib
    import tomllib

    for name, (target, _) in SUITES.items():
        params = tomllib.loads((ROOT / "bench" / "suites" / f"{name}.toml").read_text())
        if target.endswith(".sh"):
            assert (ROOT / target).exists()
            continue
        src = Path(importlib.util.find_spec(target).origin).read_text()
        for key in params:
            assert f'"--{key.replace("_", "-")}"' in src, (name, key)


def test_a_suite_runs_with_the_given_flags_over_its_file(tmp_path):
    p = _bench("store", "--dir", str(tmp_path / "sb"), "--width", "200", "--tokens", "20000", "--writers", "1",
               "--readers", "1")
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads([x for x in p.stdout.splitlines() if x.startswith("{")][-1])
    assert [w["writers"] for w in res["write"]] == [1] and res["write"][0]["bytes"] >= 20000 * 200 * 2
    assert [x["readers"] for x in res["read"]] == [1] and res["read"][0]["aggregate_gbps"] > 0
    assert _bench("list").returncode == 0
    bad = _bench("nope")
    assert bad.returncode == 2 and "unknown suite 'nope'" in bad.stderr


def test_vocab_suite_counts_coverage_by_size(tmp_path):
    from tests.helpers import tiny_target_dir, write_chats

    target = tiny_target_dir(tmp_path / "t")
    data = write_chats(tmp_path / "d.jsonl", 20)
    out = tmp_path / "v.json"
    p = _bench("vocab", "--data", data, "--every", "1", "--target", target, "--limit", "3", "--max-new-tokens", "8",
               "--sizes", "5,40,320", "--json", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(out.read_text())
    rows = [res["sizes"][s] for s in ("5", "40", "320")]
    assert sum(res["greedy_tokens"].values()) > 0 and res["answers_counted"] == 20
    for key in rows[0]:  # a larger vocabulary holds at least what a smaller one does; the whole one holds all
        assert 0.0 <= rows[0][key] <= rows[1][key] <= rows[2][key] == 1.0, (key, rows)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\nnot json\n')
    p = _bench("vocab", "--data", str(bad), "--every", "1", "--target", target, "--limit", "1", "--sizes", "5")
    assert p.returncode != 0 and f"{bad}:2: malformed JSON" in p.stderr and "Traceback" not in p.stderr
    p = _bench("vocab", "--data", data, "--target", target, "--sizes", "5,321")
    assert p.returncode != 0 and "--sizes 5,321: each must be in 1..320" in p.stderr and "Traceback" not in p.stderr
