"""Errors raised by the store: every user-facing failure is a one-line `CacheFormatError`."""

from __future__ import annotations

__all__ = ["CacheFormatError", "ManifestMismatchError", "UnknownFormatVersionError"]


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
