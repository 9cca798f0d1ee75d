"""How much of the target's own output a draft vocabulary holds, by its size (CPU is enough).

    python -m bench vocab --data docs/results/recipe-default-100k/train.jsonl.gz --every 4

A drafter with a draft vocabulary (`train --draft-vocab N`: the N most frequent answer tokens of
its training data) can never propose a token outside it, so every such token of the target's output
is a certain miss. Training reports the vocabulary's coverage of its own training answers; served
prompts bring words those answers lack (a chat answer repeats the question's "spinach"). This
counts the answer tokens of a data file (every `--every`-th record, re-tokenized as extraction does),
lets the target answer the held-out prompts greedily, and prints per vocabulary size the share of
those greedy tokens inside, per domain, beside the coverage of the training answers.

It also counts where the re-tokenized text of a greedy answer differs from the tokens the target
emitted (extraction tokenizes text, so a store holds the re-tokenized form: for SmolLM2, "\\n\\n"
before a word is emitted as one token and re-tokenized as two).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import numpy as np
import torch


def _answer_counts(path: Path, tok, every: int, vocab_size: int) -> tuple[np.ndarray, int]:
    """[V] answer-token counts of every `every`-th record of a JSONL (or .gz) conversations file."""
    counts, n = np.zeros(vocab_size, dtype=np.int64), 0
    from chat.conversations import BadRecord, jsonl_records

    try:
        for i, rec in jsonl_records(path):
            if i % every:
                continue
            msgs = rec.get("messages")
            if not isinstance(msgs, list):
                raise SystemExit(f"error: {path}:{i + 1}: not a record with 'messages'")
            for m in msgs:
                if isinstance(m, dict) and m.get("role") == "assistant":
                    ids = tok.encode(m.get("content", ""), add_special_tokens=False)
                    np.add.at(counts, ids, 1)
                    n += 1
    except BadRecord as e:
        raise SystemExit(f"error: {e}") from None
    return counts, n


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench vocab", description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="conversations JSONL (.gz) whose answers choose the vocabulary")
    ap.add_argument("--every", type=int, default=1, help="count every N-th record only")
    ap.add_argument("--sizes", default="8192,12288,16384,24576,32768", help="draft vocabulary sizes, comma-separated")
    ap.add_argument("--limit", type=int, default=48, help="held-out prompts (domains interleaved, as train.eval)")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--target", default="", help="the target (default: the packaged SmolLM2 GGUF)")
    ap.add_argument("--json", default="", help="also write the figures to this file")
    a = ap.parse_args()
    from chat.prompts import domain_of
    from target.loader import chat_ids, eos_ids, load_target
    from train.acceptance import leading_matches
    from train.eval import _answer_earlier_turns, _prompts
    from train.spec_decode import target_generate
    from train.vocab import draft_vocab

    tgt = load_target(a.target, device=torch.device("cpu"), dtype=torch.float32)
    model, tok = tgt.model, tgt.tokenizer
    sizes = [int(x) for x in a.sizes.split(",")]
    if not all(0 < n <= model.config.vocab_size for n in sizes):
        raise SystemExit(f"error: --sizes {a.sizes}: each must be in 1..{model.config.vocab_size} (the target's vocabulary)")
    counts, answers = _answer_counts(Path(a.data), tok, max(1, a.every), model.config.vocab_size)
    eos = set(eos_ids(tok, model))
    greedy: dict[str, list[int]] = {}
    retok = Counter()
    for name, msgs in _prompts("default", a.limit):
        ids = chat_ids(tok, _answer_earlier_turns(model, tok, msgs, max_new_tokens=a.max_new_tokens, eos=eos))
        out = target_generate(model, ids, max_new_tokens=a.max_new_tokens, eos=eos).tokens
        dom = domain_of(name.split("/")[0])
        greedy.setdefault(dom, []).extend(out)
        body = [t for t in out if t not in eos]
        again = tok.encode(tok.decode(body), add_special_tokens=False)
        retok["answers"] += 1
        if again != body:
            i = leading_matches(body, again)  # the first position where they differ
            retok["differ"] += 1
            retok[f"{tok.convert_ids_to_tokens(body[i:i + 1])} -> {tok.convert_ids_to_tokens(again[i:i + 2])}"] += 1
    res = {"data": a.data, "answers_counted": answers, "answer_tokens": int(counts.sum()),
           "distinct_answer_tokens": int((counts > 0).sum()), "prompts": a.limit, "max_new_tokens": a.max_new_tokens,
           "greedy_tokens": {d: len(v) for d, v in greedy.items()}, "sizes": {}}
    for size in sizes:
        ids = draft_vocab(counts, size)
        inside = np.zeros(len(counts), dtype=bool)
        inside[ids.numpy()] = True
        row = {d: float(inside[np.asarray(v)].mean()) for d, v in greedy.items()}
        row["training answers"] = float(counts[inside].sum() / max(1, counts.sum()))
        res["sizes"][size] = row
        print(f"{size:6d}  " + "  ".join(f"{k} {v:.2%}" for k, v in row.items()))
    res["retokenized"] = dict(retok)
    print(f"re-tokenized greedy answers that differ from the emitted tokens: {retok['differ']} of {retok['answers']}"
          + "".join(f"; {k} x{v}" for k, v in retok.items() if "->" in k))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
