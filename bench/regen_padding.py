"""Prompt tokens a left-padded regeneration batch holds (real + padding), in prompt order vs
shortest-first (extract.plan.generation_jobs), for the packaged training prompts and the SmolLM2
tokenizer. Each decode step reads a KV cache this wide, so the ratio bounds what the order saves.

    python bench/regen_padding.py --batch-size 512 --num-samples 4
"""

from __future__ import annotations

import argparse
import json

from cache_format.prompts import train_prompts
from cache_format.target import load_target
from extract.plan import generation_jobs


def padded_tokens(jobs: list[tuple[int, int]], lengths: list[int], batch: int) -> int:
    return sum(len(jobs[b: b + batch]) * max(lengths[i] for i, _ in jobs[b: b + batch]) for b in range(0, len(jobs), batch))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--num-samples", type=int, default=4)
    a = ap.parse_args()
    import torch

    tok = load_target("", device=torch.device("cpu")).tokenizer
    convs = train_prompts()
    texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in convs]
    lengths = [len(t) for t in tok(texts, add_special_tokens=False)["input_ids"]]
    before = [(i, k) for i in range(len(convs)) for k in range(a.num_samples)]
    after = generation_jobs(lengths, a.num_samples)
    real = sum(lengths) * a.num_samples
    p0, p1 = padded_tokens(before, lengths, a.batch_size), padded_tokens(after, lengths, a.batch_size)
    print(json.dumps({"prompts": len(convs), "jobs": len(after), "batch_size": a.batch_size,
                      "prompt_tokens": real, "min_len": min(lengths), "max_len": max(lengths),
                      "padded_tokens_prompt_order": p0, "padded_tokens_shortest_first": p1,
                      "ratio": p1 / p0}))


if __name__ == "__main__":
    main()
