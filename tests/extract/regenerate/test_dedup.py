"""Near-duplicate removal against an exact pairwise Jaccard loop."""

from __future__ import annotations

import random

from extract.regenerate.dedup import jaccard, near_duplicates, shingles


def _naive(texts, reference, threshold):
    kept = [shingles(t) for t in reference]
    drop = []
    for i, t in enumerate(texts):
        s = shingles(t)
        if any(jaccard(s, k) >= threshold for k in kept):
            drop.append(i)
        else:
            kept.append(s)
    return drop


def test_matches_the_pairwise_loop_on_clear_cases():
    rng = random.Random(0)
    words = [f"w{i}" for i in range(300)]
    base = [" ".join(rng.choices(words, k=30)) for _ in range(120)]
    texts = list(base)
    for t in rng.sample(base, 40):  # near copies: one word changed at the end, case and punctuation
        w = t.split()
        texts.append((" ".join(w[:-1]) + " changed!").upper())
    rng.shuffle(texts)
    reference = [base[0], "an unrelated held out prompt about cooking dinner"]
    got = near_duplicates(texts, threshold=0.7, reference=reference)
    assert got == _naive(texts, reference, 0.7)
    assert len(got) >= 40  # every near copy (or its original, whichever came second), and base[0]


def test_shingles_normalize_and_short_texts():
    assert shingles("Hello, World!  hello world") == shingles("hello world hello WORLD")
    assert shingles("two words") == frozenset(["two words"])
    assert near_duplicates(["Write a poem.", "write a POEM", "Write a story."]) == [1]


def test_the_cli_drops_empty_repeated_and_held_out_prompts_and_names_a_bad_line(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    from chat.prompts import heldout_user_texts

    held = heldout_user_texts()[-1]  # the second turn of a two-turn held-out chat counts too
    users = ["How can I keep my basil plant alive indoors?", "  ", "how can I keep my basil plant alive indoors",
             held, "What is a good name for a black cat?"]
    src = tmp_path / "invented.jsonl"
    src.write_text("".join(json.dumps({"messages": [{"role": "user", "content": u}]}) + "\n" for u in users))
    root = Path(__file__).resolve().parents[3]
    run = lambda s, *a: subprocess.run([sys.executable, "-m", "extract.regenerate.dedup", "--prompts", str(s), "--out",
                                        str(tmp_path / "p.jsonl"), *a], capture_output=True, text=True, cwd=root,
                                       timeout=120)
    p = run(src)
    assert p.returncode == 0, p.stderr
    kept = [json.loads(x)["messages"] for x in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert kept == [[{"role": "user", "content": users[0]}], [{"role": "user", "content": users[4]}]]
    assert "5 read, 1 empty, 2 near-duplicates dropped" in p.stdout
    assert run(src, "--limit", "1").returncode == 0 and len((tmp_path / "p.jsonl").read_text().splitlines()) == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n" + json.dumps({"text": "x"}) + "\n")
    p = run(bad)
    errors = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode != 0 and len(errors) == 1 and f"{bad}:2: record has neither 'messages' nor" in errors[0]
