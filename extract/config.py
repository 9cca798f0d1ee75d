"""ExtractConfig: every knob of stage one; the CLI maps onto it 1:1 and it is saved in the
manifest."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from extract.regenerate.config import parse_template_kwargs
from runtime.numbers import check_numbers

__all__ = ["ExtractConfig"]


@dataclass(frozen=True, kw_only=True)
class ExtractConfig:
    store: str
    """Output store directory (a zarr v3 group); /dev/shm or NVMe for speed. Or a URL
    (s3://bucket/prefix): written in --stage-dir and mirrored there as shards commit (all ranks on
    one node)."""
    stage_dir: str = ""
    """Local directory a store on object storage is written in before upload (default: its cache
    directory under $DRAFTCACHE_STORE_CACHE or ~/.cache/draftcache/stores)."""
    lease_ttl: float = 60.0
    """Seconds a store on object storage stays locked after its writer stops renewing its lease (a
    killed writer): a resumed run waits at most this long; renewed every sixth of it."""
    target: str = ""
    """HF causal-LM directory or .gguf file; empty = the packaged SmolLM2-135M-Instruct GGUF."""
    data: str = ""
    """JSONL of conversations (.jsonl.gz read through gzip); empty = the packaged prompts with
    target-generated responses."""
    layers: tuple[int, ...] = ()
    """Tapped layer ids (id i = output of decoder layer i); empty = the DFlash rule for num_taps."""
    num_taps: int = 5
    """K for the default DFlash rule round(1 + i*(N-4)/(K-1))."""
    keep_layers: tuple[int, ...] = ()
    """Decoder layers whose weights are saved in the store beside the embedding and lm_head, so a
    drafter's layers can start from them (train --init-layers); ~3.5M weights a layer for
    SmolLM2."""
    last_hidden: bool = True
    """Also store the final hidden state after the final norm (for soft-label distillation)."""
    max_len: int = 2048
    """Samples longer than this are truncated (or dropped with drop_long)."""
    drop_long: bool = False
    """Skip samples longer than max_len instead of truncating them."""
    min_supervised: int = 32
    """Skip samples with fewer supervised (assistant) tokens; 2 x block_size for block 16."""
    dtype: str = "bfloat16"
    """Stored dtype: bfloat16, fp8_e4m3 (0.5x bf16's bytes) or mxfp4 (4-bit values with a scale per
    32: 0.27x)."""
    compression: str = "none"
    """none or blosc-zstd1."""
    token_budget: int = 16384
    """Padded tokens per forward batch (batch size x longest sample)."""
    rows_per_shard: int = 0
    """Tokens per shard; 0 = about 64 MiB of hidden states per shard."""
    queue_batches: int = 4
    """Slots of the host ring that forward batches wait in for the writers. The ring takes
    queue_batches x token_budget x bytes/token of host RAM (4 x 16384 x 40 KiB = 2.6 GB for Qwen3-8B
    with 5 taps), plus one shard buffer per length bucket and one per writer."""
    writer: str = "thread"
    """Where the store is written: "thread" (threads of the GPU process) or "process" (writer
    processes reading the ring from shared memory)."""
    writers: int = 3
    """Store writers per rank, sharing every batch, each committing its own shards (writer id
    rank*writers+w)."""
    compile: bool = False
    """torch.compile each target decoder layer (shapes dynamic: the token-budget batches vary);
    the taps agree with the eager layers' within rounding."""
    skip_bad: bool = False
    """Count and skip malformed JSON lines instead of stopping at the first."""
    chat_template_kwargs: str = ""
    """A JSON object of chat-template options to render with, e.g. '{"enable_thinking": false}';
    must be those the data was regenerated with (its DATA.summary.json); recorded in the manifest's
    extract_config."""
    overwrite: bool = False
    """Delete an existing store with different settings and start over."""
    limit: int = 0
    """Use only the first N records of the data (0 = all)."""
    seed: int = 0
    """Seed for default-data regeneration."""

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """chat_template_kwargs parsed: {} when empty."""
        return parse_template_kwargs(self.chat_template_kwargs)

    def __post_init__(self) -> None:
        check_numbers(self)
        if not self.store:
            raise ValueError("store path is required")
        if not self.lease_ttl > 0:
            raise ValueError(f"lease_ttl must be > 0 seconds, got {self.lease_ttl}")
        _ = self.template_kwargs  # refuses text that is not a JSON object
        if self.num_taps < 1:
            raise ValueError(f"num_taps must be >= 1, got {self.num_taps}")
        for what, ids in (("layer ids", self.layers), ("keep_layers", self.keep_layers)):
            if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
                raise ValueError(f"{what} must be distinct and >= 0, got {list(ids)}")
        if self.max_len < 2:
            raise ValueError(f"max_len must be >= 2, got {self.max_len}")
        if self.min_supervised < 2:
            raise ValueError(f"min_supervised must be >= 2, got {self.min_supervised}")
        # here, not at the top: the store package loads torch, and the command reads this file
        # before it notes signals (a Ctrl-C inside torch's import aborts the interpreter)
        from cache_format.schema import DTYPES

        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.compression not in ("none", "blosc-zstd1"):
            raise ValueError(f"compression must be none or blosc-zstd1, got {self.compression!r}")
        if self.token_budget < self.max_len:
            raise ValueError(f"token_budget ({self.token_budget}) must be >= max_len "
                             f"({self.max_len})")
        if self.writer not in ("thread", "process"):
            raise ValueError(f"writer must be thread or process, got {self.writer!r}")
        if self.writers < 1:
            raise ValueError(f"writers must be >= 1, got {self.writers}")
        if self.queue_batches < 1:  # rows_per_shard and limit are >= 0: check_numbers
            raise ValueError(f"queue_batches must be >= 1, got {self.queue_batches}")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layers"] = list(self.layers)
        d["keep_layers"] = list(self.keep_layers)
        return d
