"""`python -m bench peers`: a store's samples in speculators' offline layout, and a speculators
checkpoint converted to our export, checked tensor by tensor against what they came from."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from bench.peers_bench import convert_checkpoint, write_peer_hidden, write_peer_rows
from cache_format import StoreReader
from extract.config import ExtractConfig
from extract.run import run as extract
from tests.helpers import tiny_target_dir, train_cfg, write_chats
from train.export import export_run
from train.trainer import train

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def peer_store(tmp_path_factory):
    """A tiny store of taps 0 and 2 and the final state after the norm, as the peer needs."""
    d = tmp_path_factory.mktemp("peer")
    target = tiny_target_dir(d / "t", "qwen3")
    model = AutoModelForCausalLM.from_pretrained(target)  # a final norm of weights not all 1, as trained ones
    model.model.norm.weight.data = torch.linspace(0.5, 2.0, 32)
    model.save_pretrained(target)
    data = write_chats(d / "chats.jsonl", 12, cyclic=True)
    extract(ExtractConfig(store=str(d / "s.zarr"), target=target, data=data, layers=(0, 2), max_len=256,
                          min_supervised=4, token_budget=1024, rows_per_shard=256, last_hidden=True))
    return str(d / "s.zarr")


def test_peer_rows_then_hidden_files_in_the_prepared_order(peer_store, tmp_path):
    reader = StoreReader(peer_store)
    assert write_peer_rows(peer_store, str(tmp_path / "p"))["rows"] == len(reader)
    rows = [json.loads(x) for x in (tmp_path / "p" / "rows.jsonl").read_text().splitlines()]
    samples = [reader.get(int(sid)) for sid in reader.sample_ids]
    assert [r["input_ids"] for r in rows] == [s.input_ids.tolist() for s in samples]
    assert [r["loss_mask"] for r in rows] == [s.loss_mask.tolist() for s in samples]
    order = [rows[i]["input_ids"] for i in torch.randperm(len(rows), generator=torch.Generator().manual_seed(0))]
    res = write_peer_hidden(peer_store, str(tmp_path / "p"), order, procs=2)  # prepare-data shuffles its rows
    assert res["rows"] == len(order) and res["taps"] == 3 and not (tmp_path / "p" / "hidden_states.partial").exists()
    norm = Qwen3RMSNorm(32, eps=1e-6)
    norm.weight.data = reader.frozen()["norm.weight"].float()
    by_tokens = {tuple(s.input_ids.tolist()): s for s in samples}
    for i, ids in enumerate(order):
        s, hs = by_tokens[tuple(ids)], load_file(str(tmp_path / "p" / "hidden_states" / f"hs_{i}.safetensors"))
        t = len(ids)
        assert hs["hidden_states"].dtype == torch.bfloat16 and hs["hidden_states"].shape == (t, 3, 32)
        assert torch.equal(hs["hidden_states"][:, :2].reshape(t, -1), s.hidden)
        # the extra entry is what the teacher normalizes: the target's final norm gives the stored state back
        torch.testing.assert_close(norm(hs["hidden_states"][:, 2].float()), s.last_hidden.float(), atol=0.05, rtol=0.02)
        assert hs["token_ids"].tolist() == ids
    with pytest.raises(ValueError, match="exists"):
        write_peer_hidden(peer_store, str(tmp_path / "p"), order)
    with pytest.raises(ValueError, match="1 prepared rows .*row 0.* are no sample"):
        write_peer_hidden(peer_store, str(tmp_path / "q"), [[1, 2, 3]] + order)


def test_peer_rows_refuse_a_store_without_the_final_state(tmp_path):
    target = tiny_target_dir(tmp_path / "t", "qwen3")
    store = str(tmp_path / "s.zarr")
    extract(ExtractConfig(store=store, target=target, data=write_chats(tmp_path / "c.jsonl", 4), layers=(0, 2),
                          max_len=256, min_supervised=4, token_budget=1024, last_hidden=False))
    with pytest.raises(ValueError, match="no final hidden state.*--last-hidden"):
        write_peer_rows(store, str(tmp_path / "p"))
    p = subprocess.run([sys.executable, "-m", "bench", "peers", "rows", "--store", store, "--out", str(tmp_path / "q")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.startswith("error: ") and len(p.stderr.strip().splitlines()) == 1


def _as_speculators(export: Path, dst: Path, **cfg_over) -> Path:
    """Our export rewritten as speculators 0.9.0 writes a DSpark checkpoint: its config schema, the
    frozen target copies, a verifier norm and a confidence head beside the same drafting weights."""
    ours = json.loads((export / "config.json").read_text())
    w = load_file(str(export / "model.safetensors"))
    h, v = ours["hidden_size"], ours["vocab_size"]
    extra = {"embed_tokens.weight": torch.zeros(v, h), "lm_head.weight": torch.zeros(v, h),
             "verifier_lm_head.weight": torch.zeros(v, h), "verifier_norm.weight": torch.ones(h),
             "confidence_head.proj.weight": torch.zeros(1, h)}
    t = {k: ours[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                              "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters", "vocab_size")}
    t["layer_types"] = ["full_attention"] * ours["num_hidden_layers"]
    cfg = {"speculators_model_type": "dspark", "transformer_layer_config": t, "draft_vocab_size": v,
           "block_size": ours["block_size"], "mask_token_id": ours["dflash_config"]["mask_token_id"],
           "aux_hidden_state_layer_ids": ours["eagle_aux_hidden_state_layer_ids"], "sample_from_anchor": False,
           "markov_rank": ours["markov_rank"], "markov_head_type": "vanilla", **cfg_over}
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file({**w, **extra}, str(dst / "model.safetensors"))
    return dst


def test_a_speculators_checkpoint_converts_to_the_export_it_came_from(peer_store, tmp_path):
    run = tmp_path / "run"
    train(train_cfg(peer_store, run, max_steps=2, markov_rank=4))
    ours = export_run(str(run), str(tmp_path / "ours"))
    ck = _as_speculators(ours, tmp_path / "ck")
    back = convert_checkpoint(str(ck), peer_store, str(tmp_path / "back"))
    a, b = load_file(str(ours / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ca, cb = (json.loads((d / "config.json").read_text()) for d in (ours, back))
    assert ca == cb  # dims, taps, mask token, head and the target's identity alike
    bad = {"sample_from_anchor": True}, {"markov_head_type": "gated"}, {"speculators_model_type": "eagle3"}
    for i, over in enumerate(bad):
        with pytest.raises(ValueError, match="anchor|vanilla|only dflash"):
            convert_checkpoint(str(_as_speculators(ours, tmp_path / f"bad{i}", **over)), peer_store,
                               str(tmp_path / f"x{i}"))
    sliding = _as_speculators(ours, tmp_path / "sliding")
    cfg = json.loads((sliding / "config.json").read_text())
    cfg["transformer_layer_config"]["layer_types"][0] = "sliding_attention"
    (sliding / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="--full-attention-indices"):
        convert_checkpoint(str(sliding), peer_store, str(tmp_path / "y"))


@pytest.mark.parametrize("markov_rank", [0, 4])
def test_our_export_in_the_speculators_layout_converts_back_to_our_export(peer_store, tmp_path, markov_rank):
    """train.export --layout speculators, read by the converter that reads speculators' own
    checkpoints, gives back tensor for tensor the export in our layout."""
    run = tmp_path / "run"
    train(train_cfg(peer_store, run, max_steps=2, markov_rank=markov_rank))
    ours = export_run(str(run), str(tmp_path / "ours"))
    spec = export_run(str(run), str(tmp_path / "spec"), layout="speculators")
    cfg = json.loads((spec / "config.json").read_text())
    assert cfg["speculators_model_type"] == ("dspark" if markov_rank else "dflash")
    assert cfg["aux_hidden_state_layer_ids"] == [1, 3] and cfg["sample_from_anchor"] is False
    assert sorted(p.name for p in spec.iterdir()) == ["config.json", "model.safetensors"]
    back = convert_checkpoint(str(spec), peer_store, str(tmp_path / "back"))
    a, b = load_file(str(ours / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((ours / "config.json").read_text()) == json.loads((back / "config.json").read_text())
    p = subprocess.run([sys.executable, "-m", "train.export", "--run", str(run), "--out", str(tmp_path / "x"),
                        "--layout", "speculators", "--draft-head"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode != 0 and "--draft-head" in p.stderr and "Traceback" not in p.stderr


# the lines of a speculators 0.9.0 probe run that plan reads, as its H200 log printed them (rich wraps
# its key=value lines; tqdm's rewrites of one bar are carriage returns, turned into lines by the reader)
PROBE_LOG = """\
                    profile/opt_ms=113.303,
                    profile/step_ms=8.01e+04,
                    profile/tokens_per_s=200.791,
Epoch 0  57% ━━━━━━━━━━━━━━╸            119/209  [ 0:01:28 < 0:00:07 , 14 it/s ]
                    profile/step_ms=100.375,
Epoch 0 100% ━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━ 5/5  [ 0:00:43 < 0:00:00 , 70 it/s ]
"""


def test_the_plan_fits_the_steps_after_the_first_into_the_seconds_and_the_epochs_just_hold_them():
    from bench.peers_bench import probe_plan

    got = probe_plan(PROBE_LOG, 180)
    steps = int(0.95 * (180 - 80.1) / 0.100375)  # the first step's compile, then steady steps
    assert got == {"steps": steps, "epochs": 5, "steps_per_epoch": 209, "first_step_s": 80.1, "step_ms": 100.375}
    assert probe_plan(PROBE_LOG, 180 + 209 * 0.100375 / 0.95)["epochs"] == 6
    with pytest.raises(ValueError, match="no step fits 60 s"):
        probe_plan(PROBE_LOG, 60)
    with pytest.raises(ValueError, match="fewer than two profile lines"):
        probe_plan(PROBE_LOG.split("Epoch 0  57%")[0], 180)
