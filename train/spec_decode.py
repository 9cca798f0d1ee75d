"""The target-only greedy baseline that speculative decoding is measured against.

Speculative decoding itself is the exported model's `spec_generate` (train/modeling_dflash.py):
the drafter drafts B-1 tokens from [last token, MASK x (B-1)] in one forward over the verified
context's tapped states; the target verifies the block in one forward; the longest prefix
matching the target's greedy choice is accepted plus the target's own next token (the bonus). The
tapped states of the accepted tokens become new drafter context; the last token's own state is
only known after the next verify, as at training time (context strictly before the anchor).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from train.modeling_dflash import cache_kwarg, cache_of

__all__ = ["DecodeResult", "target_generate"]


@dataclass
class DecodeResult:
    tokens: list[int]
    target_forwards: int
    seconds: float


@torch.inference_mode()
def target_generate(model, prompt: list[int], *, max_new_tokens: int,
                    eos: set[int]) -> DecodeResult:
    """Plain greedy decoding with a KV cache: one target forward per token."""
    t0 = time.perf_counter()
    ids = torch.tensor([prompt], device=model.device)
    out, kw = model(ids, use_cache=True), cache_kwarg(model)
    cache, forwards, tokens = cache_of(out), 1, []
    nxt = int(out.logits[0, -1].argmax())
    while True:
        tokens.append(nxt)
        if nxt in eos or len(tokens) >= max_new_tokens:
            break
        out = model(torch.tensor([[nxt]], device=model.device), use_cache=True, **{kw: cache})
        cache, forwards = cache_of(out), forwards + 1
        nxt = int(out.logits[0, -1].argmax())
    return DecodeResult(tokens, forwards, time.perf_counter() - t0)
