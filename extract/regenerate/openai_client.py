"""Requests to OpenAI-compatible servers (vLLM, SGLang, llama.cpp, `transformers serve`).

This is how users regenerate for 8B–235B targets: the servers run the target, we send
`POST {base_url}/chat/completions` (or `/completions` for raw text, as --invent needs) with
bounded concurrency, spread round-robin over several servers. A failed request (connection
refused or reset, timeout, HTTP 408/429/5xx, a reply without text) is retried on the next server
after an exponential backoff; a request still failing after the retries, or refused with another
4xx, is returned as an error for the caller to record. HTTP threads wait on sockets only: no GPU
work happens in this process.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Reply", "ServerRequest", "send_all", "server_results"]

_RETRYABLE_HTTP = {408, 409, 425, 429, 500, 502, 503, 504}


@dataclass(frozen=True)
class ServerRequest:
    job: object
    endpoint: str
    """'chat/completions' (body has messages) or 'completions' (body has prompt)."""
    body: dict


@dataclass(frozen=True)
class Reply:
    job: object
    text: str | None
    """None when the request failed; `error` says why."""
    completion_tokens: int = 0
    finish_reason: str = ""
    error: str = ""
    attempts: int = 1


def _post(url: str, body: dict, timeout: float) -> dict:
    data = json.dumps(body).encode("utf-8")
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read().decode("utf-8"))


def _text(endpoint: str, resp: dict) -> tuple[str, int, str]:
    choice = resp["choices"][0]
    text = choice["message"]["content"] if endpoint == "chat/completions" else choice["text"]
    if not isinstance(text, str):
        raise ValueError("reply has no text")
    usage = resp.get("usage") or {}
    return text, int(usage.get("completion_tokens") or 0), str(choice.get("finish_reason") or "")


def _one(req: ServerRequest, index: int, urls: tuple[str, ...], *, timeout: float, retries: int,
         backoff: float) -> Reply:
    last = ""
    for attempt in range(retries + 1):
        url = f"{urls[(index + attempt) % len(urls)].rstrip('/')}/{req.endpoint}"
        try:
            text, n, finish = _text(req.endpoint, _post(url, req.body, timeout))
            return Reply(req.job, text, n, finish, attempts=attempt + 1)
        except urllib.error.HTTPError as e:
            detail = e.read()[:200].decode("utf-8", "replace") if e.fp else ""
            last = f"{url}: HTTP {e.code} {detail}".strip()
            if e.code not in _RETRYABLE_HTTP:
                return Reply(req.job, None, error=last, attempts=attempt + 1)
        except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
            # refused, reset, timeout, bad reply
            last = f"{url}: {type(e).__name__}: {e}"
        if attempt < retries:
            time.sleep(min(backoff * 2**attempt, 30.0))
    return Reply(req.job, None, error=last, attempts=retries + 1)


def send_all(requests: Iterable[ServerRequest], *, base_urls: tuple[str, ...], concurrency: int,
             timeout: float, retries: int, backoff: float = 1.0) -> Iterator[Reply]:
    """Send every request to the servers (this is the client side); replies in completion order, at
    most `concurrency` requests in flight."""
    it = iter(enumerate(requests))
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        def submit() -> bool:
            nxt = next(it, None)
            if nxt is None:
                return False
            pending.add(pool.submit(_one, nxt[1], nxt[0], base_urls, timeout=timeout,
                                    retries=retries, backoff=backoff))
            return True

        pending: set = set()
        while len(pending) < concurrency and submit():
            pass
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in done:
                yield f.result()
                submit()


def server_results(cfg, opening: str,
                   todo) -> Iterator[tuple[tuple[int, int], str | None, int, int]]:
    """A regeneration's requests over the servers (cfg: its RegenConfig). todo: [(job, messages or
    None, sampling key)]; None sends `opening` to the completions endpoint (--invent). Yields (job,
    text or None, new tokens, attempts); failures are listed in OUT.errors.jsonl, which a rerun
    retries."""

    def body(msgs, key) -> tuple[str, dict]:
        common = dict(model=cfg.model, max_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                      top_p=cfg.top_p if cfg.temperature > 0 else 1.0, seed=key)
        if msgs is None:
            return "completions", dict(prompt=opening, **common)
        extra = {"chat_template_kwargs": cfg.template_kwargs} if cfg.template_kwargs else {}
        return "chat/completions", dict(messages=msgs, **common, **extra)

    reqs = (ServerRequest(job, *body(msgs, key)) for job, msgs, key in todo)
    # this run retries every request an earlier run listed as failed: the file lists this run's
    # failures
    errors = Path(cfg.out + ".errors.jsonl")
    errors.unlink(missing_ok=True)
    ef = None  # opened at the first failure: a run without failures leaves no errors file
    try:
        for r in send_all(reqs, base_urls=cfg.base_url, concurrency=cfg.concurrency,
                          timeout=cfg.request_timeout, retries=cfg.retries):
            if r.text is None:
                ef = ef or open(errors, "a", encoding="utf-8")
                ef.write(json.dumps({"prompt_index": r.job[0], "sample": r.job[1], "error": r.error,
                                     "attempts": r.attempts, "time": time.time()}) + "\n")
                ef.flush()
                yield r.job, None, 0, r.attempts
            else:
                yield r.job, r.text, r.completion_tokens, r.attempts
    finally:
        if ef is not None:
            ef.close()
