"""The default dataset: math, code and everyday chat, written by the target.

    python -m extract.regenerate --recipe default --out DIR --recipe-samples 100000
    # one process per GPU (each waits for the others at two barriers, through files in DIR):
    for g in 0 1; do CUDA_VISIBLE_DEVICES=$g python -m extract.regenerate --recipe default \\
        --out DIR --shard $g/2 & done; wait

Stages (each resumable; a stage's marker file is written when it is complete):
1. invent: user prompts made up by the target (Magpie) for invented math word problems, Python
   tasks and everyday chat, several steering openings per domain (`OPENINGS`), sampled at T 1.0,
   at most `INVENT_TOKENS` tokens each (fewer where --max-new-tokens is smaller);
2. select: near-duplicate prompts are dropped (extract.regenerate.dedup), also those echoing a
held-out
   prompt (GSM8K[:100], HumanEval, the chat set); every shard computes the same selection;
3. answer: every kept prompt answered greedily (the drafter is judged on greedy decoding), and the
   packaged math prompts (GSM8K minus held-out, GPQA, AIME) also `MATH_SAMPLED` times at T 0.7;
   a `LONG_SHARE` of the invented math and code prompts is answered with up to --recipe-long-tokens
   new tokens instead of --max-new-tokens (see LONG_SHARE for why);
4. merge (shard 0): DIR/train.jsonl (all domains) and DIR/recipe.json (counts per domain, config).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import torch

from cache_format.layout import atomic_write_bytes
from chat.prompts import heldout_user_texts, train_prompts
from extract.regenerate.answers import regenerate
from extract.regenerate.config import RegenConfig
from extract.regenerate.dedup import near_duplicates
from target.loader import load_target

__all__ = ["LONG_SHARE", "LONG_TOKENS", "OPENINGS", "SHARES", "build_recipe", "interleave"]

# Steering openings (the start of each invented user message) per domain.
OPENINGS: dict[str, tuple[str, ...]] = {
    "math": ("Solve this math word problem step by step:", "A store sells", "Calculate",
             "If a train travels", "What is the probability that", "Find the value of x if"),
    "code": ("Write a Python function", "Write a Python program that", "Implement a Python class",
             "How do I use Python to", "Explain what this Python code does:",
             "Fix the bug in this Python function:"),
    "chat": ("Can you explain", "What are some tips for", "Write a short story about", "How do I",
             "What is the difference between", "Help me write an email",
             "Give me advice on", "Why do",
             "Write a poem about", "What should I know about", "Describe", "I'm planning",
             # no opening: the target's own idea of a request reads most like people's everyday ones
             ""),
}
SHARES = {"math": 0.35, "code": 0.30, "chat": 0.35}  # of all samples
MATH_SAMPLED = 3  # extra sampled answers per packaged math prompt
OVERDRAW = 1.4  # invented prompts per kept prompt (duplicates are dropped)
INVENT_TOKENS = 128  # a user message; the answers get --max-new-tokens
# Long answers: served decoding runs well past the first 256 tokens of an answer, where the context
# is longer and the text (worked solutions, whole programs) more predictable; a drafter trained only
# on short answers never sees those positions. One peer measured +0.49 acceptance length training at
# 4,096 tokens against 512. Math and code are where the target writes long answers of its own (its
# chat answers end early), and they are the domains of GSM8K and HumanEval; a tenth of each keeps
# the extraction and training cost of the long tail bounded (a 4,096-token answer costs ~14 short
# ones). A small target's long answers often end in loops (seen in the packaged one's chat answers
# past ~150 tokens); they are kept: they are what the target does when served, and what its drafter
# must follow.
LONG_SHARE = {"math": 0.10, "code": 0.10}  # of each domain's kept invented prompts
LONG_TOKENS = 4096  # --recipe-long-tokens' default


def _wait_for(paths: list[Path], poll: float = 2.0) -> None:
    while not all(p.exists() for p in paths):
        time.sleep(poll)


def interleave(groups: list[list[str]]) -> list[str]:
    """The groups' items taking turns: the first of each group, then the second of each, ...; a
    group that runs out drops out of the turns."""
    return [g[k] for k in range(max(map(len, groups), default=0)) for g in groups if k < len(g)]


def _read_users(path: Path) -> list[str]:
    if not path.exists():
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["messages"][0]["content"] for line in f if line.strip()]


def _write_users(path: Path, conversations: list[list[dict]]) -> None:
    """A prompt file, whole or not at all (several shards may write the same one)."""
    lines = "".join(json.dumps({"messages": m}, ensure_ascii=False) + "\n" for m in conversations)
    atomic_write_bytes(path, lines.encode("utf-8"))


def build_recipe(name: str, *, out_dir: str, samples: int, long_tokens: int = LONG_TOKENS,
                 **kw) -> dict:
    """Build the recipe `name` ('default') into out_dir; kw are RegenConfig fields (shard, target,
    batch_size, max_new_tokens, seed, engine, ...); long_tokens: the long share's new-token cap (0:
    no long share). Returns the recipe summary (shard 0) or {}."""
    if name != "default":
        raise ValueError(f"--recipe {name!r}: the only recipe is 'default'")
    if long_tokens < 0:
        raise ValueError(f"--recipe-long-tokens {long_tokens}: must be >= 0 (0: no long answers)")
    d = Path(out_dir)
    (d / "parts").mkdir(parents=True, exist_ok=True)
    i, n = kw.get("shard", (0, 1))
    base = {k: v for k, v in kw.items() if k in {f.name for f in dataclasses.fields(RegenConfig)}}
    limit = kw.get("limit", 0)  # a quick trial: only the first N packaged math prompts
    for k in ("prompts", "num_samples", "temperature", "invent", "invent_prefix", "limit", "out"):
        base.pop(k, None)  # the recipe sets these per stage
    seed = base.pop("seed", 0)
    max_new = base.pop("max_new_tokens", 256)
    invent_tokens = min(INVENT_TOKENS, max_new)
    packaged = train_prompts()[: limit or None]
    engine = base.get("engine", "auto")
    loaded = None if engine == "openai" else load_target(base.get("target", ""),
                                                         device=torch.device(
        "cuda" if torch.cuda.is_available() else "cpu"))
    targets = {dom: int(samples * share) for dom, share in SHARES.items()}
    targets["math"] = max(0, targets["math"] - len(packaged) * (1 + MATH_SAMPLED))

    _invent(d, targets, (i, n), base, loaded, seed=seed, max_new_tokens=invent_tokens)
    long_share = LONG_SHARE if long_tokens else {}
    drops = _select(d, targets, (i, n), packaged, long_share)
    jobs = _answer(d, (i, n), packaged, base, loaded, seed=seed, max_new_tokens=max_new,
                   long_tokens=long_tokens, long_domains=tuple(long_share))
    if i != 0:
        return {}
    _wait_for([d / "parts" / f"answer.{s}.done" for s in range(n)])
    counts, chars = _merge(d, jobs, n)
    summary = {"recipe": name, "samples_requested": samples, "samples_by_domain": counts,
               "samples": sum(counts.values()), "answer_chars_by_domain": chars, "selection": drops,
               "packaged_math_prompts": len(packaged), "openings": OPENINGS, "shares": SHARES,
               "math_sampled_per_packaged_prompt": MATH_SAMPLED,
               "invent_max_new_tokens": invent_tokens, "long_share": long_share,
               "long_max_new_tokens": long_tokens,
               "config": {**{k: (list(v) if isinstance(v, tuple) else v) for k, v in base.items()},
                          "seed": seed, "max_new_tokens": max_new}}
    (d / "recipe.json").write_text(json.dumps(summary, indent=1))
    print(f"recipe {name}: {summary['samples']} samples " + ", ".join(f"{k} {v}"
                                                                      for k, v in counts.items())
          + "; near-duplicates dropped: " + ", ".join(f"{k} {v['near_duplicates']}"
                                                      for k, v in drops.items()))
    return summary


def _invent(d: Path, targets: dict[str, int], shard: tuple[int, int], base: dict, loaded,
            *, seed: int, max_new_tokens: int) -> None:
    """Stage 1: each opening invents an equal share of its domain's prompts (OVERDRAW of them, as
    duplicates are dropped next); then wait for every shard's invention."""
    i, n = shard
    for dom, openings in OPENINGS.items():
        per = math.ceil(targets[dom] * OVERDRAW / len(openings))
        for j, opening in enumerate(openings):
            if per:
                out = d / "parts" / f"invent_{dom}{j}.{i}.jsonl"
                regenerate(RegenConfig(out=str(out), invent=per,
                                       invent_prefix=opening, temperature=1.0,
                                       max_new_tokens=max_new_tokens,
                                       seed=seed * 1000 + j, **base), loaded=loaded)
    atomic_write_bytes(d / "parts" / f"invent.{i}.done", json.dumps({"shard": [i, n]}).encode())
    _wait_for([d / "parts" / f"invent.{s}.done" for s in range(n)])


