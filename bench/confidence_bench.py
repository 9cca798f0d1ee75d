"""Where a drafter's drafts are rejected, by how sure the target itself is there (CPU is enough).

    python -m bench confidence --eval docs/results/lr-run-h200/eval.json --limit 24

A draft is checked against the target's greedy token. Where the target's own top-1 probability is
low (a near tie between words), its choice is the hard thing to predict; where it is near 1, a
miss is the drafter's. This reads a `train.eval --json` result (its per-prompt `accepted` steps),
lets the target answer the same held-out prompts greedily again (float32 here), scores each answer
position by the target's top-1 probability, and prints per domain the share of positions below 0.5
and the rejected share of the checked drafts in each band of that probability. A prompt whose
answer here differs in length from the evaluation's is skipped: its steps would not line up.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

BANDS = (0.0, 0.5, 0.9, 1.0)


def band_rates(top1: list[float], checks: list[tuple[int, bool]], bands: tuple[float, ...] = BANDS) -> list[dict]:
    """Per band [lo, hi) of the target's top-1 probability (the last band includes 1): the drafts
    checked at positions in it and the share of them rejected. top1[p]: the target's probability of
    its own token at response position p; checks: (position, rejected) as train.acceptance.draft_checks."""
    rows = []
    for i, (lo, hi) in enumerate(zip(bands, bands[1:])):
        last = i == len(bands) - 2
        inside = [r for p, r in checks if lo <= top1[p] < hi or (last and top1[p] == hi)]
        rows.append({"band": [lo, hi], "checked": len(inside),
                     "rejected_share": sum(inside) / len(inside) if inside else None})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench confidence", description=__doc__.split("\n\n")[0])
    ap.add_argument("--eval", required=True, help="a `train.eval --json` result (eval.json) on the held-out prompts")
    ap.add_argument("--limit", type=int, default=48, help="its first N prompts (domains interleaved, as train.eval)")
    ap.add_argument("--block-size", type=int, default=8, help="the evaluated drafter's block size")
    ap.add_argument("--target", default="", help="the target (default: the packaged SmolLM2 GGUF)")
    ap.add_argument("--json", default="", help="also write the figures to this file")
    a = ap.parse_args()
    from chat.prompts import domain_of, heldout_prompts
    from target.loader import chat_ids, eos_ids, load_target
    from train.acceptance import draft_checks
    from train.spec_decode import target_generate

    try:
        rows = json.loads(Path(a.eval).read_text())["prompts"][: a.limit]
        steps = {r["prompt"]: (r["accepted"], r["new_tokens"]) for r in rows}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"error: {a.eval}: not a train.eval --json result with per-prompt steps ({e})") from None
    messages = dict(heldout_prompts())
    tgt = load_target(a.target, device=torch.device("cpu"), dtype=torch.float32)
    model, tok = tgt.model, tgt.tokenizer
    eos = set(eos_ids(tok, model))
    per: dict[str, dict] = {}
    skipped = []
    for name, (accepted, new_tokens) in steps.items():
        if name not in messages:
            skipped.append(f"{name} (not a single-turn held-out prompt)")
            continue
        ids = chat_ids(tok, messages[name])
        out = target_generate(model, ids, max_new_tokens=new_tokens, eos=eos).tokens
        if len(out) != new_tokens:
            skipped.append(f"{name} ({len(out)} tokens here, {new_tokens} in the evaluation)")
            continue
        with torch.no_grad():
            logits = model(torch.tensor([ids + out])).logits[0, len(ids) - 1: len(ids) - 1 + len(out)]  # [n, V]
        top1 = logits.float().softmax(-1).max(-1).values.tolist()  # greedy: the target's own token is its top-1
        d = per.setdefault(domain_of(name), {"prompts": 0, "top1": [], "checks": []})
        base = len(d["top1"])
        d["prompts"] += 1
        d["top1"] += top1
        d["checks"] += [(base + p, r) for p, r in draft_checks(accepted, a.block_size)]
    res = {"eval": a.eval, "skipped": skipped, "domains": {}}
    for dom, d in per.items():
        low = sum(x < 0.5 for x in d["top1"]) / max(1, len(d["top1"]))
        rej = sum(r for _, r in d["checks"]) / max(1, len(d["checks"]))
        res["domains"][dom] = {"prompts": d["prompts"], "positions": len(d["top1"]), "share_top1_below_half": low,
                               "checked": len(d["checks"]), "rejected_share": rej,
                               "bands": band_rates(d["top1"], d["checks"])}
        bands = "  ".join(f"[{b['band'][0]}, {b['band'][1]}): {b['checked']} checked, "
                          + (f"{b['rejected_share']:.0%} rejected" if b["checked"] else "none") for b in res["domains"][dom]["bands"])
        print(f"{dom}: {d['prompts']} prompts, top-1 < 0.5 at {low:.0%} of positions, {rej:.0%} of drafts rejected; {bands}")
    for s in skipped:
        print(f"skipped {s}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
