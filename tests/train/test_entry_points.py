"""Every entry point that reads an exported drafter makes the same checks: an export whose config
claims a layer its weights file lacks is refused in one line by each, never scored, decoded or
trained from at random init. (A damaged store's shards: test_checksums and test_val_store.)"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from train.checkpoint import load_checkpoint, resolve_checkpoint
from train.export import export_run


@pytest.fixture(scope="module")
def damaged(trained, tmp_path_factory):
    """(target, prompts, store, an export of the trained run whose config claims one layer more)."""
    target, prompts, run = trained
    out = export_run(run, str(tmp_path_factory.mktemp("dmg") / "e"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["num_hidden_layers"] += 1
    cfg["layer_types"].append("full_attention")
    (out / "config.json").write_text(json.dumps(cfg))
    return target, prompts, load_checkpoint(resolve_checkpoint(run))[2]["store"], str(out)


def _eval(target, prompts, store, export, tmp):
    from train.eval import main
    return main, ["--export", export, "--target", target, "--prompts", prompts, "--limit", "1", "--max-new-tokens", "4"]


def _replay(target, prompts, store, export, tmp):
    from train.replay_score import main
    return main, ["--store", store, "--export", export]


def _init_from(target, prompts, store, export, tmp):
    from train.__main__ import main
    return main, ["--store", store, "--out", str(tmp / "r"), "--num-layers", "3", "--block-size", "4",
                  "--max-steps", "1", "--workers", "0", "--init-from", export]


@pytest.mark.parametrize("entry", [_eval, _replay, _init_from], ids=["train.eval", "train.replay_score",
                                                                        "train --init-from"])
def test_each_entry_point_refuses_an_export_lacking_weights_in_one_line(damaged, tmp_path, entry):
    main, args = entry(*damaged, tmp_path)
    res = CliRunner().invoke(main, args)
    lines = [x for x in res.output.strip().splitlines() if x.strip()]
    assert res.exit_code == 2, res.output
    err = lines[-1]  # eval checks the served model (AutoModel's load), the others the training drafter's
    assert err.startswith("error: ") and ("weights lack" in err or "does not hold" in err), res.output
    assert f"{damaged[3]}: " in err and "layers.2." in err, res.output  # names the export and the tensor
    assert not any("Traceback" in x for x in lines)
