"""The store manifest: what produced a store and how its bytes are laid out.

The manifest lives in the root group's attributes under the key ``"draftcache"``. It is written
once when the store is created and never changes while writers run; what changes (which shards are
committed, whether the store is finalized) lives in the done-logs and in ``"draftcache_state"``.
A reader refuses a ``format_version`` it does not know instead of guessing.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import typing
from dataclasses import dataclass, field
from typing import Any

from cache_format.errors import CacheFormatError, UnknownFormatVersionError

__all__ = [
    "COMPRESSIONS",
    "DTYPES",
    "FORMAT_VERSION",
    "LAYER_CONVENTION",
    "DatasetInfo",
    "Manifest",
    "TargetInfo",
    "bucket_of",
    "default_bucket_bounds",
    "default_rows_per_shard",
    "check_layer_ids",
    "last_layer_refusal",
    "manifest_differences",
    "parse_layer_ids",
]

# 2: checksums.json covers every file the shard checksums do not; 3: the mask token; 4: the mxfp4
# dtype, the quantization error recorded under dtype-neutral names (quant_sq_err/quant_sq_ref,
# quant_relative_rms_error)
FORMAT_VERSION = 4
DTYPES = ("bfloat16", "fp8_e4m3", "mxfp4")
COMPRESSIONS = ("none", "blosc-zstd1")
# Layer id i is the output of decoder layer i, which is HF `hidden_states[i + 1]` (index 0 is the
# embedding output). vLLM counts the other way round (+1): see train/export.py.
LAYER_CONVENTION = "output of decoder layer i = HF hidden_states[i+1]"


def check_field_types(obj: Any) -> None:
    """TypeError naming the first field whose value is not of its annotated type (a damaged or
    hand-edited manifest: "hidden_size": "576" would otherwise fail later, deep in a reader)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        hint, value = hints[f.name], getattr(obj, f.name)
        origin = typing.get_origin(hint)
        if hint is bool:
            ok = isinstance(value, bool)
        elif hint is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif hint is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif hint is str:
            ok = isinstance(value, str)
        elif origin is tuple:
            ok = isinstance(value, tuple) and all(isinstance(v, int) and not isinstance(v, bool)
                                           for v in value)
        elif origin is dict or hint is dict:
            ok = isinstance(value, dict)
        else:
            continue
        if not ok:
            raise TypeError(f"{type(obj).__name__}.{f.name} = {value!r} is a "
                            f"{type(value).__name__}, not {hint}")


@dataclass(frozen=True, kw_only=True)
class TargetInfo:
    """Identity and shape of the target model whose hidden states are stored."""

    name: str
    """Path or name the target was loaded from."""
    sha256: str
    """sha256 of the weights file (GGUF) or of the config JSON (HF directory)."""
    num_layers: int
    """Number of decoder layers N."""
    hidden_size: int
    """Hidden size H."""
    vocab_size: int
    """Rows of the input embedding (and of lm_head)."""
    config: dict[str, Any] = field(default_factory=dict)
    """The target's HF config as a dict: drafter dims (heads, rope, eps) default to it."""

    def __post_init__(self) -> None:
        check_field_types(self)
        for key in ("num_layers", "hidden_size", "vocab_size"):
            if int(getattr(self, key)) <= 0:
                raise ValueError(f"target {key} must be positive, got {getattr(self, key)}")


