"""Greedy DFlash speculative decoding against the real target, and the target-only baseline.

One step (DFlash block drafting): the drafter drafts B-1 tokens from
[last token, MASK x (B-1)] in one forward over the verified context's tapped states; the target
verifies the block in one forward; the longest prefix matching the target's greedy choice is
accepted plus the target's own next token (the bonus). The tapped states of the accepted tokens
become new drafter context; the last token's own state is only known after the next verify, as at
training time (context strictly before the anchor).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from train.model import DFlashDrafter

__all__ = ["DecodeResult", "dflash_generate", "target_generate"]


@dataclass
class DecodeResult:
    tokens: list[int]
    target_forwards: int
    seconds: float
    accepted: list[int] = field(default_factory=list)  # tokens emitted per target forward (bonus included)


def _layers(model):
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return base.layers


@torch.inference_mode()
def target_generate(model, prompt: list[int], *, max_new_tokens: int, eos: set[int]) -> DecodeResult:
    """Plain greedy decoding with a KV cache: one target forward per token."""
    t0 = time.perf_counter()
    ids = torch.tensor([prompt], device=model.device)
    out = model(ids, use_cache=True)
    cache, forwards, tokens = out.past_key_values, 1, []
    nxt = int(out.logits[0, -1].argmax())
    while True:
        tokens.append(nxt)
        if nxt in eos or len(tokens) >= max_new_tokens:
            break
        out = model(torch.tensor([[nxt]], device=model.device), past_key_values=cache, use_cache=True)
        cache, forwards = out.past_key_values, forwards + 1
        nxt = int(out.logits[0, -1].argmax())
    return DecodeResult(tokens, forwards, time.perf_counter() - t0, [1] * forwards)


@torch.inference_mode()
def dflash_generate(model, drafter: DFlashDrafter, layer_ids: list[int], prompt: list[int], *,
                    max_new_tokens: int, eos: set[int]) -> DecodeResult:
    """Greedy speculative decoding; the output equals target_generate's (up to float ties)."""
    t0 = time.perf_counter()
    dev, bs = model.device, drafter.c.block_size
    layers = _layers(model)
    taps: dict[int, torch.Tensor] = {}
    hooks = [layers[i].register_forward_hook(
        lambda _m, _a, o, i=i: taps.__setitem__(i, o[0] if isinstance(o, tuple) else o)) for i in layer_ids]
    try:
        out = model(torch.tensor([prompt], device=dev), use_cache=True)
        cache, forwards = out.past_key_values, 1
        tokens = [int(out.logits[0, -1].argmax())]
        ctx = _new_context(drafter, taps, layer_ids, 0, len(prompt))  # states of positions 0..P-1
        accepted = [1]
        while tokens[-1] not in eos and len(tokens) < max_new_tokens:
            n = len(prompt) + len(tokens) - 1  # position of the last (not yet verified) token
            block = torch.full((1, bs), drafter.c.mask_token_id, device=dev)
            block[0, 0] = tokens[-1]
            pos = torch.arange(n, n + bs, device=dev)[None]
            hid = drafter.draft(block, pos, ctx, None)  # no mask: context is all before the anchor
            draft = drafter.logits(hid[0, 1:]).argmax(-1)  # [bs-1]
            verify_in = torch.cat([block[0, :1], draft])[None]
            out = model(verify_in, past_key_values=cache, use_cache=True)
            cache, forwards = out.past_key_values, forwards + 1
            want = out.logits[0].argmax(-1)  # target's choice after each block token
            a = int((draft == want[:-1]).long().cumprod(0).sum())
            new = draft[:a].tolist() + [int(want[a])]
            room = max_new_tokens - len(tokens)
            for t in new[:room]:
                tokens.append(t)
                if t in eos:
                    break
            accepted.append(min(len(new), room))
            # keep target KV and drafter context only for the verified tokens (last + accepted)
            drop = cache.get_seq_length() - (n + a + 1)
            if drop > 0:
                cache.crop(-drop)  # transformers 5 takes "remove this many" (negative) only
            more = _new_context(drafter, {i: taps[i][:, : a + 1] for i in layer_ids}, layer_ids, n, n + a + 1)
            ctx = [(torch.cat([k, k2], 2), torch.cat([v, v2], 2)) for (k, v), (k2, v2) in zip(ctx, more)]
    finally:
        for h in hooks:
            h.remove()
    return DecodeResult(tokens, forwards, time.perf_counter() - t0, accepted)


def _new_context(drafter, taps, layer_ids, start: int, end: int):
    x = torch.cat([taps[i] for i in layer_ids], dim=-1)  # [1, end-start, K*H]
    pos = torch.arange(start, end, device=x.device)[None]
    return drafter.context_kv(x.to(drafter.fc.weight.dtype), pos)
