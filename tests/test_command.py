"""The `draftcache` command: each subcommand is its stage's own command (the same object, so the same
options), listing them imports no stage, and a subcommand runs as its `python -m` form does."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from draftcache.command import SUBCOMMANDS, main

ROOT = Path(__file__).resolve().parents[1]


def test_each_subcommand_is_its_stages_own_command():
    for name, (module, attr, _, _) in SUBCOMMANDS.items():
        ctx = main.make_context("draftcache", [name, "--help"], resilient_parsing=True)
        assert main.get_command(ctx, name) is getattr(importlib.import_module(module), attr), name
    res = CliRunner().invoke(main, ["no-such-stage"])
    assert res.exit_code == 2 and "No such command 'no-such-stage'" in res.output


def test_the_listing_names_every_stage_and_imports_none():
    code = ("import sys; from draftcache.command import main\n"
            "try: main(['--help'])\nexcept SystemExit: pass\n"
            "print(sorted(m for m in ('torch', 'extract', 'train', 'cache_format') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "[]"
    listing = " ".join(p.stdout.split())  # help wraps its lines
    for name, (_, _, module_form, _) in SUBCOMMANDS.items():
        assert f" {name} " in listing and f"({module_form})" in listing


def test_a_subcommand_runs_as_its_python_m_form(tmp_path):
    from tests.helpers import make_manifest, write_store

    store = str(tmp_path / "s.zarr")
    write_store(store, range(5), make_manifest())
    args = ["inspect", store, "--json"]
    res = CliRunner().invoke(main, args)
    p = subprocess.run([sys.executable, "-m", "cache_format", *args], capture_output=True, text=True, cwd=ROOT,
                       timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert res.exit_code == 0 == p.returncode, res.output + p.stderr
    assert res.output == p.stdout
    bad = CliRunner().invoke(main, ["train", "--store", store, "--out", "/nonexistent/x", "--lr", "nan"])
    assert bad.exit_code == 2 and "lr" in bad.output
