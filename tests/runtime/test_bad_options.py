"""Every stage's options with bad values, through the real command lines (`--print-config`: the config
is built and checked, nothing runs): a wrong type, NaN, an infinity or a negative number is refused in
one line, or taken as the very value given; never a traceback, never a silently different run."""

from __future__ import annotations

import dataclasses
import importlib
import math
import tomllib
import typing

import pytest
from click.testing import CliRunner

# command module, its config class, the options every invocation needs
STAGES = {
    "extract": ("extract.__main__", "extract.config:ExtractConfig", ["--store", "s.zarr"]),
    "regenerate": ("extract.regenerate.__main__", "extract.regenerate.config:RegenConfig", ["--out", "o.jsonl"]),
    "train": ("train.__main__", "train.config:TrainConfig", ["--store", "s.zarr", "--out", "run"]),
    "eval": ("train.eval", "train.eval_config:EvalConfig", ["--run", "run"]),
    "export": ("train.export", "train.export:ExportConfig", ["--run", "run", "--out", "e"]),
}
BAD = ["x", "nan", "inf", "-inf", "-1", "1e400"]


def _config_class(spec: str):
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def _numeric_fields(stage: str) -> list[tuple[str, type]]:
    cls = _config_class(STAGES[stage][1])
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cls) if hints[f.name] in (int, float)]


def _invoke(stage: str, args: list[str]):
    main = importlib.import_module(STAGES[stage][0]).main
    return CliRunner().invoke(main, [*STAGES[stage][2], *args, "--print-config"])


def _one_line_error(res) -> bool:
    errors = [x for x in res.output.splitlines() if "rror:" in x]
    return res.exit_code == 2 and len(errors) == 1 and "Traceback" not in res.output


@pytest.mark.parametrize("stage", list(STAGES))
def test_each_stage_without_its_required_options_is_one_line(stage):
    main = importlib.import_module(STAGES[stage][0]).main
    res = CliRunner().invoke(main, ["--print-config"])
    assert _one_line_error(res), res.output + repr(res.exception)


@pytest.mark.parametrize("stage", list(STAGES))
def test_every_numeric_option_refuses_bad_values_in_one_line_or_keeps_them_exactly(stage):
    checked = 0
    for name, kind in _numeric_fields(stage):
        flag = "--" + name.replace("_", "-")
        for value in BAD:
            res = _invoke(stage, [flag, value])
            if res.exit_code == 0:  # taken: it must be the number given, finite
                got = tomllib.loads(res.output)[name]
                want = kind(float(value)) if kind is int else float(value)
                assert math.isfinite(got) and got == want, (stage, flag, value, got)
                assert value not in ("x", "nan", "inf", "-inf", "1e400"), (stage, flag, value)
            else:
                assert _one_line_error(res), (stage, flag, value, res.output, repr(res.exception))
            checked += 1
    assert checked or stage == "export", stage  # export alone has no numeric option


def _typed_fields(stage: str, wanted) -> list[tuple[str, object]]:
    cls = _config_class(STAGES[stage][1])
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cls) if wanted(hints[f.name])]


def _is_tuple(kind) -> bool:
    return typing.get_origin(kind) is tuple


@pytest.mark.parametrize("stage", list(STAGES))
def test_every_text_option_refuses_a_bad_value_in_one_line_or_keeps_it_exactly(stage):
    """A text option given an empty, a blank or an unknown value: refused in one line, or taken as given."""
    for name, _ in _typed_fields(stage, lambda k: k is str):
        flag = "--" + name.replace("_", "-")
        for value in ("", "   ", "no-such-choice", "nan"):
            res = _invoke(stage, [flag, value])
            if res.exit_code == 0:
                assert tomllib.loads(res.output)[name] == value, (stage, flag, value)
            else:
                assert _one_line_error(res), (stage, flag, value, res.output, repr(res.exception))


@pytest.mark.parametrize("stage", list(STAGES))
def test_every_list_option_refuses_bad_items_in_one_line_or_keeps_them_exactly(stage):
    """A list option (layer ids, tree budgets, shards, URLs) given junk, a negative or a NaN item."""
    for name, kind in _typed_fields(stage, _is_tuple):
        flag = "--" + name.replace("_", "-")
        numeric = typing.get_args(kind)[0] is int
        for value in ("x", "1,x", "nan", "-1", "1,,2", "1e400", " , ") if numeric else ("", " , ", "x,,y"):
            res = _invoke(stage, [flag, value])
            if res.exit_code == 0:  # taken: every item as given
                got = tomllib.loads(res.output)[name]
                want = [] if not value.strip() else [int(v) if numeric else v for v in value.split(",")]
                assert got == want, (stage, flag, value, got)
            else:
                assert _one_line_error(res), (stage, flag, value, res.output, repr(res.exception))