def _select(d: Path, targets: dict[str, int], shard: tuple[int, int], packaged: list,
            long_share: dict[str, float]) -> dict[str, dict[str, int]]:
    """Stage 2, the same on every shard (a pure function of the files): near-duplicates of each
    other, of the held-out prompts and of the packaged ones dropped; each domain's prompts written
    (shard 0, or whichever finds the file missing), the last `long_share` of them to
    DOM_long_prompts.jsonl. Returns the counts per domain."""
    i, n = shard
    held = heldout_user_texts()
    seen: list[str] = [m[0]["content"] for m in packaged]
    drops = {}
    for dom, openings in OPENINGS.items():
        # the openings take turns, so the cut to the domain's target keeps an equal share of each
        # (in opening order the overdraw's cut fell on the last openings: the 100K file has no chat
        # prompt of "Describe" or "I'm planning")
        cands = interleave([[p for s in range(n)
                             for p in _read_users(d / "parts" / f"invent_{dom}{j}.{s}.jsonl")
                             # an empty invention asks nothing
                             if p.strip()] for j in range(len(openings))])
        drop = set(near_duplicates(cands, reference=held + seen))
        kept = [p for k, p in enumerate(cands) if k not in drop][: targets[dom]]
        n_long = math.ceil(len(kept) * long_share.get(dom, 0.0))
        drops[dom] = {"invented": len(cands), "near_duplicates": len(drop), "kept": len(kept),
                      "long": n_long}
        seen += kept
        parts = {f"{dom}_prompts.jsonl": kept[: len(kept) - n_long]}
        if dom in long_share:
            parts[f"{dom}_long_prompts.jsonl"] = kept[len(kept) - n_long:]
        for name, ps in parts.items():
            if i == 0 or not (d / name).exists():
                _write_users(d / name, [[{"role": "user", "content": p}] for p in ps])
    return drops


