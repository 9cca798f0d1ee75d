"""Near-duplicate prompts: MinHash over word shingles, banded LSH, exact Jaccard check.

Invented prompts (Magpie) repeat themselves: a small target given one opening writes the same
few requests many times, and a duplicate trains nothing new. Two prompts are near-duplicates when
the Jaccard similarity of their word 3-gram sets (lowercased, punctuation dropped) is at least
`threshold`. LSH only proposes candidate pairs; every drop is confirmed by the exact Jaccard.

As a tool, for a prompts file made elsewhere (e.g. `python -m extract.regenerate --invent N`):
empty prompts, near-duplicates of each other and echoes of any evaluation prompt are dropped:

    python -m extract.regenerate.dedup --prompts invented.jsonl --out prompts.jsonl
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from pathlib import Path

import click
import numpy as np

from cache_format.layout import atomic_write_bytes
from chat.conversations import BadRecord, read_conversations
from chat.prompts import heldout_user_texts

__all__ = ["jaccard", "near_duplicates", "out_options", "shingles", "write_prompts"]

_WORD = re.compile(r"[a-z0-9]+")
_P = (1 << 31) - 1  # a Mersenne prime: a * x + b < 2^62 fits int64 for a, b, x < 2^31


def shingles(text: str, n: int = 3) -> frozenset[str]:
    """Word n-grams of the normalized text (a text shorter than n words is one shingle)."""
    words = _WORD.findall(text.lower())
    if len(words) < n:
        return frozenset([" ".join(words)])
    return frozenset(" ".join(words[i: i + n]) for i in range(len(words) - n + 1))


def jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    return len(a & b) / max(1, len(a | b))


def _h64(s: str) -> int:
    return int.from_bytes(hashlib.blake2b(s.encode("utf-8"), digest_size=8).digest(), "little") % _P


def near_duplicates(texts: Sequence[str], *, threshold: float = 0.7, reference: Sequence[str] = (),
                    num_perm: int = 64, bands: int = 16, seed: int = 0) -> list[int]:
    """Indices of `texts` to drop: each text near-duplicating an earlier kept text, or any text of
    `reference` (e.g. held-out prompts that training data must not echo). Order decides which of
    a pair is kept: the first."""
    rows = num_perm // bands
    rng = np.random.default_rng(seed)
    a = rng.integers(1, _P, num_perm, dtype=np.int64)
    b = rng.integers(0, _P, num_perm, dtype=np.int64)
    sets = [shingles(t) for t in reference] + [shingles(t) for t in texts]
    n_ref = len(reference)
    buckets: list[dict[tuple, list[int]]] = [{} for _ in range(bands)]
    kept: list[int] = []
    drop: list[int] = []
    for j, s in enumerate(sets):
        x = np.array([_h64(g) for g in s], dtype=np.int64)  # [n shingles]
        sig = ((np.outer(a, x) + b[:, None]) % _P).min(axis=1)  # [num_perm]: MinHash signature
        keys = [tuple(sig[k * rows: (k + 1) * rows]) for k in range(bands)]
        cands = {c for k, key in enumerate(keys) for c in buckets[k].get(key, ())}
        if j >= n_ref and any(jaccard(s, sets[c]) >= threshold for c in cands):
            drop.append(j - n_ref)
            continue
        kept.append(j)
        for k, key in enumerate(keys):
            buckets[k].setdefault(key, []).append(j)
    return drop


def _first_users(path: Path) -> list[str]:
    """The first user message of each conversation of a prompts file ("" where there is none); a bad
    line stops with chat.conversations' one-line error naming file and line."""
    try:
        return [next((m["content"] for m in msgs if m["role"] == "user"), "")
                for _, msgs in read_conversations(path, skip_bad=False, require_assistant=False,
                                                  allow_empty=True)]
    except BadRecord as e:
        raise click.ClickException(str(e)) from None


def out_options(command):
    """--out and --limit of the tools that write a prompts file with write_prompts."""
    command = click.option("--limit", default=0, show_default=True, type=click.IntRange(min=0),
                           help="Keep at most N prompts (0: all).")(command)
    return click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path),
                        help="Prompts file to write (one user turn a line), for `python -m "
                        "extract.regenerate --prompts`.")(command)


@click.command()
@click.option("--prompts", required=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A JSONL of conversations; each one's first user message is the prompt.")
@out_options
def main(prompts: Path, out: Path, limit: int) -> None:
    """Drop empty prompts, near-duplicates and echoes of the evaluation's prompts."""
    texts = [t.strip() for t in _first_users(prompts)]
    cands = [t for t in texts if t]
    kept, dropped = write_prompts(cands, out, limit)
    click.echo(f"{kept} prompts into {out} ({len(texts)} read, {len(texts) - len(cands)} empty, "
               f"{dropped} near-duplicates dropped)")


def write_prompts(texts: Sequence[str], out: Path, limit: int = 0) -> tuple[int, int]:
    """A prompts file (one user turn a line, written whole) of `texts` less their near-duplicates
    and echoes of any evaluation prompt, the first `limit` kept (0: all). Returns (kept,
    dropped)."""
    drop = set(near_duplicates(texts, reference=heldout_user_texts()))
    kept = [t for k, t in enumerate(texts) if k not in drop][: limit or None]
    lines = "".join(json.dumps({"messages": [{"role": "user", "content": t}]}, ensure_ascii=False)
                    + "\n" for t in kept)
    atomic_write_bytes(out, lines.encode("utf-8"))
    return len(kept), len(drop)


if __name__ == "__main__":
    main()
