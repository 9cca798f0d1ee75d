"""Answers that fall into a loop, cut where the loop starts.

A small target's long greedy answers often end by repeating themselves, paragraph after paragraph,
until the token cap. Each repetition after the first is trivially predictable: it spends training
steps on copying and makes the held-out decoding figures read high. In the packaged SmolLM2's
100K recipe 9.8% of the answers' characters are lines already written earlier in the same answer
(docs/BENCHMARKS.md). A loop here is a pair of consecutive non-blank lines, each at least
`min_chars` long, that already appeared as a consecutive pair earlier in the answer; the answer is
cut before the pair's second appearance, so one copy of the looping text stays. A single repeated
line (a `return` in two functions, a refrain) is not a loop. Only the last assistant turn is cut:
later turns were answered after the whole of an earlier one.

The cut answer still ends with the template's end-of-turn token, which the target did not write
there: one label in an answer, against the loop's hundreds of copied ones.

    python -m extract.regenerate.loops --data answers.jsonl --out cut.jsonl [--min-chars 20]
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from chat.conversations import BadRecord, jsonl_records

__all__ = ["cut_conversation", "loop_start"]


def loop_start(text: str, *, min_chars: int = 20) -> int:
    """The character offset where `text`'s first loop starts (its second copy of a recurring pair of
    consecutive non-blank lines, each >= min_chars after stripping), or len(text) if none."""
    seen: set[tuple[str, str]] = set()
    prev: tuple[str, int] | None = None  # the previous non-blank line: (stripped, its start offset)
    at = 0
    for line in text.splitlines(keepends=True):
        s = line.strip()
        if s:
            if prev is not None and len(prev[0]) >= min_chars and len(s) >= min_chars:
                if (prev[0], s) in seen:
                    return prev[1]
                seen.add((prev[0], s))
            prev = (s, at)
        at += len(line)
    return len(text)


def cut_conversation(messages: list[dict], *, min_chars: int = 20) -> tuple[list[dict], int, int]:
    """(messages with the last assistant turn cut at its first loop, characters cut, characters
    that answer had)."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
    if last < 0:
        return messages, 0, 0
    text = messages[last]["content"]
    cut = loop_start(text, min_chars=min_chars)
    if cut == len(text):
        return messages, 0, len(text)
    kept = text[:cut].rstrip()
    return ([*messages[:last], {**messages[last], "content": kept}, *messages[last + 1:]],
            len(text) - len(kept), len(text))


@click.command()
@click.option("--data", required=True,
              help="Conversations (JSONL, or .jsonl.gz): one {\"messages\": [...]} a line; "
              "other fields are kept.")
@click.option("--out", required=True,
              help="The same conversations with looping answers cut (JSONL).")
@click.option("--min-chars", default=20, show_default=True,
              help="Shortest line (stripped) that can make a loop.")
def main(data: str, out: str, min_chars: int) -> None:
    """Cut each conversation's last answer where it starts repeating itself."""
    if min_chars < 1:
        raise click.ClickException(f"--min-chars must be >= 1, got {min_chars}")
    n = cut_n = chars = dropped = 0
    tmp = Path(out + ".partial")
    try:
        with tmp.open("w", encoding="utf-8") as w:
            for i, rec in jsonl_records(data):
                try:
                    new, gone, answer = cut_conversation(rec["messages"], min_chars=min_chars)
                except (ValueError, KeyError, TypeError, AttributeError) as e:
                    raise click.ClickException(f"{data}:{i + 1}: not a conversation record "
                                               f"({type(e).__name__}: {e})") from None
                n, chars, dropped, cut_n = n + 1, chars + answer, dropped + gone, cut_n + (gone > 0)
                w.write(json.dumps({**rec, "messages": new}, ensure_ascii=False) + "\n")
    except BadRecord as e:
        tmp.unlink(missing_ok=True)
        raise click.ClickException(str(e)) from None
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise click.ClickException(f"{data}: {e.strerror or e}") from None
    except click.ClickException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(out)  # complete, or not there at all
    click.echo(f"{n} conversations, {cut_n} answers cut at a loop, {dropped / max(1, chars):.1%} "
               f"of the answers' characters dropped -> {out}")


if __name__ == "__main__":
    main()
