"""Rendering conversations with the target's chat template into ids + loss mask."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

from cache_format.conversations import BadRecord, read_conversations

__all__ = ["BadRecord", "Rendered", "prompt_key", "read_conversations", "render"]


@dataclass(frozen=True)
class Rendered:
    """One tokenized conversation: input_ids [L] int64, loss_mask [L] uint8 (1 = assistant token)."""

    sample_id: int
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    truncated: bool
    prompt_key: int
    """prompt_key(messages): equal for responses to one prompt."""


def prompt_key(messages: list[dict[str, str]]) -> int:
    """A 63-bit key of a conversation's prompt: its messages before the first assistant turn."""
    head = []
    for m in messages:
        if m["role"] == "assistant":
            break
        head.append([m["role"], m["content"]])
    digest = hashlib.sha256(json.dumps(head, ensure_ascii=False).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def render(sample_id: int, messages: list[dict[str, str]], tokenizer, *, max_len: int) -> Rendered:
    """Apply the chat template; loss_mask = 1 exactly on the tokens each assistant turn adds.

    Each assistant turn's span is the text its rendering adds after the prompt rendered with
    `add_generation_prompt` (so the assistant header is not supervised, but its end token is).
    Tokens are marked through character offsets, so BPE merges across a boundary cannot shift it.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise BadRecord("target tokenizer has no chat template; pass a JSONL rendered another way or a chat model")
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (full.startswith(upto) and upto.startswith(before)):
            raise BadRecord(f"sample {sample_id}: chat template is not prefix-stable; cannot locate assistant turn {i}")
        spans.append((len(before), len(upto)))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = torch.tensor(enc["input_ids"], dtype=torch.int64)
    mask = torch.zeros(len(ids), dtype=torch.uint8)
    for t, (a, b) in enumerate(enc["offset_mapping"]):
        if b > a and any(lo <= a < hi for lo, hi in spans):
            mask[t] = 1
    truncated = len(ids) > max_len
    return Rendered(sample_id, ids[:max_len], mask[:max_len], truncated, prompt_key(messages))
