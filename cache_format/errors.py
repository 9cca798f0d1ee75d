"""Errors raised by the store: every user-facing failure is a one-line `CacheFormatError`."""

from __future__ import annotations

__all__ = ["CacheFormatError", "ManifestMismatchError", "UnknownFormatVersionError", "brief"]


def brief(e: BaseException) -> str:
    """An exception from deep inside a library as a short, one-line detail for our own message:
    its type and the first non-blank line of its text (zarr, safetensors and transformers often
    raise multi-line or empty messages)."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    return f"{type(e).__name__}: {lines[0][:200]}" if lines else type(e).__name__


class CacheFormatError(ValueError):
    """A store is missing, malformed, or does not fit what the caller asked for."""


class UnknownFormatVersionError(CacheFormatError):
    """The store was written by a format version this code does not understand."""


class ManifestMismatchError(CacheFormatError):
    """An existing store was written with a different target, layers, data or options."""

    def __init__(self, path: str, differences: list[str]) -> None:
        self.differences = differences
        super().__init__(
            f"{path}: store was written with different settings ({'; '.join(differences)}); "
            "rerun with --overwrite to start over"
        )
