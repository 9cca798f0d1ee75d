"""Where the time of a draft-tree decoding step goes, by budget (GPU; runs on a CPU too, slowly).

    python -m bench tree-step --export E --budgets 0,32,128 --limit 12 --max-new-tokens 96

Each held-out prompt (its first user turn) is decoded by the export as served (bf16, AutoModel)
against the target at each budget (its CUDA graph captured beforehand), once untimed and once with
spec_generate's phase timings: mask (the verify's inputs: the ancestor mask over cache and tree),
verify (the target's forward), step (acceptance, context update, the next draft and its tree: one
CUDA graph), sync (the step's result to the host), compact (the target's cache cut to the committed
path). Timing synchronizes between phases, so the timed step is slower than a served one; the
untimed decode's seconds per step are printed beside it. The tree build alone (build_tree on one
block's log-probabilities over the drafter's vocabulary) is timed apart, as its share of the step.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.common import checked_export, synced_times

PHASES = ("mask", "verify", "step", "sync", "compact")


def build_seconds(d_slots: int, vocab: int, budget: int, device: torch.device, reps: int = 50) -> float:
    """Seconds of one build_tree over [d_slots, vocab] log-probabilities (the median of `reps`)."""
    from train.draft_tree import build_tree

    logp = torch.log_softmax(torch.randn(d_slots, vocab, device=device), -1)
    times, _ = synced_times(lambda: build_tree(logp, budget), device, reps + 3)
    return sorted(times[3:])[reps // 2]


def run(export: str, target: str, budgets: list[int], limit: int, max_new_tokens: int) -> list[dict]:
    from transformers import AutoModel

    from chat.prompts import evaluation_prompts
    from target.loader import chat_ids, eos_ids, load_target

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tgt = load_target(target, device=device, dtype=torch.float32)
    drafter = AutoModel.from_pretrained(export, trust_remote_code=True, dtype=torch.bfloat16).to(device).eval()
    eos = eos_ids(tgt.tokenizer, tgt.model)
    prompts = [torch.tensor([chat_ids(tgt.tokenizer, msgs[:1])], device=device)
               for _, msgs in evaluation_prompts()[:limit]]
    vocab = tgt.model.get_output_embeddings().weight.shape[0] if drafter.draft_ids is None else len(drafter.draft_ids)
    rows = []
    for budget in budgets:
        plain_s = steps = tokens = 0
        timings: dict[str, float] = {}
        # the first decode at a budget captures its CUDA graph: kept out of the untimed seconds
        drafter.spec_generate(tgt.model, prompts[0], max_new_tokens=8, eos_token_id=eos, tree_budget=budget)
        for ids in prompts:
            t0 = time.perf_counter()
            out = drafter.spec_generate(tgt.model, ids, max_new_tokens=max_new_tokens, eos_token_id=eos,
                                        tree_budget=budget)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            plain_s += time.perf_counter() - t0
            steps += out["target_forwards"] - 1  # the prefill's forward is no step
            tokens += out["sequences"].shape[1] - ids.shape[1]
            drafter.spec_generate(tgt.model, ids, max_new_tokens=max_new_tokens, eos_token_id=eos,
                                  tree_budget=budget, timings=timings)
        ms = {p: 1e3 * timings.get(p, 0.0) / max(1, steps) for p in PHASES}
        rows.append({"budget": budget, "steps": steps, "tau": tokens / max(1, steps + len(prompts)),
                     "untimed_ms_per_step": 1e3 * (plain_s - timings.get("prefill", 0.0)) / max(1, steps),
                     "timed_ms_per_step": sum(ms.values()), "ms_per_step": ms,
                     "tree_build_ms": 1e3 * build_seconds(drafter.block_size - 1, vocab, budget, device)
                     if budget else 0.0})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench tree-step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--export", required=True, help="an exported drafter directory")
    ap.add_argument("--target", default="", help="the target (default: the packaged SmolLM2 GGUF)")
    ap.add_argument("--budgets", default="0,32,128", help="node budgets, comma-separated (0: the chain)")
    ap.add_argument("--limit", type=int, default=12, help="the first N held-out prompts (domains interleaved)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--json", default="", help="also write the rows to this file")
    a = ap.parse_args()
    try:
        budgets = [int(x) for x in a.budgets.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: --budgets {a.budgets!r}: not a comma-separated list of integers") from None
    if not budgets or min(budgets) < 0 or a.limit < 1 or a.max_new_tokens < 1:
        raise SystemExit("error: --budgets must be integers >= 0, --limit and --max-new-tokens >= 1")
    if not (Path(a.export) / "modeling_dflash.py").is_file():
        raise SystemExit(f"error: {a.export}: not a draftcache export (no modeling_dflash.py)")
    checked_export(a.export)
    rows = run(a.export, a.target, budgets, a.limit, a.max_new_tokens)
    print(f"{'budget':>6} {'tau':>6} {'served ms':>9} {'timed ms':>8}  " + "  ".join(f"{p:>7}" for p in PHASES)
          + "  tree build")
    for r in rows:
        print(f"{r['budget']:>6} {r['tau']:>6.2f} {r['untimed_ms_per_step']:>9.2f} {r['timed_ms_per_step']:>8.2f}  "
              + "  ".join(f"{r['ms_per_step'][p]:>7.2f}" for p in PHASES) + f"  {r['tree_build_ms']:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
