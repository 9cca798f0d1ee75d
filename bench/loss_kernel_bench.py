"""The draft loss over the frozen lm_head, forward and backward of one step's rows: ours (train.losses'
fused chunks: the gradient formed in the forward pass, its softmax compiled) against Liger's kernels.

    python -m bench loss-kernel --rows 114688 --hidden 576 --vocab 12288 --chunks 2048,8192

Paths, each timed over all rows with per-row loss weights (the decay weights make every row's weight
differ, so a plain mean or sum of the rows' losses is not the loss trained):
- ours@C: train.losses' fused path in chunks of C rows (what --loss-chunk C trains with);
- liger-ce@C: the same chunks, with Liger's cross-entropy kernel forming each chunk's loss, hits and
  gradient in place of ours (train.liger_ce: what --ce-kernel liger trains with);
- liger-flce: Liger's fused linear cross-entropy, reduction "none" (its chunk size is its own).
Prints one JSON line: each path's median milliseconds, and its largest differences from ours@first
chunk (row losses, the rows' gradient relative to its norm, hits). Liger's paths need its package
and a GPU (they are left out, and said so, where either is missing).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from bench.common import synced_times
from train.liger_ce import liger_available
from train.losses import _chunk_grad, _row_losses

__all__ = ["main"]


def _paths(a: argparse.Namespace, liger: bool, compiled: bool) -> dict:
    """name -> fn(rows, lm_head, labels) -> (row losses [n], hits [n])."""
    def chunks(kernel: str, c: int):
        grad = _chunk_grad(kernel, compiled)
        return lambda r, w, y: _row_losses(r, w, y, None, 0.0, "kl", 0.0, c, "fused", grad)

    out = {f"ours@{c}": chunks("torch", c) for c in a.chunks}
    if liger:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        out |= {f"liger-ce@{c}": chunks("liger", c) for c in a.chunks}

        def flce(r, w, y):
            o = liger_fused_linear_cross_entropy(r, w, y, reduction="none", return_token_accuracy=True)
            return o.loss, o.token_accuracy > 0
        out["liger-flce"] = flce
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=114688, help="supervised rows of one step (the preset's: 16,384 "
                    "tokens x 8 slots, 7 of them supervised)")
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--vocab", type=int, default=12288, help="the draft vocabulary")
    ap.add_argument("--chunks", type=lambda s: [int(x) for x in s.split(",")], default=[2048, 8192])
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    liger = dev.type == "cuda" and liger_available()
    g = torch.Generator().manual_seed(0)
    lm_head = (torch.randn(a.vocab, a.hidden, generator=g) / a.hidden ** 0.5).to(dev, dtype)
    base = torch.randn(a.rows, a.hidden, generator=g).to(dev, dtype)
    labels = torch.randint(0, a.vocab, (a.rows,), generator=g).to(dev)
    weights = torch.rand(a.rows, generator=g).to(dev)  # per-row loss weights, as the decay gives
    report = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "rows": a.rows,
              "hidden": a.hidden, "vocab": a.vocab, "dtype": str(dtype), "liger": liger, "ms": {}, "vs_ours": {}}
    ref = None
    for name, fn in _paths(a, liger, dev.type == "cuda").items():
        rows = base.clone().requires_grad_(True)

        def step(fn=fn, rows=rows):
            rows.grad = None
            loss, hit = fn(rows, lm_head, labels)
            ((loss * weights).sum() / weights.sum()).backward()
            return loss.detach().float(), rows.grad.float(), hit

        times, (loss, grad, hit) = synced_times(step, dev, a.reps + 2)
        report["ms"][name] = 1e3 * statistics.median(times[2:])
        if ref is None:
            ref = (loss, grad, hit)
        report["vs_ours"][name] = {"loss_max_abs": float((loss - ref[0]).abs().max()),
                                   "grad_rel": float((grad - ref[1]).norm() / ref[1].norm()),
                                   "hits_differ": int((hit != ref[2]).sum())}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
