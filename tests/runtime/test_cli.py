"""Command lines from the config dataclasses: --config files (TOML, YAML), flags over files, --print-config."""

from __future__ import annotations

import tomllib
import typing
from pathlib import Path

import pytest
from click.testing import CliRunner

from extract.__main__ import main as extract_main
from extract.config import ExtractConfig
from extract.regenerate.__main__ import main as regen_main
from extract.regenerate.config import RegenConfig
from runtime.cli import field_docs, field_sections, load_config_file, to_toml
from train.__main__ import main as train_main
from train.config import TrainConfig
from train.eval import main as eval_main
from train.eval_config import EvalConfig
from train.export import ExportConfig
from train.export import main as export_main

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = {"extract": (extract_main, ExtractConfig), "train": (train_main, TrainConfig),
            "regenerate": (regen_main, RegenConfig), "export": (export_main, ExportConfig),
            "eval": (eval_main, EvalConfig)}


def _resolved(cmd, *args) -> dict:
    out = CliRunner().invoke(cmd, [*args, "--print-config"])
    assert out.exit_code == 0, out.output
    return tomllib.loads(out.stdout)


def test_every_field_is_an_option_with_its_docstring_as_help():
    for cmd, cls in COMMANDS.values():
        docs = field_docs(cls)
        opts = {p.name: p for p in cmd.params}
        for name in cls.__dataclass_fields__:
            assert name in opts, name
            assert opts[name].help == docs.get(name, ""), name
    assert field_docs(TrainConfig)["time_limit"].startswith("Seconds this process may train")


def test_help_lists_each_option_under_its_config_section_in_field_order():
    sections = field_sections(TrainConfig)
    assert sections["store"] == "the store and the run" and sections["num_layers"] == "the drafter"
    assert sections["val_samples"] == "held-out evaluation" and len(sections) == 7
    text = CliRunner().invoke(train_main, ["--help"]).output
    names = list(TrainConfig.__dataclass_fields__)
    at = lambda name: text.index("\n  --" + name.replace("_", "-"))  # the option's own line
    for after in list(sections)[1:]:
        # a section's heading comes after the last option of the section before it
        title = "\n" + sections[after][:1].upper() + sections[after][1:] + ":"
        assert at(names[names.index(after) - 1]) < text.index(title) < at(after)
    assert text.index("--print-config") < text.index("The store and the run:")
    assert field_sections(ExportConfig) == {}  # no sections: one plain "Options" list
    assert "Options:" in CliRunner().invoke(export_main, ["--help"]).output


def test_a_file_sets_values_and_flags_given_win(tmp_path):
    f = tmp_path / "t.toml"
    f.write_text('store = "s.zarr"\nout = "r"\nlr = 1e-3\nlayers = [1, 8]\ncompile = true\nepochs = 3\n')
    got = _resolved(train_main, "--config", str(f), "--epochs", "5", "--layers", "2,9")
    assert (got["store"], got["lr"], got["compile"]) == ("s.zarr", 1e-3, True)
    assert got["epochs"] == 5 and got["layers"] == [2, 9]  # flags over the file
    assert got["num_layers"] == 1  # neither: the default
    y = tmp_path / "t.yaml"
    y.write_text("store: s.zarr\nout: r\nnum-layers: 5\n")  # kebab keys as on the command line
    assert _resolved(train_main, "--config", str(y))["num_layers"] == 5


def test_print_config_round_trips_through_a_file(tmp_path):
    first = CliRunner().invoke(regen_main, ["--out", "o.jsonl", "--shard", "1/4", "--engine", "openai", "--model", "m",
                                            "--base-url", "http://a/v1,http://b/v1",
                                            "--print-config"]).stdout
    f = tmp_path / "r.toml"
    f.write_text(first)
    again = _resolved(regen_main, "--config", str(f))
    assert again == tomllib.loads(first) and again["shard"] == [1, 4] and again["base_url"] == ["http://a/v1", "http://b/v1"]
    assert tomllib.loads(to_toml(ExtractConfig(store="s", layers=(1, 2)).to_dict()))["layers"] == [1, 2]


@pytest.mark.parametrize("text,suffix,expect", [
    ('store = "s"\nbogus = 1\n', ".toml", "unknown key 'bogus'"),
    ('store = "s"\nlr = \n', ".toml", "not valid TOML.*line 2"),
    ("store: [unclosed\n", ".yaml", "not valid YAML"),
    ("- a\n- b\n", ".yaml", "expected key = value pairs"),
])
def test_a_bad_file_is_one_line_naming_it(tmp_path, text, suffix, expect):
    f = tmp_path / f"bad{suffix}"
    f.write_text(text)
    out = CliRunner().invoke(extract_main, ["--config", str(f)])
    assert out.exit_code == 2
    lines = [x for x in out.output.splitlines() if x.strip()]
    assert len(lines) == 1 and str(f) in lines[0] and "Traceback" not in out.output, out.output
    import re

    assert re.search(expect, lines[0]), lines[0]


def test_invalid_values_are_one_line_and_bad_lists_a_usage_error(tmp_path):
    out = CliRunner().invoke(extract_main, ["--store", "s", "--max-len", "1"])
    assert out.exit_code == 2 and out.output.strip() == "error: max_len must be >= 2, got 1"
    out = CliRunner().invoke(regen_main, ["--out", "o", "--shard", "3/2", "--print-config"])
    assert out.exit_code == 2 and "shard 3/2: expected i/n" in out.output
    out = CliRunner().invoke(train_main, ["--store", "s", "--out", "r", "--layers", "1,x"])
    assert out.exit_code == 2 and "expected int values separated by ','" in out.output


def test_the_presets_load_into_their_configs():
    kinds = {"extract.toml": ExtractConfig, "train.toml": TrainConfig, "regenerate.toml": RegenConfig}
    files = sorted((ROOT / "configs").glob("*/*.toml"))
    assert {f.parent.name for f in files} >= {"smollm2-demo", "smollm2-h200", "qwen3-8b-8gpu", "two-gpu-follow"}
    for f in files:
        cls = kinds[f.name]
        hints = typing.get_type_hints(cls)
        cls(**load_config_file(str(f), list(cls.__dataclass_fields__), hints))  # valid values, types, known keys


def test_a_config_file_value_of_another_type_is_one_line(tmp_path):
    from click.testing import CliRunner

    for line, why in (("compile = 1", "compile = 1 is a int; compile takes a bool"),
                      ("num_layers = 2.5", "num_layers = 2.5 is a float; num_layers takes a int"),
                      ("lr = true", "lr = True is a bool; lr takes a float"),
                      ('epochs = "3"', "epochs = '3' is a str; epochs takes a int")):
        f = tmp_path / "c.toml"
        f.write_text('store = "s"\nout = "r"\n' + line + "\n")
        out = CliRunner().invoke(train_main, ["--config", str(f)])
        assert out.exit_code == 2 and why in out.output and "Traceback" not in out.output, out.output


def test_a_repeated_or_negative_layer_id_is_refused_where_parsed():
    """--layers 1,1,8 would tap (or train on) the same layer twice: one line, before anything runs."""
    for cmd, base in ((train_main, ["--store", "s", "--out", "r"]), (extract_main, ["--store", "s"])):
        for layers in ("1,1,8", "-1,4"):
            out = CliRunner().invoke(cmd, [*base, "--layers", layers])
            assert out.exit_code != 0 and "layer ids must be distinct and >= 0" in out.output, out.output
            assert "Traceback" not in out.output
