"""The numeric fields of a stage's config checked where they are parsed: every int and float field
finite, of its type and >= 0 unless the config names it as allowed otherwise. A config's own
`__post_init__` then checks the ranges and the combinations only it knows."""

from __future__ import annotations

import dataclasses
import math

__all__ = ["check_numbers"]


def check_numbers(cfg, *, negative_ok: tuple[str, ...] = (),
                  infinite_ok: tuple[str, ...] = ()) -> None:
    """Raise ValueError (one line, naming the field) for an int field that is not an int (a bool
    included) or is negative, or a float field that is not a number, is NaN, infinite or negative.
    `negative_ok`: fields where a negative value means something (e.g. -1: choose one);
    `infinite_ok`: float fields where inf means "no limit"."""
    for f in dataclasses.fields(cfg):
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        if kind not in ("int", "float"):
            continue
        v = getattr(cfg, f.name)
        if kind == "int" and (isinstance(v, bool) or not isinstance(v, int)):
            raise ValueError(f"{f.name} must be an integer, got {v!r}")
        if kind == "float":
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"{f.name} must be a number, got {v!r}")
            if math.isnan(v) or (math.isinf(v) and f.name not in infinite_ok):
                raise ValueError(f"{f.name} must be a finite number, got {v}")
        if v < 0 and f.name not in negative_ok:
            raise ValueError(f"{f.name} must be >= 0, got {v}")
