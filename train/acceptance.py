"""Teacher-forced acceptance along a known greedy continuation, and the decode that it implies.

Training reports sim_tau: the drafter's expected acceptance at anchors drawn uniformly over the
responses. Speculative decoding does not visit anchors uniformly: after a rejection the next anchor
is the token the drafter just got wrong, a harder place than average. To tell that selection apart
from a difference of data, `train.eval --teacher-forced` drafts a block at *every* anchor of the
target's own greedy continuation of each held-out prompt:

- the mean over all anchors (with a full block ahead) is sim_tau's counterpart on those prompts;
- `decode_chain` walks the same per-anchor acceptances the way decoding does (accept, jump past
  the accepted tokens and the bonus token, draft again) and gives decoding's τ back, which checks
  that the two paths agree.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from target.loader import capture

__all__ = ["decode_chain", "draft_checks", "leading_matches", "per_response_tau",
           "teacher_forced_accepts", "vocab_rejections"]


def leading_matches(draft: list[int], truth: list[int]) -> int:
    """How many draft tokens match `truth` from the start (at most len(truth))."""
    n = 0
    for d, t in zip(draft, truth):
        if d != t:
            break
        n += 1
    return n


def decode_chain(accepts: list[int], new_tokens: int) -> list[int]:
    """Tokens emitted per target forward when decoding walks the per-anchor acceptances.

    accepts[j] is the number of draft tokens accepted at the anchor new[j] (the j-th generated
    token, known once the forward before it is verified). The prefill's forward emits new[0]; each
    later forward at anchor j emits the accepted drafts and the target's own next token, capped at
    what is left, and the next anchor is the last token emitted. len(result) is the number of
    target forwards; sum(result) == new_tokens.
    """
    if new_tokens <= 0:
        return []
    steps, j = [1], 0
    while j < new_tokens - 1:
        e = min(accepts[j] + 1, new_tokens - 1 - j)
        steps.append(e)
        j += e
    return steps


def per_response_tau(accepted: list[list[int]]) -> float | None:
    """τ as the DFlash reference benchmark counts it: per response, the mean tokens emitted per
    drafting step (accepted drafts plus the bonus), the prefill's forward and its one token left
    out; then the mean over responses. accepted: per response, tokens per target forward as
    `spec_generate` returns them (the prefill's first). Responses without a drafting step are
    skipped; None when none has one. It reads above draftcache's τ (new tokens per target forward
    over all responses, prefill included), which weighs long responses and counts every forward."""
    per = [sum(a[1:]) / (len(a) - 1) for a in accepted if len(a) > 1]
    return sum(per) / len(per) if per else None


def draft_checks(accepted: list[int], block_size: int) -> list[tuple[int, bool]]:
    """(response position, rejected) of every drafted token verification decided on, in order.

    accepted: tokens per target forward as `spec_generate` returns them (the prefill's first). A
    drafting step that emits a tokens from position p checked drafts at p .. p + a - 1: those before
    the last were accepted; when a < block_size the last is the target's own token where the draft
    was rejected (a = block_size: every draft accepted, the last token the bonus, not a check). The
    prefill's token and the response's last step are left out (an end token or the length cap cuts
    that one, not a rejection).
    """
    out: list[tuple[int, bool]] = []
    pos = accepted[0] if accepted else 0
    for a in accepted[1:-1]:
        out += [(pos + i, False) for i in range(a - 1)]
        if a < block_size:
            out.append((pos + a - 1, True))
        pos += a
    return out


def vocab_rejections(accepted: list[int], new: list[int], vocab: set[int] | None,
                     block_size: int) -> tuple[int, int]:
    """(rejections, those at a token outside `vocab`) of one decoded response (`draft_checks`): at a
    rejection the response holds the target's own choice; when that token lies outside the draft
    vocabulary (None: the target's whole, nothing outside) the drafter could not have proposed
    it."""
    rejected = [p for p, r in draft_checks(accepted, block_size) if r]
    return len(rejected), sum(vocab is not None and new[p] not in vocab for p in rejected)


@torch.inference_mode()
def teacher_forced_accepts(drafter, target, prompt: list[int], new: list[int]) -> list[int]:
    """Accepted draft tokens at each anchor new[j], j < len(new) - 1, with the context as decoding
    has it there (the target's tapped states of every position before the anchor).

    drafter: an exported DFlashDraftModel (context_kv, forward, block_size, mask_token_id,
    target_layer_ids); target: the HF causal LM it drafts for. One target forward over prompt + new;
    then one drafter forward per anchor.
    """
    dev = next(target.parameters()).device
    seq = torch.tensor([prompt + new], device=dev)  # [1, L]
    with capture(target, drafter.target_layer_ids) as taps:  # {layer id: [1, L, H]}
        target(seq)
    x = torch.cat([taps[i] for i in drafter.target_layer_ids], dim=-1)  # [1, L, K*H]
    # per layer (k, v) [1, nkv, L, hd]
    ctx = drafter.context_kv(x, torch.arange(x.shape[1], device=dev)[None])
    embed = target.get_input_embeddings().weight
    head = drafter.draft_head(target.get_output_embeddings().weight)
    head = head.to(next(drafter.parameters()).dtype)  # [V or N, H], cast once, not per anchor
    bs, p = drafter.block_size, len(prompt)
    out = []
    for j in range(len(new) - 1):
        n = p + j  # the anchor's position; its context is positions 0..n-1
        block = torch.full((1, bs), drafter.mask_token_id, device=dev)
        block[0, 0] = new[j]
        hid = drafter(F.embedding(block, embed), torch.arange(n, n + bs, device=dev)[None],
                      [(k[:, :, :n], v[:, :, :n]) for k, v in ctx])  # [1, bs, H]
        # [bs-1] target ids
        draft = drafter.draft_tokens(F.linear(hid[0, 1:], head), block[0, 0]).tolist()
        out.append(leading_matches(draft, new[j + 1: j + bs]))
    return out
