"""Wall time of E epochs on G GPUs: the seeds' coupled layout vs draftcache's decoupled one.

    python -m bench layout-model --tokens 1.6e9 --epochs 6 --extract-tok-s 29831 --train-pos-s 36023 \
        --positions-per-token 4.0 [--store STORE --num-anchors 512 --block-size 16]

Coupled (the seeds: 6 target + 2 drafter GPUs joined by queues) recomputes the target every epoch
at its measured end-to-end rate (13.5K tok/s on 8 GPUs). Decoupled extracts once on all G GPUs,
then trains every epoch on all G GPUs from the store:

    coupled   = E * N / seeds_tok_s
    decoupled = N / (G * s_x * extract_tok_s) + E * N * q / (G * s_t * train_pos_s)

with q draft positions per token (anchors x block / tokens; --store computes it from the loss
masks) and s_x, s_t the measured scaling efficiencies at G GPUs (1.0 = linear). Inputs are
measured per-GPU rates (docs/BENCHMARKS.md); the output is a model, not a measurement.
"""

from __future__ import annotations

import argparse
import json


def positions_per_token(store: str, num_anchors: int, block_size: int) -> float:
    """q = sum over samples of (anchors drawn x block size) / total tokens, from the loss masks."""
    from bench.common import checked_store

    r = checked_store(store)
    draft = tokens = 0
    for s in r.get_batch(r.sample_ids):
        m = s.loss_mask.bool()
        valid = int((m[:-1] & m[1:]).sum())  # anchor p needs p and p+1 supervised
        draft += min(num_anchors, valid) * block_size
        tokens += len(m)
    return draft / max(1, tokens)


def wall_times(*, tokens: float, epochs: int, gpus: int, extract_tok_s: float, train_pos_s: float, q: float,
               seeds_tok_s: float, scale_x: float, scale_t: float) -> dict[str, float]:
    extract = tokens / (gpus * scale_x * extract_tok_s)
    train = epochs * tokens * q / (gpus * scale_t * train_pos_s)
    coupled = epochs * tokens / seeds_tok_s
    return {"coupled_h": coupled / 3600, "decoupled_h": (extract + train) / 3600, "extract_h": extract / 3600,
            "train_h": train / 3600, "speedup": coupled / (extract + train)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=float, required=True, help="dataset tokens N")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--extract-tok-s", type=float, required=True, help="measured, per GPU, with the store")
    ap.add_argument("--train-pos-s", type=float, required=True, help="measured, per GPU, from the store")
    ap.add_argument("--positions-per-token", type=float, default=0.0)
    ap.add_argument("--store", default="", help="compute --positions-per-token from this store's loss masks")
    ap.add_argument("--num-anchors", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seeds-tok-s", type=float, default=13_500.0)
    ap.add_argument("--scale-extract", type=float, default=1.0)
    ap.add_argument("--scale-train", type=float, default=1.0)
    a = ap.parse_args()
    q = positions_per_token(a.store, a.num_anchors, a.block_size) if a.store else a.positions_per_token
    if q <= 0:
        raise SystemExit("give --positions-per-token or --store")
    out = wall_times(tokens=a.tokens, epochs=a.epochs, gpus=a.gpus, extract_tok_s=a.extract_tok_s,
                     train_pos_s=a.train_pos_s, q=q, seeds_tok_s=a.seeds_tok_s, scale_x=a.scale_extract,
                     scale_t=a.scale_train)
    print(json.dumps({**vars(a), "positions_per_token": q, **out}))


if __name__ == "__main__":
    main()
