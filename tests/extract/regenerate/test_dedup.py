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
