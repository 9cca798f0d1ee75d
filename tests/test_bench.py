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


def test_confidence_bands_split_the_checked_drafts_by_the_targets_top1():
    from bench.confidence_bench import band_rates

    top1 = [0.2, 0.6, 0.95, 1.0, 0.4, 0.9]
    checks = [(0, True), (1, False), (2, False), (3, True), (4, False), (5, True)]
    rows = band_rates(top1, checks)
    assert [r["checked"] for r in rows] == [2, 1, 3]  # 0.9 and 1.0 fall in the last band
    assert [r["rejected_share"] for r in rows] == [0.5, 0.0, 2 / 3]
    assert band_rates([0.3], []) == [{"band": [0.0, 0.5], "checked": 0, "rejected_share": None},
                                     {"band": [0.5, 0.9], "checked": 0, "rejected_share": None},
                                     {"band": [0.9, 1.0], "checked": 0, "rejected_share": None}]


def test_confidence_suite_scores_an_evaluation_and_skips_what_does_not_line_up(tmp_path):
    import torch

    from chat.prompts import heldout_prompts
    from target.loader import chat_ids, eos_ids, load_target
    from tests.helpers import tiny_target_dir
    from train.spec_decode import target_generate

    target = tiny_target_dir(tmp_path / "t")
    t = load_target(target, device=torch.device("cpu"), dtype=torch.float32)
    name, msgs = heldout_prompts()[0]
    n = len(target_generate(t.model, chat_ids(t.tokenizer, msgs), max_new_tokens=12,
                            eos=set(eos_ids(t.tokenizer, t.model))).tokens)
    steps = [1] + [3] * ((n - 1) // 3) + ([(n - 1) % 3] if (n - 1) % 3 else [])  # block 4: each step rejects its last
    ev = tmp_path / "eval.json"
    ev.write_text(json.dumps({"prompts": [{"prompt": name, "accepted": steps, "new_tokens": n},
                                          {"prompt": "nope/3", "accepted": [1, 2], "new_tokens": 3}]}))
    out = tmp_path / "c.json"
    p = _bench("confidence", "--eval", str(ev), "--target", target, "--block-size", "4", "--json", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(out.read_text())
    (dom, row), = res["domains"].items()
    assert row["prompts"] == 1 and row["positions"] == n
    assert row["checked"] == sum(r["checked"] for r in row["bands"]) == 3 * (len(steps) - 2)
    assert row["rejected_share"] == 1 / 3
    assert res["skipped"] == ["nope/3 (not a single-turn held-out prompt)"]
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    p = _bench("confidence", "--eval", str(bad), "--target", target)
    assert p.returncode != 0 and f"{bad}: not a train.eval --json result" in p.stderr and "Traceback" not in p.stderr


def test_preempt_suite_signals_a_stage_and_checks_its_rerun(tmp_path):
    p = _bench("preempt", "--runs", "1", "--stages", "regen", "--seed", "3", "--json", str(tmp_path / "p.json"))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    (res,) = json.loads((tmp_path / "p.json").read_text())["stages"]
    assert res["stage"] == "regen" and res["runs"] == 1 and res["failures"] == [] and res["failed"] == 0
    assert res["handled"] + res["outside the command"] + res["finished"] == 1
    assert _bench("preempt", "--stages", "nope").returncode != 0


def test_suites_given_a_damaged_store_or_export_end_in_one_line(tmp_path):
    """The store and export checks of training and train.eval, in every suite that reads one it is given."""
    import shutil

    from extract.config import ExtractConfig
    from extract.run import run as extract
    from tests.helpers import tiny_target_dir, train_cfg, write_chats
    from train.export import export_run
    from train.trainer import train

    store = tmp_path / "s.zarr"
    extract(ExtractConfig(store=str(store), target=tiny_target_dir(tmp_path / "t", "llama"),
                          data=write_chats(tmp_path / "c.jsonl", 12, cyclic=True), layers=(0, 2), max_len=256,
                          min_supervised=4, token_budget=1024))
    train(train_cfg(str(store), tmp_path / "run", max_steps=2))
    export = export_run(str(tmp_path / "run"), str(tmp_path / "e"))
    cfg = json.loads((export / "config.json").read_text())
    cfg["num_hidden_layers"] += 1  # a layer its weights lack
    cfg["layer_types"].append("full_attention")
    (export / "config.json").write_text(json.dumps(cfg))
    bad = tmp_path / "bad.zarr"
    shutil.copytree(store, bad)
    shard = next(p for p in sorted(bad.glob("w*/b*/hidden/c/*/*")) if p.stat().st_size > 64)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x5A
    shard.write_bytes(bytes(data))
    runs = {"codec": _bench("codec", "--store", str(bad)),
            "layout-model": _bench("layout-model", "--store", str(bad)),
            "tree-step": _bench("tree-step", "--export", str(export))}
    for name, p in runs.items():
        errors = [x for x in p.stderr.splitlines() if x.strip()]
        assert p.returncode != 0 and len(errors) == 1 and errors[0].startswith("error: "), (name, p.stderr[-1500:])
        assert "Traceback" not in p.stderr and p.stdout.strip() == "", name
    assert "hidden" in runs["codec"].stderr and "hidden" in runs["layout-model"].stderr  # the damaged array
    assert str(export) in runs["tree-step"].stderr and "layers.1." in runs["tree-step"].stderr


def test_replay_suite_times_both_paths_and_they_replay_alike():
    p = _bench("replay", "--samples", "3", "--anchors", "40", "--hidden", "16", "--vocab", "64", "--rank", "4",
               "--budget", "8", "--reps", "1", "--device", "cpu")
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout.splitlines()[-1])
    assert res["same_tau"] and res["tau"] > 1.2 and res["visited_blocks"] < res["blocks"] == 120
    assert res["seconds_every"] > 0 and res["seconds_visited"] > 0
    # without a head (--rank 0), as the preset's plain drafter replays its held-out trees
    p = _bench("replay", "--samples", "3", "--anchors", "40", "--hidden", "16", "--vocab", "64", "--rank", "0",
               "--budget", "8", "--reps", "1", "--device", "cpu")
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout.splitlines()[-1])
    assert res["same_tau"] and res["tau"] > 1.2 and res["rank"] == 0 and res["visited_blocks"] < res["blocks"]


def test_recompiles_suite_counts_the_graphs_after_each_micro_batch():
    # one row alone and two anchors among them: padded, nothing compiles after the first (unpadded,
    # more would: tests/train/test_shapes.py)
    p = _bench("recompiles", "--shape", "tiny", "--layers", "1", "--backend", "eager",
               "--shapes", "2x64x10,3x80x12,1x50x3,2x90x2")
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout.splitlines()[-1])
    assert [r["micro_batch"] for r in res["micro_batches"]] == ["2x64x10", "3x80x12", "1x50x3", "2x90x2"]
    assert [r["graphs"] for r in res["micro_batches"]] == [1, 1, 1, 1] and res["pad_shapes"]
