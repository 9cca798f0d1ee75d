"""Rendering conversations with the target's chat template into ids + loss mask."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from chat.conversations import BadRecord, prompt_key, read_conversations

__all__ = ["BadRecord", "Rendered", "read_conversations", "render", "render_many"]


@dataclass(frozen=True)
class Rendered:
    """One tokenized conversation: input_ids [L] int64, loss_mask [L] uint8 (1 = assistant
    token)."""

    sample_id: int
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    truncated: bool
    prompt_key: int
    """prompt_key(messages): equal for responses to one prompt."""


def render(sample_id: int, messages: list[dict[str, str]], tokenizer, *, max_len: int,
           template_kwargs: dict | None = None) -> Rendered:
    """Apply the chat template; loss_mask = 1 exactly on the tokens each assistant turn adds.

    Each assistant turn's span is the text its rendering adds after the prompt rendered with
    `add_generation_prompt` (so the assistant header is not supervised, but its end token is).
    Tokens are marked through character offsets, so BPE merges across a boundary cannot shift it.
    template_kwargs go to every rendering (the chat template's options, e.g. enable_thinking).
    """
    kw = template_kwargs or {}
    if not getattr(tokenizer, "chat_template", None):
        raise BadRecord("target tokenizer has no chat template; pass a JSONL rendered another way "
                        "or a chat model")
    full = tokenizer.apply_chat_template(messages, tokenize=False, **kw)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False,
                                               add_generation_prompt=True, **kw) if i else ""
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False, **kw)
        if not (full.startswith(upto) and upto.startswith(before)):
            raise BadRecord(f"sample {sample_id}: chat template is not prefix-stable; cannot "
                            f"locate assistant turn {i}")
        spans.append((len(before), len(upto)))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = torch.tensor(enc["input_ids"], dtype=torch.int64)
    offsets = torch.tensor(enc["offset_mapping"], dtype=torch.int64).reshape(-1, 2)  # [L, 2] chars
    start, end = offsets[:, 0], offsets[:, 1]
    inside = torch.zeros(len(ids), dtype=torch.bool)
    for lo, hi in spans:  # a token belongs to the turn its first character falls in
        inside |= (start >= lo) & (start < hi)
    mask = (inside & (end > start)).to(torch.uint8)
    truncated = len(ids) > max_len
    return Rendered(sample_id, ids[:max_len], mask[:max_len], truncated, prompt_key(messages))


def render_many(records: list[tuple[int, list[dict[str, str]]]], tokenizer, *, max_len: int,
                processes: int = 1, min_parallel: int = 20_000,
                template_kwargs: dict | None = None) -> list[Rendered | BadRecord]:
    """render() over (sample_id, messages) pairs, in order; each result the Rendered or the
    BadRecord it raised. From `min_parallel` records on, chunks go to `processes` spawned processes:
    the chat template and tokenizer cost about 0.5-1 ms a sample in Python, 100 s for 100K samples
    in one process, while a process starts in a few seconds."""
    if processes <= 1 or len(records) < max(min_parallel, 2):
        return [_render_or_error(sid, m, tokenizer, max_len, template_kwargs) for sid, m in records]
    size = -(-len(records) // (4 * processes))  # four chunks a process: the slow ones even out
    chunks = [records[i: i + size] for i in range(0, len(records), size)]
    work = partial(_render_chunk, tokenizer=tokenizer, max_len=max_len,
                   template_kwargs=template_kwargs)
    out: list[Rendered | BadRecord] = []
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        for part in pool.map(work, chunks):
            out.extend(_unpack(x) for x in part)
    return out


def _render_or_error(sid: int, messages: list[dict[str, str]], tokenizer, max_len: int,
                     template_kwargs: dict | None = None) -> Rendered | BadRecord:
    try:
        return render(sid, messages, tokenizer, max_len=max_len, template_kwargs=template_kwargs)
    except BadRecord as e:
        return e


def _render_chunk(records: list[tuple[int, list[dict[str, str]]]], *, tokenizer, max_len: int,
                  template_kwargs: dict | None = None) -> list[tuple]:
    """In a worker process: plain tuples and numpy arrays travel back (torch tensors would be passed
    as one shared-memory file each, 200K of them for 100K samples)."""
    out: list[tuple] = []
    for sid, m in records:
        r = _render_or_error(sid, m, tokenizer, max_len, template_kwargs)
        out.append((sid, str(r)) if isinstance(r, BadRecord) else
                   (sid, r.input_ids.numpy(), r.loss_mask.numpy(), r.truncated, r.prompt_key))
    return out


def _unpack(x: tuple) -> Rendered | BadRecord:
    if len(x) == 2:
        return BadRecord(x[1])
    sid, ids, mask, truncated, key = x
    return Rendered(sid, torch.from_numpy(np.asarray(ids)), torch.from_numpy(np.asarray(mask)),
                    truncated, key)
