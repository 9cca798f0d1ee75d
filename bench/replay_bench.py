"""The held-out tree replay: trees at every block against trees at the blocks decoding visits only
(train.replay.tree_accepts vs visited_tree_accepts), on synthetic drafts, with a dependence head
or (--rank 0) without, as the preset's plain drafter replays its held-out trees.

    python -m bench replay --samples 16 --anchors 512 --vocab 12288 --rank 256 --budget 128
    python -m bench replay --samples 16 --anchors 512 --vocab 12288 --rank 0 --budget 128

One micro-batch of SAMPLES answers with an anchor at every position, as a held-out batch has them.
The drafter's rows are random; each label is the drafter's own argmax with probability --hit (else a
random token), which sets τ. Prints one JSON line: each path's seconds (the median of --reps), the
blocks each builds trees for, and the replayed τ, which both paths must give alike (else exit 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from bench.common import synced_times
from train.anchors import IGNORE
from train.markov_head import MarkovHead
from train.replay import decode_visits, replay_counts, tree_accepts, visited_tree_accepts


def synthetic_batch(a: argparse.Namespace, dev: torch.device) -> tuple[dict, MarkovHead | None]:
    """The replay's inputs: hidden [b, N*bs, H], labels, roots, lm_head [V, H], anchors, spans."""
    g = torch.Generator().manual_seed(0)
    b, n, bs = a.samples, a.anchors, a.block_size
    hidden = torch.randn(b, n * bs, a.hidden, generator=g)
    lm_head = torch.randn(a.vocab, a.hidden, generator=g) / a.hidden ** 0.5
    labels = (hidden @ lm_head.T).argmax(-1)
    miss = torch.rand(b, n * bs, generator=g) > a.hit
    labels = torch.where(miss, torch.randint(0, a.vocab, (b, n * bs), generator=g), labels)
    labels.view(b, n, bs)[..., 0] = IGNORE
    head = MarkovHead(a.vocab, a.vocab, a.rank) if a.rank else None
    with torch.no_grad():
        for p in head.parameters() if head is not None else ():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    batch = {"hidden": hidden, "labels": labels, "roots": torch.randint(0, a.vocab, (b, n * bs), generator=g),
             "lm_head": lm_head, "anchors": torch.arange(n).expand(b, n).contiguous(),
             "spans": torch.zeros(b, n, dtype=torch.long)}
    return {k: v.to(dev) for k, v in batch.items()}, head.to(dev) if head is not None else None


def _timed(fn, reps: int, dev: torch.device) -> tuple[float, torch.Tensor]:
    """The median seconds of `reps` calls after one warm-up, and the result."""
    times, out = synced_times(fn, dev, reps + 1)
    return statistics.median(times[1:]), out


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=16, help="answers in the micro-batch")
    ap.add_argument("--anchors", type=int, default=512, help="anchors (answer positions) per answer")
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--vocab", type=int, default=12288, help="the drafter's vocabulary (the draft vocabulary)")
    ap.add_argument("--rank", type=int, default=256, help="the Markov head's rank (0: no head, the plain drafter)")
    ap.add_argument("--budget", type=int, default=128, help="tree nodes (the preset's --val-tree-budget)")
    ap.add_argument("--hit", type=float, default=0.8, help="chance a label is the drafter's argmax")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    if a.rank < 0:
        ap.error(f"--rank {a.rank}: a head's rank is 1 or more, 0 for none")
    dev = torch.device(a.device)
    x, head = synthetic_batch(a, dev)
    kw = {"block_size": a.block_size, "budget": a.budget,
          **({"head": head, "roots": x["roots"]} if head is not None else {})}
    args = (x["hidden"], x["labels"], x["lm_head"])
    t_every, every = _timed(lambda: tree_accepts(*args, **kw), a.reps, dev)
    t_visit, visited = _timed(lambda: visited_tree_accepts(*args, x["anchors"], x["spans"], **kw), a.reps, dev)
    walk = (x["anchors"], every, x["spans"])
    tau = [float(t) for t in replay_counts(*walk)]
    same = tau == [float(t) for t in replay_counts(x["anchors"], visited, x["spans"])]
    print(json.dumps({"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                      "samples": a.samples, "anchors": a.anchors, "vocab": a.vocab, "rank": a.rank,
                      "budget": a.budget, "tau": tau[0] / tau[1], "blocks": a.samples * a.anchors,
                      "visited_blocks": int(decode_visits(*walk).sum()), "seconds_every": t_every,
                      "seconds_visited": t_visit, "speedup": t_every / t_visit, "same_tau": same}))
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
