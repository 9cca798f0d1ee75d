"""Conversations from JSONL: the record formats both stages accept, and their turns (the messages
each assistant reply answers: regeneration answers them in order, evaluation measures the last).

Accepted records, one per line:
    {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
    {"conversations": [{"from": "system"|"human"|"gpt", "value": "..."}, ...]}   (ShareGPT)
"""

from __future__ import annotations

import gzip
import hashlib
import json
import zlib
from collections.abc import Iterator
from pathlib import Path

__all__ = ["BadRecord", "TURNS", "history", "jsonl_lines", "jsonl_records", "prompt_key",
           "read_conversations", "segments"]

TURNS = ("all", "first")

_SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                   "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant"}
_ROLES = ("system", "user", "assistant")


class BadRecord(ValueError):
    """A record that cannot be used; the message names file and line."""


def _parse(line: str, where: str, require_assistant: bool = True,
           allow_empty: bool = False) -> list[dict[str, str]]:
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
    if not isinstance(msgs, list):
        raise BadRecord(f"{where}: '{'messages' if key_role == 'role' else 'conversations'}' must "
                        f"be a list of messages, got {type(msgs).__name__}")
    if not msgs:
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
        try:
            m[key_text].encode("utf-8")
        except UnicodeEncodeError as e:
            # JSON can spell a lone UTF-16 surrogate; no tokenizer takes it
            raise BadRecord(f"{where}: message {i} holds a lone surrogate {e.object[e.start]!r} at "
                            f"character {e.start} (not valid Unicode)") from None
        # answered, it trains on a reply to nothing
        if role == "user" and not m[key_text].strip() and not allow_empty:
            raise BadRecord(f"{where}: message {i} is an empty user turn")
        out.append({"role": role, "content": m[key_text]})
    if require_assistant and not any(m["role"] == "assistant" for m in out):
        raise BadRecord(f"{where}: no assistant turn")
    return out


def jsonl_lines(path: str | Path) -> Iterator[tuple[int, bytes]]:
    """(0-based line number, raw bytes) of every non-blank line of a JSONL file; a name ending in
    .gz is read through gzip. A damaged .gz raises `BadRecord` naming the file, not zlib's
    traceback."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        try:
            for lineno, raw in enumerate(f):
                if raw.strip():
                    yield lineno, raw
        except (gzip.BadGzipFile, EOFError, zlib.error) as e:
            raise BadRecord(f"{path}: not a readable gzip file ({e or type(e).__name__})") from None


def _text(raw: bytes, path: str | Path, lineno: int) -> str:
    try:
        return raw.decode("utf-8-sig" if lineno == 0 else "utf-8")  # a BOM may open the file
    except UnicodeDecodeError as e:
        # a line that is not UTF-8 is one bad record, named, not a crash
        raise BadRecord(f"{path}:{lineno + 1}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte "
                        f"{e.start} of the line)") from None


def jsonl_records(path: str | Path) -> Iterator[tuple[int, dict]]:
    """(0-based line number, record) of every non-blank line, kept as written (other fields too);
    `BadRecord` naming file and line for a line that is not UTF-8, not JSON or not a JSON object."""
    for lineno, raw in jsonl_lines(path):
        try:
            rec = json.loads(_text(raw, path, lineno))
        except json.JSONDecodeError as e:
            raise BadRecord(
                f"{path}:{lineno + 1}: malformed JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(rec, dict):
            raise BadRecord(f"{path}:{lineno + 1}: record is not a JSON object")
        yield lineno, rec


def read_conversations(path: str | Path, *, skip_bad: bool, limit: int = 0,
                       bad: list[str] | None = None, require_assistant: bool = True,
                       allow_empty: bool = False) -> Iterator[tuple[int, list[dict[str, str]]]]:
    """(sample id = 0-based line number, messages) for every usable line of a JSONL (or .jsonl.gz)
    file.

    A bad line raises `BadRecord` naming file and line, unless `skip_bad` (then its message is
    appended to `bad`). Blank lines are skipped silently. An empty user turn is bad unless
    `allow_empty` (a tool that drops and counts such prompts itself).
    """
    for lineno, raw in jsonl_lines(path):
        if limit and lineno >= limit:
            return
        try:
            yield lineno, _parse(_text(raw, path, lineno), f"{path}:{lineno + 1}",
                                 require_assistant, allow_empty)
        except BadRecord as e:
            if not skip_bad:
                raise
            if bad is not None:
                bad.append(str(e))


def segments(messages: list[dict], turns: str = "all") -> list[list[dict]]:
    """The messages of each turn, assistant messages dropped: segment t ends with user message t
    and holds what came before it since the previous user message (turns="first": the first
    only)."""
    if turns not in TURNS:
        raise ValueError(f"turns must be one of {TURNS}, got {turns!r}")
    out, cur = [], []
    for m in messages:
        if m["role"] == "assistant":
            continue
        cur.append(m)
        if m["role"] == "user":
            out.append(cur)
            cur = []
    return out[:1] if turns == "first" else out


def history(segs: list[list[dict]], answers: list[str]) -> list[dict]:
    """The messages turn len(answers) answers: every earlier segment followed by its answer, then
    its own."""
    out: list[dict] = []
    for seg, ans in zip(segs, answers):
        out += seg + [{"role": "assistant", "content": ans}]
    return out + segs[len(answers)]


def prompt_key(messages: list[dict[str, str]]) -> int:
    """A 63-bit key of a conversation's prompt: its messages before the first assistant turn."""
    head = []
    for m in messages:
        if m["role"] == "assistant":
            break
        head.append([m["role"], m["content"]])
    digest = hashlib.sha256(json.dumps(head, ensure_ascii=False).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") >> 1