@dataclass(frozen=True, kw_only=True)
class DatasetInfo:
    """Which data was rendered into the store."""

    path: str
    sha256: str
    num_records: int

    def __post_init__(self) -> None:
        check_field_types(self)


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """Everything a reader needs to interpret a store, and everything that must match on resume."""

    target: TargetInfo
    """The model that produced the hidden states."""
    tokenizer_sha256: str
    """sha256 over the tokenizer vocabulary and chat template."""
    layer_ids: tuple[int, ...]
    """Tapped layers, in stored order (see LAYER_CONVENTION); never the last layer
    (last_layer_refusal says why)."""
    mask_token_id: int
    """Embedding row a drafter's block uses for tokens not yet known: one the target never emits
    (target.loader.choose_mask_token), because servers drop drafted tokens equal to it."""
    last_hidden: bool
    """Whether `last_hidden` [T, H] (the final hidden state) is stored."""
    dataset: DatasetInfo
    """The JSONL the samples came from."""
    max_len: int
    """Samples were truncated (or dropped) to this many tokens."""
    bucket_bounds: tuple[int, ...] = (256, 512, 1024, 2048, 4096)
    """Upper bounds (inclusive) of the length buckets; longer samples go to a last open bucket."""
    dtype: str = "bfloat16"
    """Stored dtype of hidden states: bfloat16 (as uint16 bits), fp8_e4m3 with per-token scales, or
    mxfp4 (4-bit e2m1 values, one power-of-two scale per 32 values: cache_format.mxfp4)."""
    compression: str = "none"
    """none, or blosc-zstd1 (blosc zstd level 1, byte shuffle, 1 MiB blocks)."""
    rows_per_shard: int = 2048
    """Tokens per shard: the unit one writer writes whole."""
    rows_per_chunk: int = 32
    """Tokens per inner chunk: the unit a reader decodes."""
    last_hidden_post_norm: bool = True
    """`last_hidden` is taken after the target's final norm (lm_head input)."""
    layer_convention: str = LAYER_CONVENTION
    """How layer ids map to model outputs."""
    mask_token: str = ""
    """The mask token's text ("" for a vocabulary padding row, which has none)."""
    extract_config: dict[str, Any] = field(default_factory=dict)
    """The extraction config that wrote the store."""
    format_version: int = FORMAT_VERSION
    """Version of this layout; readers refuse versions they do not know."""

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.format_version != FORMAT_VERSION:
            raise UnknownFormatVersionError(
                f"store format_version {self.format_version} is not supported "
                f"(this draftcache reads version {FORMAT_VERSION})"
            )
        check_layer_ids(self.layer_ids, self.target.num_layers)
        if not 0 <= self.mask_token_id < self.target.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary "
                             f"(0..{self.target.vocab_size - 1})")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.dtype == "mxfp4" and self.target.hidden_size % 32:
            raise ValueError(f"mxfp4 needs a hidden size that is a multiple of 32 (its scale "
                             f"blocks never cross a tapped layer), got {self.target.hidden_size}")
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, got {self.compression!r}")
        if list(self.bucket_bounds) != sorted(set(self.bucket_bounds)) or not self.bucket_bounds:
            raise ValueError("bucket_bounds must be strictly increasing, got "
                             f"{list(self.bucket_bounds)}")
        if self.rows_per_chunk <= 0 or self.rows_per_shard % self.rows_per_chunk:
            raise ValueError("rows_per_shard must be a positive multiple of rows_per_chunk")
        if self.max_len <= 0:
            raise ValueError(f"max_len must be positive, got {self.max_len}")

    @property
    def num_layers_stored(self) -> int:
        return len(self.layer_ids)

    @property
    def row_width(self) -> int:
        """Width K*H of one token's row in `hidden`."""
        return len(self.layer_ids) * self.target.hidden_size

    @property
    def num_buckets(self) -> int:
        """Bounded buckets, plus an open one only when samples can be longer than the last bound."""
        return len(self.bucket_bounds) + (1 if self.bucket_bounds[-1] < self.max_len else 0)

    def bucket_range(self, bucket: int) -> tuple[int, int]:
        """Inclusive (lo, hi) token lengths of a bucket; the last bucket is capped by max_len."""
        lo = 1 if bucket == 0 else self.bucket_bounds[bucket - 1] + 1
        last = bucket == len(self.bucket_bounds)
        hi = max(self.max_len, lo) if last else self.bucket_bounds[bucket]
        return lo, hi

    def bytes_per_token(self) -> int:
        """Uncompressed bytes one token costs in the store."""
        hidden = {"bfloat16": 2 * self.row_width, "fp8_e4m3": self.row_width,
                  "mxfp4": self.row_width // 2}[self.dtype]
        scales = {"bfloat16": 0, "fp8_e4m3": 4 * len(self.layer_ids),
                  "mxfp4": self.row_width // 32}[self.dtype]
        last = 2 * self.target.hidden_size if self.last_hidden else 0
        return hidden + scales + last + 4 + 1  # + input_ids int32 + loss_mask uint8

    def identity(self) -> str:
        """sha256 of what the store holds: target, tokenizer, taps, dtype, dataset (its sha256),
        lengths and layout; not extract_config, so a store moved to another path or extracted
        with other writer settings keeps its identity. Training runs refuse to resume on another."""
        d = {k: v for k, v in self.to_dict().items() if k != "extract_config"}
        return hashlib.sha256(json.dumps(d, sort_keys=True,
                                         separators=(",", ":")).encode()).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layer_ids"] = list(self.layer_ids)
        d["bucket_bounds"] = list(self.bucket_bounds)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Manifest:
        if not isinstance(d, dict) or "format_version" not in d:
            raise CacheFormatError("manifest is missing or has no format_version")
        version = d["format_version"]
        if version != FORMAT_VERSION:
            raise UnknownFormatVersionError(
                f"store format_version {version} is not supported (this draftcache reads version "
                f"{FORMAT_VERSION})"
            )
        try:
            d = dict(d)
            d["target"] = TargetInfo(**d["target"])
            d["dataset"] = DatasetInfo(**d["dataset"])
            d["layer_ids"] = tuple(d["layer_ids"])
            d["bucket_bounds"] = tuple(d["bucket_bounds"])
            return cls(**d)
        except (TypeError, KeyError, ValueError) as e:  # a damaged, unknown or missing field
            raise CacheFormatError(f"manifest is damaged or does not match format version "
                                   f"{version}: {type(e).__name__}: {e}") from None


def default_rows_per_shard(hidden_size: int, num_taps: int) -> int:
    """Tokens per shard for about 64 MiB of bf16 hidden states (a multiple of 32, at least 32)."""
    return max(32, (64 << 20) // (2 * hidden_size * num_taps) // 32 * 32)


def check_layer_ids(layer_ids, num_layers: int, target: str = "") -> None:
    """ValueError unless `layer_ids` are distinct taps of a `num_layers`-layer target: each in
    0..num_layers-2 (the last layer is refused, last_layer_refusal says why)."""
    if not layer_ids:
        raise ValueError("layer_ids must not be empty")
    for lid in layer_ids:
        if not 0 <= lid < num_layers:
            raise ValueError(f"layer id {lid} out of range: target "
                             f"{target + ' ' if target else ''}has {num_layers} layers "
                             f"(0..{num_layers - 1})")
        if lid == num_layers - 1:
            raise ValueError(last_layer_refusal(num_layers))
    if len(set(layer_ids)) != len(layer_ids):
        raise ValueError(f"layer_ids has duplicates: {list(layer_ids)}")


def last_layer_refusal(num_layers: int) -> str:
    """Why the last decoder layer cannot be tapped (one line)."""
    return (f"layer id {num_layers - 1} is the target's last layer: HF (hidden_states[-1]), SGLang "
            "and the DFlash reference take its output after the final norm, a tap would store it "
            f"before; tap ids up to {num_layers - 2} (--last-hidden stores the post-norm final "
            "state)")


def parse_layer_ids(text: str) -> tuple[int, ...]:
    """'1, 9,17' -> (1, 9, 17); ValueError naming the text otherwise (both CLIs use this)."""
    try:
        return tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise ValueError(f"expected comma-separated layer ids, got {text!r}") from None


def default_bucket_bounds(max_len: int) -> tuple[int, ...]:
    """Powers of two from 256 below max_len, then max_len itself (so no open bucket is used)."""
    bounds = [b for b in (256, 512, 1024, 2048, 4096, 8192, 16384, 32768) if b < max_len]
    return tuple(bounds + [max_len])


def bucket_of(length: int, bounds: tuple[int, ...]) -> int:
    """Index of the bucket a sample of `length` tokens belongs to (bounds are inclusive uppers)."""
    return bisect.bisect_left(bounds, length)


# Fields whose change makes an existing store unusable for a resumed run.
_RESUME_KEYS = (
    "target.name", "target.sha256", "layer_ids", "last_hidden", "dataset.sha256", "max_len",
    "dtype", "compression", "bucket_bounds", "rows_per_shard", "rows_per_chunk", "tokenizer_sha256",
)

# extraction options that decide what a sample holds or which samples the store keeps: rows rendered
# or filtered another way must not join rows made before
_RECORDED_OPTIONS = ("chat_template_kwargs", "drop_long", "min_supervised")


def manifest_differences(old: Manifest, new: Manifest) -> list[str]:
    """Human-readable list of the settings that differ between two manifests."""
    a, b = old.to_dict(), new.to_dict()
    out = []
    for key in _RESUME_KEYS:
        va, vb = a, b
        for part in key.split("."):
            va, vb = va[part], vb[part]
        if va != vb:
            out.append(f"{key}: store has {va!r}, now {vb!r}")
    ea, eb = a.get("extract_config") or {}, b.get("extract_config") or {}
    # recorded by the run that made the store: a resume may not change them
    for key in _RECORDED_OPTIONS:
        if key in ea and key in eb and ea[key] != eb[key]:
            out.append(f"extract_config.{key}: store has {ea[key]!r}, now {eb[key]!r}")
    return out
