"""The evaluation's report: its figures from the per-prompt rows that `train.eval` collects.

A row is one prompt's result for one drafter: new_tokens, target_forwards, accepted (tokens per
target forward, the prefill's first), lossless, in_draft_vocab (the target's greedy tokens that the
drafter's vocabulary holds), prompt lookup's tokens and forwards, and with --teacher-forced the
teacher-forced sums. Pure functions of those rows, beside the acceptance plot.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chat.prompts import domain_of
from train.acceptance import per_response_tau

__all__ = ["Tally", "by_source", "plot", "source_of", "summary", "tau_so_far",
           "teacher_forced_figures", "vocab_coverage"]


@dataclass
class Tally:
    """Seconds and target forwards of the baselines over the prompts so far, and of each drafter."""

    spec_s: dict[str, float]
    base_s: float = 0.0
    base_fw: int = 0
    pl_s: float = 0.0
    pl_fw: int = 0
    pl_tokens: int = 0


def summary(r: list[dict[str, Any]], hist: Counter, t: Tally, which: str, drafter, model, device, *,
            prompt_lookup: bool, teacher_forced: bool, cuda_graph: bool) -> dict[str, Any]:
    """One drafter's figures over its prompt rows `r` (the JSON contract of train.eval)."""
    new_tokens, spec_fw = sum(x["new_tokens"] for x in r), sum(x["target_forwards"] for x in r)
    return {
        "tau": new_tokens / max(1, spec_fw),
        # the DFlash reference benchmark's count (per response, drafting steps only), for figures
        # from peers
        "tau_per_response": per_response_tau([x["accepted"] for x in r]),
        "lossless": all(x["lossless"] for x in r),
        "lossless_dtype": str(model.dtype).replace("torch.", ""),
        "drafter_dtype": str(next(drafter.parameters()).dtype).replace("torch.", ""),
        "num_prompts": len(r),
        "new_tokens": new_tokens,
        "target_forwards": spec_fw,
        "baseline_target_forwards": t.base_fw,
        "tokens_per_s": new_tokens / max(t.spec_s[which], 1e-9),
        "baseline_tokens_per_s": new_tokens / max(t.base_s, 1e-9),
        "speedup": t.base_s / max(t.spec_s[which], 1e-9),
        "baseline_prompt_lookup_tau": t.pl_tokens / max(1, t.pl_fw) if prompt_lookup else None,
        "baseline_prompt_lookup_speedup": (
            (t.base_s / max(t.pl_s, 1e-9)) * (t.pl_tokens / max(1, new_tokens))
            if prompt_lookup else None),
        "acceptance_histogram": {str(k): hist[k] for k in sorted(hist)},
        **by_source(r),
        **vocab_coverage(r),
        **({"teacher_forced": teacher_forced_figures(r)} if teacher_forced else {}),
        "device": str(device),
        "cuda_graph": cuda_graph and device.type == "cuda",
        "prompts": r,
    }


def tau_so_far(rows: list[dict[str, Any]]) -> float:
    """τ over the prompts so far: new tokens per target forward, token-weighted."""
    return sum(r["new_tokens"] for r in rows) / max(1, sum(r["target_forwards"] for r in rows))


def _sums_by(rows: list[dict[str, Any]], group, keys: tuple[str, ...]) -> dict[str, list[int]]:
    """Per group(row): the sums of the rows' `keys`, in that order."""
    out: dict[str, list[int]] = {}
    for r in rows:
        acc = out.setdefault(group(r), [0] * len(keys))
        for i, k in enumerate(keys):
            acc[i] += r[k]
    return out


def _domain(row: dict[str, Any]) -> str:
    return domain_of(source_of(row["prompt"]))


def vocab_coverage(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The share of the target's greedy tokens that the drafter's vocabulary holds, overall and per
    domain: a token outside it is a certain miss, so this caps τ where the prompts bring words the
    training answers lacked (a draft vocabulary's coverage of its own training answers reads
    higher); and the share of rejections that fell on such a token."""
    keys = ("in_draft_vocab", "greedy_tokens", "rejections_outside_vocab", "rejections")
    dom = _sums_by(rows, _domain, keys)
    tot = [sum(v[i] for v in dom.values()) for i in range(len(keys))]
    share = lambda a, b: a / max(1, b)  # noqa: E731
    return {"draft_vocab_coverage": share(tot[0], tot[1]),
            "draft_vocab_coverage_by_domain": {k: share(v[0], v[1]) for k, v in dom.items()},
            # of the drafting steps that ended on a rejected draft, the share whose token the
            # drafter could not propose
            "rejections_outside_vocab": share(tot[2], tot[3]),
            "rejections_outside_vocab_by_domain": {k: share(v[2], v[3]) for k, v in dom.items()}}


def teacher_forced_figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """τ at every anchor (sim_tau's counterpart), overall and per domain; τ of the implied decode,
    and the share of prompts whose implied decode took exactly decoding's steps."""
    dom = _sums_by(rows, _domain, ("tf_anchor_sum", "tf_anchors"))
    anchors = sum(r["tf_anchors"] for r in rows)
    chain_forwards = sum(r["tf_chain_forwards"] for r in rows)
    return {"tau_all_anchors": sum(r["tf_anchor_sum"] for r in rows) / max(1, anchors),
            "anchors": anchors,
            "tau_all_anchors_by_domain": {k: v[0] / max(1, v[1]) for k, v in dom.items()},
            "tau_chain": sum(r["new_tokens"] for r in rows) / max(1, chain_forwards),
            "chain_equals_decode": (sum(r["tf_chain_equals_decode"] for r in rows)
                                    / max(1, len(rows)))}


def source_of(name: str) -> str:
    """A prompt's source: "gsm8k/3" -> "gsm8k", "file.jsonl:7" -> "file.jsonl"."""
    return name.rsplit(":", 1)[0] if ":" in name else name.split("/")[0]


def by_source(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """τ per prompt source ("gsm8k/3" -> "gsm8k", "file.jsonl:7" -> "file.jsonl"), token-weighted
    like the overall τ."""
    keys = ("new_tokens", "target_forwards", "prompt_lookup_new_tokens",
            "prompt_lookup_target_forwards")
    acc = _sums_by(rows, lambda r: source_of(r["prompt"]), keys)
    dom = _sums_by(rows, _domain, keys)
    pl = any(v[3] for v in acc.values())  # prompt lookup was run (not with --no-prompt-lookup)
    return {"tau_by_source": {k: v[0] / max(1, v[1]) for k, v in acc.items()},
            "prompt_lookup_tau_by_source": ({k: v[2] / max(1, v[3]) for k, v in acc.items()}
                                            if pl else None),
            "tau_by_domain": {k: v[0] / max(1, v[1]) for k, v in dom.items()},
            "prompt_lookup_tau_by_domain": {k: v[2] / max(1, v[3])
                                            for k, v in dom.items()} if pl else None}


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = res["acceptance_histogram"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([int(k) for k in h], list(h.values()))
    ax.set_xlabel("tokens accepted per target forward (bonus included)")
    ax.set_ylabel("target forwards")
    pl = res["baseline_prompt_lookup_tau"]
    ax.set_title(f"τ = {res['tau']:.2f} over {res['num_prompts']} prompts"
                 + (f" (prompt lookup τ = {pl:.2f})" if pl is not None else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

