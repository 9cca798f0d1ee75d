"""The default recipe end to end on a tiny target: one process, or two shards meeting at the barriers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from extract.regenerate.dedup import jaccard, shingles
from extract.regenerate.recipe import OPENINGS, interleave
from tests.helpers import tiny_target_dir


def _args(out, target, shard="0/1"):
    return ["--recipe", "default", "--out", str(out), "--recipe-samples", "60", "--limit", "4", "--target", target,
            "--max-new-tokens", "4", "--recipe-long-tokens", "9", "--batch-size", "8", "--shard", shard]


def _shard(out, target, shard):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # two shards share the CI machine's two cores
    return subprocess.Popen([sys.executable, "-m", "extract.regenerate", *_args(out, target, shard)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _in_process(capsys, out, target) -> str:
    """The CLI in this process (one process needs no barrier partner): what it printed."""
    from extract.regenerate.__main__ import main

    main.main(_args(out, target), standalone_mode=False)
    got = capsys.readouterr()
    return got.out + got.err


def _lines(path):
    return sorted(x for x in path.read_text(encoding="utf-8").split("\n") if x)  # not splitlines: U+2028 is JSON text


def test_recipe_one_process_equals_two_shards_and_resumes(tmp_path, capsys):
    from chat.prompts import heldout_prompts

    target = tiny_target_dir(tmp_path / "t", "llama")
    _in_process(capsys, tmp_path / "one", target)
    summary = json.loads((tmp_path / "one" / "recipe.json").read_text())
    counts = summary["samples_by_domain"]
    assert set(counts) == {"math", "code", "chat"} and all(v > 0 for v in counts.values())
    records = [json.loads(x) for x in _lines(tmp_path / "one" / "train.jsonl")]
    assert len(records) == summary["samples"] == sum(counts.values())
    assert {r["domain"] for r in records} == {"math", "code", "chat"}
    assert all(r["messages"][-1]["role"] == "assistant" and r["messages"][-1]["content"] for r in records)
    # the long share: a tenth of the invented math and code prompts, answered with the long cap, no prompt twice
    assert summary["long_share"] == {"math": 0.1, "code": 0.1} and summary["long_max_new_tokens"] == 9
    for dom in ("math", "code"):
        longs = [json.loads(x)["messages"][0]["content"] for x in (tmp_path / "one" / f"{dom}_long_prompts.jsonl").open()]
        assert len(longs) == summary["selection"][dom]["long"] > 0
        answered = [r for r in records if r["messages"][0]["content"] in set(longs)]
        assert len(answered) == len(longs) and all(r["domain"] == dom for r in answered)
    held = {m[-1]["content"] for _, m in heldout_prompts()}
    users = [r["messages"][0]["content"] for r in records if r["domain"] != "math" or "prompt_index" in r]
    assert not held & set(users)
    for dom in ("code", "chat"):  # kept invented prompts are pairwise below the near-duplicate threshold
        ps = [json.loads(x)["messages"][0]["content"] for x in (tmp_path / "one" / f"{dom}_prompts.jsonl").open()]
        sh = [shingles(p) for p in ps]
        assert all(jaccard(sh[i], sh[j]) < 0.7 for i in range(len(sh)) for j in range(i))
    # every opening keeps its share (21 chat prompts over 13 openings: each opening at least one; the
    # empty opening's are checked by count), and no prompt is empty
    chat = [r["messages"][0]["content"] for r in records if r["domain"] == "chat"]
    assert summary["selection"]["chat"]["kept"] >= len(OPENINGS["chat"]) and all(p.strip() for p in users)
    assert all(any(p.startswith(o) for p in chat) for o in OPENINGS["chat"] if o)
    # two shards, one process each, meet at the barriers and write the same requests (the texts can
    # differ where float32 rounding differs with the batch's make-up and flips a near-tie)
    procs = [_shard(tmp_path / "two", target, f"{i}/2") for i in range(2)]
    for p in procs:
        assert p.wait() == 0, p.communicate()[0]
    key = lambda r: (r["domain"], r["prompt_index"], r["sample"])
    assert sorted(map(key, map(json.loads, _lines(tmp_path / "two" / "train.jsonl")))) == sorted(map(key, records))
    # a rerun resumes: nothing is generated again, the dataset is the same
    log = _in_process(capsys, tmp_path / "one", target)
    assert " 0 new tokens" in log and "written" in log
    assert all(" 0 written" in ln or ln.startswith("0 written") for ln in log.splitlines() if "written," in ln)
    assert [json.loads(x) for x in _lines(tmp_path / "one" / "train.jsonl")] == records


def test_interleave_takes_turns_and_drops_groups_that_run_out():
    groups = [["a1", "a2", "a3"], [], ["c1"], ["d1", "d2"]]
    naive, k = [], 0
    while any(k < len(g) for g in groups):  # the loop oracle: round k takes item k of every group
        naive += [g[k] for g in groups if k < len(g)]
        k += 1
    assert interleave(groups) == naive == ["a1", "c1", "d1", "a2", "d2", "a3"] and interleave([]) == []
