from __future__ import annotations

import json

from extract.regenerate import regenerate
from tests.helpers import tiny_target_dir, write_chats


def _records(path) -> dict[tuple[int, int], str]:
    out = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            assert r["messages"][-1]["role"] == "assistant"
            out[(r["prompt_index"], r["sample"])] = r["messages"][-1]["content"]
    return out


def test_shards_and_resume_reproduce_one_run(tmp_path):
    target = tiny_target_dir(tmp_path / "t", "llama")
    prompts = write_chats(tmp_path / "p.jsonl", 5)
    kw = dict(target=target, prompts=prompts, num_samples=2, temperature=0.8, max_new_tokens=6, batch_size=3, seed=1)
    assert regenerate(out=str(tmp_path / "one.jsonl"), **kw) == 10
    one = _records(tmp_path / "one.jsonl")
    assert len(one) == 10 and len(set(one.values())) > 1  # sampled, seeded per batch
    # two shards (one process per GPU) hold exactly what one run wrote
    for i in range(2):
        regenerate(out=str(tmp_path / f"s{i}.jsonl"), shard=(i, 2), **kw)
    a, b = _records(tmp_path / "s0.jsonl"), _records(tmp_path / "s1.jsonl")
    assert not a.keys() & b.keys() and {**a, **b} == one
    # a run cut short (torn last line) and rerun writes only what was missing
    lines = (tmp_path / "one.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "cut.jsonl").write_text("".join(lines[:4]) + lines[4][:7])
    assert regenerate(out=str(tmp_path / "cut.jsonl"), **kw) == 6
    assert _records(tmp_path / "cut.jsonl") == one

