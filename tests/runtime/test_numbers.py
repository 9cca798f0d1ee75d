"""Every numeric field of every stage's config, driven with bad values where it is parsed: a one-line
ValueError naming the field, or (only where the value means something) a config that builds."""

from __future__ import annotations

import dataclasses
import math

import pytest

from extract.config import ExtractConfig
from extract.regenerate.config import RegenConfig
from runtime.numbers import check_numbers
from train.config import TrainConfig

CONFIGS = {TrainConfig: {"store": "s", "out": "o"}, ExtractConfig: {"store": "s"}, RegenConfig: {"out": "o"}}
NEGATIVE_OK = {(TrainConfig, "mask_token_id")}  # -1: choose the mask token from the store
BAD = [-1, -1e-3, float("nan"), float("inf"), float("-inf"), "3", True, None, 10**30, 1e300]


def _cases():
    for cls, required in CONFIGS.items():
        for f in dataclasses.fields(cls):
            if f.type in ("int", "float"):
                for bad in BAD:
                    yield pytest.param(cls, required, f.name, f.type, bad, id=f"{cls.__name__}.{f.name}={bad!r}")


@pytest.mark.parametrize("cls,required,name,kind,bad", list(_cases()))
def test_a_bad_number_is_refused_in_one_line_naming_the_field(cls, required, name, kind, bad):
    always_bad = (bad is None or isinstance(bad, (str, bool)) or (isinstance(bad, float) and (math.isnan(bad) or
                  math.isinf(bad))) or (kind == "int" and isinstance(bad, float)))
    negative = not always_bad and bad < 0
    try:
        cls(**required, **{name: bad})
    except ValueError as e:
        msg = str(e)
        assert "\n" not in msg and msg, msg
        if always_bad or (negative and (cls, name) not in NEGATIVE_OK):
            assert name in msg, msg  # the generic check caught it, naming the field
        return
    # built: only a value that means something there (huge sizes are the run's to refuse, e.g. memory)
    assert not always_bad, f"{cls.__name__}.{name}={bad!r} was accepted"
    assert not negative or (cls, name) in NEGATIVE_OK, f"{cls.__name__}.{name}={bad!r} was accepted"


def test_the_check_allows_what_a_config_names():
    @dataclasses.dataclass(frozen=True)
    class C:
        limit: float = 0.0
        offset: int = 0

    check_numbers(C(limit=float("inf"), offset=-2), negative_ok=("offset",), infinite_ok=("limit",))
    with pytest.raises(ValueError, match="limit must be a finite number"):
        check_numbers(C(limit=float("inf")))
    with pytest.raises(ValueError, match="offset must be >= 0"):
        check_numbers(C(offset=-2))
