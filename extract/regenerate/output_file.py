"""The regeneration output file (JSONL, one conversation a line): what it already holds, and the
appends that add to it, fsynced every 2 s so a killed run loses at most its last seconds."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from cache_format.logs import cut_torn_line
from chat.conversations import history
from extract.regenerate.config import RegenConfig
from extract.regenerate.loops import loop_start
from extract.regenerate.turns import TurnLog, conversation_key
from runtime.oserrors import WRITE_LIMITS, write_failure

__all__ = ["RegenSummary", "done_pairs", "drop_torn_tail", "write_results"]


@dataclass(frozen=True)
class RegenSummary:
    written: int
    """Records appended to the output now."""
    failed: int
    """Requests that failed after their retries (openai engine; listed in OUT.errors.jsonl)."""
    retried: int
    """Requests that succeeded only after a retry (openai engine)."""
    new_tokens: int
    seconds: float
    too_long: int = 0
    """Conversations not answered: their prompt is as long as the target's context or longer
    (in-process)."""
    looping: int = 0
    """Written conversations whose last answer repeats itself
    (extract.regenerate.loops.loop_start)."""
    stopped_by_signal: int = 0
    """The signal (SIGTERM, SIGINT) that stopped the run after its last whole record; 0: not
    stopped."""


def write_results(cfg: RegenConfig, out: Path, segs, results, log: TurnLog | None = None,
                  finished: set | None = None, stop=lambda: False) -> RegenSummary:
    """Append a record per finished conversation, an answered turn of an unfinished one to the turn
    log (fsync both every 2 s and at the end); progress and a closing summary."""
    from tqdm import tqdm

    t0 = time.perf_counter()
    bar = tqdm(unit="req", desc="regenerate", mininterval=2.0, file=sys.stderr, disable=None)
    try:
        with open(out, "a", encoding="utf-8") as f:
            written, failed, tokens, retried, looping = _append(cfg, f, segs, results, log,
                                                                finished, bar, t0, stop)
    except OSError as e:  # a full disk or a size limit: the file named, what was fsynced stays
        if e.errno not in WRITE_LIMITS:
            raise
        raise ValueError(f"{write_failure(e, out)}; rerun the same command to go on") from None
    bar.close()
    s = time.perf_counter() - t0
    msg = (f"{written} written, {failed} failed, {tokens} new tokens in {s:.1f} s "
           f"({tokens / max(s, 1e-9):,.0f} tok/s)")
    if retried:
        msg += f"; {retried} requests needed retries"
    if failed:
        msg += f"; failures in {cfg.out}.errors.jsonl (rerun to retry them)"
    if looping:
        msg += (f"; {looping} answers repeat themselves (python -m extract.regenerate.loops cuts "
                "them where the loop starts)")
    print(msg, file=sys.stderr)
    return RegenSummary(written, failed, retried, tokens, s, looping=looping)


def _append(cfg: RegenConfig, f, segs, results, log, finished, bar, t0: float,
            stop) -> tuple[int, int, int, int, int]:
    """Write each finished conversation's record to f (fsync every 2 s and at the end) until the
    results end or `stop()` says to: the counts (written, failed, new tokens, retried, looping)."""
    written = failed = tokens = retried = looping = 0
    last_sync = t0
    for (i, k), text, n, attempts in results:
        # preempted: what is written is whole; the result in hand is answered again by a rerun
        if stop():
            break
        bar.update(1)
        retried += attempts > 1
        tokens += n
        bar.set_postfix_str(f"{tokens / max(time.perf_counter() - t0, 1e-9):,.0f} tok/s",
                            refresh=False)
        if text is None:
            failed += 1
            continue
        if cfg.invent:  # the prefix was the opening's end: the generated text continues it
            message = (cfg.invent_prefix + text).strip() if text.strip() else ""
            if not message:
                continue  # an empty message is no prompt
            rec = {"messages": [{"role": "user", "content": message}], "prompt_index": i,
                   "sample": k}
        else:
            answers = log.of((i, k)) + [text.strip()]
            if len(answers) < len(segs[i]):  # more turns to come: kept in the turn log meanwhile
                log.add((i, k), answers[-1])
                continue
            last = {"role": "assistant", "content": answers[-1]}
            rec = {"messages": history(segs[i], answers[:-1]) + [last],
                   "prompt_index": i, "sample": k}
            finished.add((i, k))
            looping += loop_start(answers[-1]) < len(answers[-1])
        f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        written += 1
        if time.perf_counter() - last_sync > 2.0:
            f.flush()
            os.fsync(f.fileno())
            if log is not None:
                log.sync()
            last_sync = time.perf_counter()
    f.flush()
    os.fsync(f.fileno())
    if log is not None:
        log.sync()
    return written, failed, tokens, retried, looping


def done_pairs(out: Path, keys: list[str] | None, num_samples: int) -> set[tuple[int, int]]:
    """(prompt index, sample) pairs already in `out`: matched by the conversation's content key
    (what a record asks: its messages but the answers) when `keys` are given, else by index."""
    done: set[tuple] = set()
    if out.exists():
        drop_torn_tail(out)
        with open(out, encoding="utf-8") as f:
            for line in f:
                try:
                    r = json.loads(line)
                    asked = [m for m in r["messages"] if m["role"] != "assistant"]
                    done.add((conversation_key(asked), r["sample"]) if keys is not None else
                             (r["prompt_index"], r["sample"]))
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue  # not ours: regenerated below
    if keys is None:
        return done
    return {(i, k) for i, key in enumerate(keys) for k in range(num_samples) if (key, k) in done}


def drop_torn_tail(path: Path) -> None:
    """Cut a last line without its newline (a run killed mid-write) so appends start on a fresh
    line."""
    cut_torn_line(path, path.read_bytes())