def _answer(d: Path, shard: tuple[int, int], packaged: list, base: dict, loaded, *, seed: int,
            max_new_tokens: int, long_tokens: int, long_domains: tuple[str, ...]) -> list[tuple]:
    """Stage 3: this shard's share of every prompt file answered; returns the jobs (tag, prompts,
    samples per prompt, temperature, new-token cap) in merge order."""
    i, n = shard
    packaged_path = d / "packaged_math_prompts.jsonl"
    _write_users(packaged_path, packaged)
    jobs = [("math_packaged_greedy", packaged_path, 1, 0.0, max_new_tokens),
            ("math_packaged_sampled", packaged_path, MATH_SAMPLED, 0.7, max_new_tokens)]
    jobs += [(f"{dom}_invented", d / f"{dom}_prompts.jsonl", 1, 0.0, max_new_tokens)
             for dom in OPENINGS]
    jobs += [(f"{dom}_long", d / f"{dom}_long_prompts.jsonl", 1, 0.0, long_tokens)
             for dom in long_domains]
    for tag, prompts, k, temp, cap in jobs:
        if not prompts.stat().st_size:
            # a long share rounded to no prompts (a small trial): _write_users wrote an empty file
            continue
        regenerate(RegenConfig(out=str(d / "parts" / f"{tag}.{i}.jsonl"), prompts=str(prompts),
                               num_samples=k,
                               temperature=temp, max_new_tokens=cap, seed=seed + 1, **base),
                               loaded=loaded)
    atomic_write_bytes(d / "parts" / f"answer.{i}.done", json.dumps({"shard": [i, n]}).encode())
    return jobs


def _merge(d: Path, jobs: list[tuple], n: int) -> tuple[dict[str, int], dict[str, int]]:
    """Stage 4 (shard 0): every shard's answers into train.jsonl (written whole, then renamed), each
    record tagged with its domain; empty answers left out. Returns samples and answer characters per
    domain."""
    counts: dict[str, int] = {}
    chars: dict[str, int] = {}
    tmp = d / "train.jsonl.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for tag, *_ in jobs:
            dom = tag.split("_")[0]
            for s in range(n):
                if not (d / "parts" / f"{tag}.{s}.jsonl").exists():
                    continue  # a job with no prompts
                with open(d / "parts" / f"{tag}.{s}.jsonl", encoding="utf-8") as src:
                    for line in src:
                        r = json.loads(line)
                        if not r["messages"][-1]["content"].strip():
                            continue  # an empty answer teaches nothing
                        r["domain"] = dom
                        f.write(json.dumps(r, ensure_ascii=False) + "\n")
                        counts[dom] = counts.get(dom, 0) + 1
                        chars[dom] = chars.get(dom, 0) + len(r["messages"][-1]["content"])
    tmp.replace(d / "train.jsonl")
    return counts, chars
