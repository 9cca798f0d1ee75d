"""Choosing the next token: greedy, or temperature + top-k + top-p sampling with per-request noise.

The static engine (extract/regenerate/static_engine.py) serves many requests in one batch whose
make-up changes every few steps (finished rows are refilled from the queue). For a request's text to
depend only on its own seed, never on which rows it shared a batch with, the sampling noise is a
pure function of (request key, step, candidate rank): a counter-based hash, not a stateful
generator. So a resumed run, or the same request on another shard or GPU, draws the same tokens (up
to the model's own numerics).

The sampling rule is HF `generate`'s: divide the logits by the temperature, keep the `top_k`
largest, keep the smallest set of those whose probability mass reaches `top_p` (the token that
crosses it included), and draw from what is left. The draw is Gumbel-max: argmax of
log p + Gumbel noise is an exact sample of p.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["choose_next", "hash_u32", "request_key", "top_p_mask", "uniform_noise"]

_M32 = 0xFFFFFFFF


def hash_u32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer on int64 tensors holding values in [0, 2^32).

    Both multipliers are below 2^31 so every product stays below 2^63: no int64 overflow, and the
    result is the same on every device.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _M32
    return x ^ (x >> 16)


def request_key(seed: int, prompt_index: int, sample: int) -> int:
    """The 32-bit noise key of one request: (seed, prompt, sample) -> key, independent of
    batching."""
    digest = hashlib.sha256(f"{seed}/{prompt_index}/{sample}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def uniform_noise(keys: torch.Tensor, steps: torch.Tensor, width: int) -> torch.Tensor:
    """Uniform (0, 1) noise [B, width] float32 from keys [B] and steps [B] (int64, < 2^32)."""
    row = hash_u32(keys ^ hash_u32(steps & _M32))  # [B]
    col = torch.arange(width, device=keys.device, dtype=torch.int64) * 0x61C88647  # [W], < 2^63
    h = hash_u32((row[:, None] + col[None, :]) & _M32)  # [B, W]
    return ((h >> 8).float() + 0.5) / float(1 << 24)  # 24 bits: exact in float32, never 0 or 1


def top_p_mask(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep-mask [B, K] for probabilities sorted descending [B, K]: the smallest prefix whose mass
    reaches top_p (the crossing token kept; the first token always kept)."""
    before = torch.cumsum(probs, dim=-1) - probs  # mass strictly before each candidate
    return before < top_p


def choose_next(logits: torch.Tensor, keys: torch.Tensor, steps: torch.Tensor, *,
                temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Next token ids [B] int64 from logits [B, V]. temperature 0: argmax (greedy).

    No host synchronisation: safe inside a captured CUDA graph.
    """
    if temperature <= 0:
        return torch.argmax(logits, dim=-1)
    k = min(top_k, logits.shape[-1]) if top_k > 0 else logits.shape[-1]
    vals, idx = torch.topk(logits.float(), k, dim=-1)  # [B, K] descending
    logp = torch.log_softmax(vals / temperature, dim=-1)  # [B, K]
    keep = top_p_mask(logp.exp(), top_p)  # [B, K]
    u = uniform_noise(keys, steps, k)  # [B, K]
    gumbel = -torch.log(-torch.log(u))
    score = torch.where(keep, logp + gumbel, torch.full_like(logp, float("-inf")))
    pick = torch.argmax(score, dim=-1, keepdim=True)  # [B, 1]
    return torch.gather(idx, 1, pick).squeeze(1)
