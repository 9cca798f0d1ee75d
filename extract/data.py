"""Conversations from JSONL, rendered with the target's chat template into ids + loss mask.

Accepted records, one per line:
    {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
    {"conversations": [{"from": "system"|"human"|"gpt", "value": "..."}, ...]}   (ShareGPT)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["BadRecord", "Rendered", "file_sha256", "read_conversations", "render"]

_SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                   "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant"}
_ROLES = ("system", "user", "assistant")


class BadRecord(ValueError):
    """A record that cannot be used; the message names file and line."""


@dataclass(frozen=True)
class Rendered:
    """One tokenized conversation: input_ids [L] int64, loss_mask [L] uint8 (1 = assistant token)."""

    sample_id: int
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    truncated: bool


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _parse(line: str, where: str) -> list[dict[str, str]]:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise BadRecord(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(rec, dict):
        raise BadRecord(f"{where}: record is not a JSON object")
    if "messages" in rec:
        msgs = rec["messages"]
        key_role, key_text, roles = "role", "content", {r: r for r in _ROLES}
    elif "conversations" in rec:
        msgs = rec["conversations"]
        key_role, key_text, roles = "from", "value", _SHAREGPT_ROLES
    else:
        raise BadRecord(f"{where}: record has neither 'messages' nor 'conversations'")
    if not isinstance(msgs, list) or not msgs:
        raise BadRecord(f"{where}: empty conversation")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or key_role not in m or key_text not in m:
            raise BadRecord(f"{where}: message {i} needs '{key_role}' and '{key_text}'")
        role = roles.get(str(m[key_role]).lower())
        if role is None:
            raise BadRecord(f"{where}: message {i} has unknown role {m[key_role]!r}")
        if not isinstance(m[key_text], str):
            raise BadRecord(f"{where}: message {i} content is not a string")
        out.append({"role": role, "content": m[key_text]})
    if not any(m["role"] == "assistant" for m in out):
        raise BadRecord(f"{where}: no assistant turn")
    return out


def read_conversations(path: str | Path, *, skip_bad: bool, limit: int = 0,
                       bad: list[str] | None = None) -> Iterator[tuple[int, list[dict[str, str]]]]:
    """(sample id = 0-based line number, messages) for every usable line.

    A bad line raises `BadRecord` naming file and line, unless `skip_bad` (then its message is
    appended to `bad`). Blank lines are skipped silently.
    """
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f):
            if limit and lineno >= limit:
                return
            if not line.strip():
                continue
            try:
                yield lineno, _parse(line, f"{path}:{lineno + 1}")
            except BadRecord as e:
                if not skip_bad:
                    raise
                if bad is not None:
                    bad.append(str(e))


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
    return Rendered(sample_id, ids[:max_len], mask[:max_len], truncated)
