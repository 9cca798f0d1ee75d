"""A GGUF target's converted form, kept on disk so that later float32 loads skip the conversion.

transformers reads a GGUF file by parsing all of its metadata three times (config, tokenizer,
weights: the packaged SmolLM2 carries ~300K vocabulary fields) and dequantizing every tensor; on a
2-core VM that is ~36 s per load, almost all of it Python field parsing (14 s with one parse, see
`gguf_parsed_once`). The demo, the evaluation and the tests load the packaged target again and
again. The first float32 load of a GGUF therefore writes what came out (float32 safetensors, the
tokenizer, the config as loaded from the GGUF) into `<cache>/<sha256 of the GGUF>/`; later float32
loads read that in about a second.

- Keyed by the GGUF's own sha256: another file, or the same path rewritten, is another entry.
- Only float32 loads read or write it: the entry's weights are the GGUF's dequantized values
  bit for bit, so a hit loads exactly what a conversion would. bf16 (GPU) loads convert as before.
- An entry is written into a temporary directory and renamed into place; one without its
  `draftcache_target.json` (written last) is never used. A hit whose tokenizer hash differs from
  the one recorded at conversion is ignored, and the GGUF is converted again.
- One conversion per machine: a float32 load that finds no complete entry takes
  `<cache>/<sha256>.lock` (an OS file lock, gone with its process), looks again, and converts only
  if there is still none; ranks or tests that load the same GGUF at once wait for the first
  conversion and read it. A complete entry is read without the lock.
- Where: $DRAFTCACHE_TARGET_CACHE, else $XDG_CACHE_HOME/draftcache/targets, else
  ~/.cache/draftcache/targets. DRAFTCACHE_TARGET_CACHE=off turns it off.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from cache_format.lock import WriterLock

__all__ = ["cache_root", "entry_lock", "gguf_parsed_once", "read_entry", "write_entry"]

_MARK = "draftcache_target.json"  # written last: an entry without it is incomplete


def cache_root() -> Path | None:
    """The cache directory, or None when DRAFTCACHE_TARGET_CACHE=off."""
    env = os.environ.get("DRAFTCACHE_TARGET_CACHE", "")
    if env.lower() in ("off", "0", "none"):
        return None
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "draftcache" / "targets"


@contextmanager
def entry_lock(sha: str) -> Iterator[None]:
    """Hold this GGUF's conversion lock (blocking): the first holder converts, the rest read. The
    same OS lock as a store's writer (cache_format.lock.WriterLock): the file `SHA.lock` in the
    cache."""
    root = cache_root()
    if root is None:
        yield
        return
    lock = WriterLock(root / sha, what="GGUF conversion")
    try:
        lock.acquire(wait=True)
    except OSError:  # a read-only cache: no lock, and write_entry will not write either
        yield
        return
    with lock:
        yield


@contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """While a GGUF loads through transformers: one parse of the file and one tensor-name map.

    transformers builds a fresh `gguf.GGUFReader` for the config, the tokenizer and the weights
    (three parses of ~300K metadata fields for the packaged SmolLM2) and a fresh
    `gguf.get_tensor_name_map` for every tensor; both are pure functions of their arguments. For
    the duration of the load the `gguf` module hands out one reader per file and one map per
    (architecture, depth), then gets its own functions back. On 2 CPU cores this takes a packaged
    SmolLM2 conversion from 36 s to 14 s with the same weights, config and tokenizer."""
    try:
        import gguf
    except ImportError:  # transformers will say that GGUF support is missing
        yield
        return
    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple, object] = {}

    def one_reader(path, *args, **kwargs):
        key = (os.path.realpath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = real_reader(path, *args, **kwargs)
        return readers[key]

    cached_map = functools.lru_cache(maxsize=None)(real_map)
    gguf.GGUFReader, gguf.get_tensor_name_map = one_reader, cached_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


def read_entry(sha: str) -> tuple[Path, dict] | None:
    """(entry directory, its record: config, tokenizer_sha256) of a complete entry for this GGUF."""
    root = cache_root()
    if root is None:
        return None
    d = root / sha
    try:
        rec = json.loads((d / _MARK).read_text())
    except (OSError, ValueError):
        return None
    return (d, rec) if rec.get("gguf_sha256") == sha else None


def write_entry(sha: str, model: torch.nn.Module, tokenizer, config: dict, tok_sha: str) -> None:
    """Write the loaded float32 model and tokenizer as a plain HF directory; best effort (a full
    disk or a read-only home only costs the next load its conversion)."""
    root = cache_root()
    if root is None:
        return
    tmp = root / f".tmp-{sha[:16]}-{os.getpid()}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        write_hf_dir(model, tokenizer, tmp)
        (tmp / _MARK).write_text(json.dumps({"gguf_sha256": sha, "config": config,
                                             "tokenizer_sha256": tok_sha}))
        try:
            os.rename(tmp, root / sha)
        except OSError:  # another process put the same entry in place first
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def write_hf_dir(model: torch.nn.Module, tokenizer, out: str | Path) -> None:
    """A plain HF directory of a loaded model (config with `architectures`, no quantization
    config; transformers will not re-save a GGUF-quantized model as it is) and its tokenizer."""
    d = model.config.to_dict()
    d.pop("quantization_config", None)
    cfg = type(model.config)(**d)
    cfg.architectures = [type(model).__name__]
    plain = type(model)(cfg).to(next(model.parameters()).dtype)
    plain.load_state_dict(model.state_dict())
    Path(out).mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
