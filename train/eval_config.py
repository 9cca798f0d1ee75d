"""EvalConfig: every option of `python -m train.eval` (runtime.cli derives the command line from
it)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from runtime.numbers import check_numbers

__all__ = ["EvalConfig"]

DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    # ------------------------------------------------------------------ the drafter
    run: str = ""
    """Training run directory (its checkpoint is evaluated)."""
    checkpoint: str = ""
    """'best' (best held-out decoding τ), 'latest' (newest step-N) or a checkpoint directory (empty:
    best if the run validated, else latest)."""
    export: str = ""
    """An exported directory: evaluated as served (bf16 weights, loaded by AutoModel with
    trust_remote_code), beside the checkpoint when --run is given too."""
    draft_head: bool = False
    """A --run checkpoint trained on a draft vocabulary drafts from its draft vocabulary only (as
    trained); by default from the target's whole lm_head, as train.export serves it."""
    # ------------------------------------------------------------------ the prompts and the target
    prompts: str = "default"
    """'default' (held-out GSM8K slice, HumanEval, chat set, the domains interleaved: --limit 48 is
    the test), 'validation' (the held-out prompts past each domain's first 16: none of the test's),
    'multiturn' (24 two-turn chats: τ of the second turn, after the target's own first answer) or a
    JSONL (multi-turn conversations: τ of the last turn)."""
    limit: int = 0
    """Evaluate only the first N prompts (0 = all)."""
    max_new_tokens: int = 128
    """New tokens per answer."""
    target: str = ""
    """Override the target path recorded in the run."""
    dtype: str = "float32"
    """Target dtype (float32 or bfloat16); the lossless check is exact only in float32 (bf16 argmax
    ties flip)."""
    # ------------------------------------------------------------------ decoding
    tree_budget: tuple[int, ...] = (0,)
    """Draft-tree node budget (0: the chain), or several comma-separated (e.g. 0,8,32,64): each
    prompt decoded at every budget against one greedy baseline; tree_curve holds each budget's
    figures."""
    tree_width: int = 0
    """At most this many tree nodes a depth (0: no cap)."""
    cuda_graph: bool = True
    """On a GPU, replay the drafter's side of each step as one CUDA graph (off: eager, to
    compare)."""
    # ------------------------------------------------------------------ extra figures
    teacher_forced: bool = False
    """Also draft at every anchor of the target's greedy output: sim_tau's counterpart on these
    prompts, and the decode it implies (train.acceptance)."""
    prompt_lookup: bool = True
    """Also run transformers' prompt-lookup decoding as a second baseline (a third of the time)."""

    def __post_init__(self) -> None:
        check_numbers(self)
        if not self.run and not self.export:
            raise ValueError(
                "give --run (a training run), --export (an exported directory) or both")
        b = self.tree_budget
        if not b or min(b) < 0 or len(set(b)) != len(b):
            raise ValueError(f"--tree-budget {','.join(map(str, b))}: budgets must be distinct "
                             "integers >= 0 (0: the chain)")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not self.prompts.strip():
            raise ValueError("--prompts must name a prompt set or a JSONL file")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["tree_budget"] = list(self.tree_budget)
        return d
