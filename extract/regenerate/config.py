"""RegenConfig: every knob of `python -m extract.regenerate`; the CLI maps onto it 1:1."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from chat.conversations import TURNS
from runtime.numbers import check_numbers

__all__ = ["ENGINES", "RegenConfig", "parse_template_kwargs"]

ENGINES = ("auto", "static", "hf", "openai")


def parse_template_kwargs(text: str) -> dict[str, Any]:
    """A --chat-template-kwargs value as a dict; ValueError in one line unless it is a JSON
    object."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--chat-template-kwargs {text!r} is not JSON: {e.msg} at character "
                         f"{e.pos}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--chat-template-kwargs {text!r} must be a JSON object, e.g. "
                         f"'{{\"enable_thinking\": false}}'")
    return value


@dataclass(frozen=True, kw_only=True)
class RegenConfig:
    out: str
    """Output JSONL, appended to: lines already there are kept and their (prompt, sample) pairs
    skipped."""
    target: str = ""
    """HF directory or .gguf (default: the packaged SmolLM2 GGUF). With --engine openai only its
    tokenizer is read, and only for --invent."""
    prompts: str = "default"
    """'default' (the packaged training prompts) or a JSONL of conversations: their assistant turns
    are dropped and regenerated in order, each after the regenerated history (system messages
    kept)."""
    turns: str = "all"
    """all: answer every user turn of a conversation, turn by turn; first: only its first."""
    chat_template_kwargs: str = ""
    """A JSON object of chat-template options, e.g. '{"enable_thinking": false}' (render as the
    serving mode does); passed to the template in-process and to servers as chat_template_kwargs."""
    limit: int = 0
    """Use only the first N prompts (0 = all)."""
    num_samples: int = 1
    """Responses per prompt."""
    temperature: float = 0.0
    """0 = greedy; otherwise sampled with top-k and top-p."""
    top_p: float = 0.95
    """Nucleus mass kept when sampling."""
    top_k: int = 50
    """Candidates kept before top-p when sampling (HF generate's default); 0 = all."""
    max_new_tokens: int = 256
    """New tokens at most per response."""
    batch_size: int = 0
    """Rows decoded together (static: cache rows; hf: padded batch); 0 = 1024 on a GPU, 16 on a
    CPU."""
    seed: int = 0
    """Sampling seed: request (prompt i, sample k) draws from (seed, i, k) alone."""
    shard: tuple[int, int] = (0, 1)
    """(i, n): this process serves requests j with j % n == i (one process per GPU or server
    group)."""
    invent: int = 0
    """Write N user prompts made up by the target (Magpie) instead of answering prompts."""
    invent_prefix: str = ""
    """Words every invented prompt starts with (steers the domain)."""
    engine: str = "auto"
    """static (CUDA-graphed decode, rows refilled), hf (HF generate), openai (HTTP servers), or
    auto: static where the model qualifies, else hf."""
    base_url: tuple[str, ...] = ()
    """OpenAI-compatible server URLs (…/v1), requests spread over them (--engine openai)."""
    model: str = ""
    """Model name sent to the servers (--engine openai)."""
    concurrency: int = 8
    """Requests in flight at once over all servers (--engine openai)."""
    request_timeout: float = 300.0
    """Seconds before one HTTP request is abandoned and retried (--engine openai)."""
    retries: int = 4
    """Attempts after the first for a failed request, with exponential backoff (--engine openai)."""
    sync_every: int = 8
    """Static engine: decode steps between checks for finished rows."""

    def __post_init__(self) -> None:
        check_numbers(self)
        if not self.out:
            raise ValueError("--out is required")
        if self.turns not in TURNS:
            raise ValueError(f"--turns must be all or first, got {self.turns!r}")
        _ = self.template_kwargs  # refuses text that is not a JSON object
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if len(self.shard) != 2 or not 0 <= self.shard[0] < self.shard[1]:
            raise ValueError(f"shard {'/'.join(map(str, self.shard))}: expected i/n with 0 <= i < "
                             "n, e.g. 0/2")
        if self.num_samples < 1 or self.max_new_tokens < 1 or self.sync_every < 1:
            raise ValueError("--num-samples, --max-new-tokens and --sync-every must be >= 1")
        if not 0 < self.top_p <= 1:  # every number is finite and >= 0: check_numbers
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.invent and self.prompts != "default":
            raise ValueError("--invent writes prompts and reads none: answer them in a second run "
                             "with --prompts")
        if self.invent and self.temperature <= 0:
            raise ValueError("--invent needs --temperature > 0 (greedy decoding would invent one "
                             "message)")
        if self.engine == "openai":
            if not self.base_url or not self.model:
                raise ValueError("--engine openai needs --base-url URL[,URL...] and --model NAME")
            if self.concurrency < 1 or self.request_timeout == 0:  # retries >= 0: check_numbers
                raise ValueError("--concurrency >= 1, --request-timeout > 0 and --retries >= 0 are "
                                 "needed")
        elif self.base_url:
            raise ValueError("--base-url is for --engine openai")

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """chat_template_kwargs parsed: {} when empty."""
        return parse_template_kwargs(self.chat_template_kwargs)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["shard"], d["base_url"] = list(self.shard), list(self.base_url)
        return d
