"""Multi-turn regeneration: a conversation's assistant turns answered in order, each after the
regenerated history, and the partial conversations a run has made so far.

A conversation [system, user 1, assistant 1, user 2, assistant 2, user 3] has three turns. Its
assistant messages are dropped and regenerated: turn 1 answers [system, user 1]; turn 2 answers
[system, user 1, answer 1, user 2], with answer 1 the target's own; and so on. Messages between
two user messages (a system note, a tool message) stay where they were; anything after the last
user message has nothing to answer and is dropped.

Turn t of every conversation is generated in one round, so a batch engine keeps its rows full.
Until a conversation's last turn is done its answers so far are kept in OUT.turns.jsonl (one line
per answered turn, fsync'd with the output), so a killed run resumes each conversation at its next
turn; a finished conversation is one record of OUT, as a one-turn conversation always was. The
turns themselves (segments, history) are chat.conversations': evaluation walks them too.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from cache_format.logs import read_commit_log
from extract.regenerate.sampling import request_key

__all__ = ["TurnLog", "conversation_key", "turn_key"]

def conversation_key(asked: list[dict]) -> str:
    """A conversation's identity by content: what it asks (its messages but the assistant's), so a
    resume matches it wherever it sits in a reordered prompt file."""
    blob = json.dumps([[m["role"], m["content"]] for m in asked if m["role"] != "assistant"],
                      ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def turn_key(seed: int, prompt_index: int, sample: int, turn: int) -> int:
    """The sampling key of a turn: turn 0's is request_key's (one-turn data draws what it always
    did)."""
    return request_key(seed if turn == 0 else seed * 1_000_003 + turn, prompt_index, sample)


class TurnLog:
    """OUT.turns.jsonl: the answers of conversations not yet finished, by (prompt, sample); a line
    names its conversation by content (conversation_key), so a reordered prompt file resumes too."""

    def __init__(self, out: Path, keys: list[str]) -> None:
        self.path = Path(str(out) + ".turns.jsonl")
        self.keys = keys  # the content key of each prompt index
        self._index = {}
        for i, key in enumerate(keys):
            self._index.setdefault(key, i)
        self._answers: dict[tuple[str, int], list[str]] = {}
        # complete lines only; a torn last line (a killed run) is cut off and its turn generated
        # again
        entries, _ = read_commit_log(self.path, repair=True)
        for r in entries:
            try:
                got = self._answers.setdefault((r["key"], r["sample"]), [])
                if r["turn"] == len(got):  # in order; a duplicate or a gap is not ours
                    got.append(r["content"])
            except (KeyError, TypeError):
                raise ValueError(f"{self.path}: a line is not a turn record; remove the file to "
                                 "start the unfinished conversations over") from None
        self._f = None

    @property
    def answers(self) -> dict[tuple[int, int], list[str]]:
        """The answers so far of the conversations of this prompt file, by (prompt index,
        sample)."""
        return {(self._index[key], k): a for (key, k), a in self._answers.items()
                if key in self._index}

    def of(self, job: tuple[int, int]) -> list[str]:
        return self._answers.get((self.keys[job[0]], job[1]), [])

    def add(self, job: tuple[int, int], text: str) -> None:
        turn = len(self.of(job))
        if self._f is None:
            self._f = open(self.path, "a", encoding="utf-8")
        self._f.write(json.dumps({"key": self.keys[job[0]], "prompt_index": job[0],
                                  "sample": job[1], "turn": turn,
                                  "content": text}, ensure_ascii=False) + "\n")
        self._answers.setdefault((self.keys[job[0]], job[1]), []).append(text)

    def sync(self) -> None:
        if self._f is not None:
            self._f.flush()
            os.fsync(self._f.fileno())

    def close(self, *, finished: bool) -> None:
        """Close; `finished` (every conversation of the output is whole) removes the file."""
        if self._f is not None:
            self.sync()
            self._f.close()
            self._f = None
        if finished:
            self.path.unlink(missing_ok=True)
