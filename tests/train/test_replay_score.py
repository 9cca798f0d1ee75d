"""python -m train.replay_score: an export scores as its checkpoint does (up to bf16 weights); a
store it cannot read is one line. (Replayed τ equals real decoding: test_eval.py.)"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from train.checkpoint import load_checkpoint, resolve_checkpoint
from train.export import export_run
from train.replay_score import main, replay_score


def test_an_export_scores_like_its_checkpoint_and_the_cli_prints_it(trained, tmp_path):
    _, _, run = trained
    store = load_checkpoint(resolve_checkpoint(run))[2]["store"]
    ck = replay_score(store, run=run)
    assert 1.5 < ck["val_decode_tau"] <= 4  # the overfit drafter is accepted (block 4)
    out = export_run(run, str(tmp_path / "e"))
    ex = replay_score(store, export=str(out))
    assert ex["val_decode_tau"] == pytest.approx(ck["val_decode_tau"], rel=0.05)  # bf16 weights
    res = CliRunner().invoke(main, ["--store", store, "--export", str(out), "--json"])
    assert res.exit_code == 0 and json.loads(res.output)["val_decode_tau"] == ex["val_decode_tau"]
    # --samples: a subset scores as a store of only those samples would: by token and forward sums
    parts = [replay_score(store, run=run, samples=s) for s in ((0, 1, 2), (3, 4, 5))]
    assert [p["samples"] for p in parts] == [3, 3]
    assert min(p["val_decode_tau"] for p in parts) <= ck["val_decode_tau"] <= max(p["val_decode_tau"] for p in parts)


def test_a_store_the_drafter_cannot_read_is_one_line(trained, store, tmp_path):
    _, _, run = trained
    res = CliRunner().invoke(main, ["--store", store, "--run", run])  # the qwen3 store: another target
    assert res.exit_code == 2 and res.output.startswith("error: ") and "another target" in res.output
    assert len(res.output.strip().splitlines()) == 1
    with pytest.raises(ValueError, match="--run .* or --export"):
        replay_score(store)
    with pytest.raises(ValueError, match="holds no sample 99"):
        replay_score(load_checkpoint(resolve_checkpoint(run))[2]["store"], run=run, samples=(0, 99))


def test_each_domain_scores_as_its_samples_alone(trained, monkeypatch, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    import train.replay_score as rs

    _, _, run = trained
    store = load_checkpoint(resolve_checkpoint(run))[2]["store"]
    out = export_run(run, str(tmp_path / "e"))  # made worse, so that its answers decode at different τ
    w = load_file(out / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    w = {k: v + 0.5 * v.float().std() * torch.randn(v.shape, generator=g).to(v.dtype) if k.startswith("layers.0.") else v
         for k, v in w.items()}
    save_file(w, out / "model.safetensors", metadata={"format": "pt"})
    groups = {"math": (0, 1, 2), "chat": (3, 5)}  # as domain_groups would name a validation store's answers
    monkeypatch.setattr(rs, "domain_groups", lambda reader, rows: {d: torch.tensor(ids) for d, ids in groups.items()})
    whole = replay_score(store, export=str(out), token_budget=1)  # one answer a micro-batch: most lack a group
    alone = {d: replay_score(store, export=str(out), samples=ids)["val_decode_tau_96"] for d, ids in groups.items()}
    assert whole["val_decode_tau_96_by_domain"] == pytest.approx(alone, rel=1e-6)
    assert abs(alone["math"] - alone["chat"]) > 0.01  # the groups differ, so a mix-up of rows would show
    res = CliRunner().invoke(main, ["--store", store, "--export", str(out)])
    assert res.exit_code == 0 and f"math: first 96 tokens {alone['math']:.3f}" in res.output


def test_an_export_whose_weights_lack_what_its_config_claims_is_one_line(trained, tmp_path):
    _, _, run = trained
    store = load_checkpoint(resolve_checkpoint(run))[2]["store"]
    out = export_run(run, str(tmp_path / "e"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["num_hidden_layers"] += 1  # a layer the weights file does not hold would score at random init
    cfg["layer_types"].append("full_attention")
    (out / "config.json").write_text(json.dumps(cfg))
    res = CliRunner().invoke(main, ["--store", store, "--export", str(out)])
    assert res.exit_code == 2 and "does not hold what config.json describes" in res.output and "layers.2." in res.output
    assert len(res.output.strip().splitlines()) == 1
