"""How often a compiled drafter compiles over the micro-batch shapes of a run, and what each costs.

    python -m bench recompiles                    # the preset's drafter, padded shapes (as train --compile)
    python -m bench recompiles --no-pad-shapes    # the same micro-batches unpadded
    python -m bench recompiles --backend eager    # dynamo's own guards only (quick on a CPU)

A sequence of micro-batches as a run's length buckets give them (--shapes: rows x context length x
anchors each), among them a bucket's last one with one row and one with few anchors, each through
forward and backward of the compiled drafter as `python -m train --compile` steps it (FlexAttention
and bf16 autocast on a GPU, the dense mask on a CPU, whose FlexAttention has no backward). Prints one
JSON line: the graphs compiled after each micro-batch, its seconds (compiles included) and the total.
On a GPU the step's real cost is in `bench train`; this counts what that one leaves out: compiles.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch._dynamo.utils as dynamo_utils

from bench.common import synced_times
from bench.train_bench import drafter_config
from train.anchors import build_blocks, sample_anchors
from train.config import COMPILE_SCOPES
from train.model import DFlashDrafter, DrafterConfig
from train.step import LossSettings, forward_backward

__all__ = ["main"]

# rows x context length x anchors: varied as a run's steps are; 1x700x40 is a bucket's one-row
# leftover, 3x200x4 one with few anchors (its queries fit one 128-row tile)
SHAPES = "16x1024x400,32x512x240,24x640x300,1x700x40,64x256x120,3x200x4,40x400x200"


def micro_batch(dc: DrafterConfig, rows: int, length: int, anchors: int, g: torch.Generator,
                device: torch.device) -> dict[str, torch.Tensor]:
    """A collated micro-batch of random answers (every position supervised): taps [rows, length,
    K*H] (bf16 on a GPU) and `anchors` blocks a row, as train.data.collate lays them out."""
    bs = dc.block_size
    hidden = torch.randn(rows, length, dc.num_taps * dc.hidden_size, generator=g)
    out = {"hidden": hidden.bfloat16() if device.type == "cuda" else hidden,
           "anchors": torch.full((rows, anchors), -1, dtype=torch.long),
           "block_ids": torch.full((rows, anchors * bs), dc.mask_token_id),
           "block_pos": torch.zeros(rows, anchors * bs, dtype=torch.long),
           "labels": torch.full((rows, anchors * bs), -100)}
    for j in range(rows):
        ids = torch.randint(0, dc.vocab_size - 1, (length,), generator=g)
        a = sample_anchors(torch.ones(length, dtype=torch.uint8), anchors, g)
        bi, bp, bl = build_blocks(ids, torch.ones(length, dtype=torch.uint8), a, bs, dc.mask_token_id)
        m = len(a) * bs
        out["anchors"][j, : len(a)] = a
        out["block_ids"][j, :m], out["block_pos"][j, :m], out["labels"][j, :m] = bi, bp, bl
    return {k: v.to(device) for k, v in out.items()}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="smollm2-135m", help="the target shape the drafter is cut for")
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--shapes", default=SHAPES, help="micro-batches in turn: ROWSxLENGTHxANCHORS,...")
    ap.add_argument("--compile-scope", default="model", choices=COMPILE_SCOPES)
    ap.add_argument("--backend", default="inductor", choices=("inductor", "eager"),
                    help="eager: dynamo traces the whole drafter, nothing becomes kernels (its guards only)")
    ap.add_argument("--pad-shapes", action=argparse.BooleanOptionalAction, default=True,
                    help="train.shapes' padding (what train --compile does)")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def main() -> None:
    a = _parser().parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(a.seed)
    dc = drafter_config(a.shape, a.layers, a.block_size)
    model = DFlashDrafter(dc, torch.randn(dc.vocab_size, dc.hidden_size, generator=g) * 0.02,
                          torch.randn(dc.vocab_size, dc.hidden_size, generator=g) * 0.02).to(dev)
    if a.backend == "eager":
        model.compile(dynamic=True, backend="eager")
    else:
        model.compile_layers("default", a.compile_scope)
    loss = LossSettings(block_size=dc.block_size, gamma=4.0, use_flex=dev.type == "cuda", context_tile=0,
                        pad_shapes=a.pad_shapes)
    rows, t0 = [], time.perf_counter()
    for spec in a.shapes.split(","):
        b, length, anchors = (int(x) for x in spec.split("x"))
        batch = micro_batch(dc, b, length, anchors, g, dev)
        (secs,), _ = synced_times(lambda batch=batch: forward_backward(model, batch, loss), dev, 1)
        model.zero_grad(set_to_none=True)
        rows.append({"micro_batch": spec, "seconds": round(secs, 2),
                     "graphs": dynamo_utils.counters["stats"]["unique_graphs"]})
    print(json.dumps({"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                      "shape": a.shape, "layers": a.layers, "compile_scope": a.compile_scope, "backend": a.backend,
                      "pad_shapes": a.pad_shapes, "micro_batches": rows,
                      "graphs": rows[-1]["graphs"] if rows else 0,
                      "total_s": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
