"""Export: round trip, never destroying the previous export, --init-from, and serving in a fresh
process through AutoModel (the tiny target and the packaged SmolLM2), losslessly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import run_losses
from train.checkpoint import latest_checkpoint, load_checkpoint
from train.config import TrainConfig
from train.export import export_run, load_export
from train.model import DFlashDrafter, DrafterConfig
from train.trainer import train


def test_export_never_destroys_before_it_replaces(trained, tmp_path):
    _, _, run = trained
    good = export_run(run, str(tmp_path / "exp"))
    before = (good / "model.safetensors").read_bytes()
    with pytest.raises(ValueError):  # a mistyped --run: the old export stays whole
        export_run(str(tmp_path / "no-such-run"), str(good), overwrite=True)
    assert (good / "model.safetensors").read_bytes() == before
    for out in (run, str(Path(run) / "exp"), str(Path(run).parent)):  # the run itself, inside it, above it
        with pytest.raises(ValueError, match="run directory"):
            export_run(run, out, overwrite=True)
    assert latest_checkpoint(run) is not None
    export_run(run, str(good), overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]  # no partial or old copy left beside it


def test_export_round_trip(trained, tmp_path):
    _, _, run = trained
    out = export_run(run, str(tmp_path / "exp"))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 4
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 2] and cfg["num_target_layers"] == 4
    from safetensors.torch import load_file

    names = set(load_file(str(out / "model.safetensors")))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= names
    assert any(n.startswith("layers.0.self_attn.q_proj") for n in names)
    assert not any("embed" in n or "lm_head" in n for n in names)
    weights, _, state = load_checkpoint(latest_checkpoint(run))
    dc, exported, layer_ids = load_export(str(out))
    assert dc == DrafterConfig(**state["drafter"]) and layer_ids == [0, 2]
    g = torch.Generator().manual_seed(0)
    emb, head = torch.randn(dc.vocab_size, dc.hidden_size, generator=g), torch.randn(dc.vocab_size, dc.hidden_size, generator=g)
    a, b = DFlashDrafter(dc, emb, head), DFlashDrafter(dc, emb, head)
    a.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in weights.items()}, strict=False)
    b.load_state_dict({k: v.float() for k, v in exported.items()}, strict=False)
    taps, ids = torch.randn(1, 10, 2 * dc.hidden_size, generator=g), torch.randint(0, dc.vocab_size, (1, 4))
    pos = torch.arange(10)[None]
    la = a.logits(a(taps, pos, ids, torch.arange(10, 14)[None], None))
    lb = b.logits(b(taps, pos, ids, torch.arange(10, 14)[None], None))
    assert torch.equal(la, lb)


def test_init_from_an_export_starts_where_the_exported_drafter_was(trained, tmp_path):
    """--init-from: a new run starts from the export's weights (its first loss is the trained
    drafter's, not a fresh one's); an export of another shape is one line naming the difference."""
    _, _, run = trained
    store = str(Path(run).parent / "s.zarr")  # the fixture's store
    exp = export_run(run, str(tmp_path / "exp"))
    kw = dict(store=store, num_layers=2, block_size=4, num_anchors=64, epochs=10, max_steps=1, token_budget=2048,
              lr=3e-3, log_every=1, workers=0)
    train(TrainConfig(out=str(tmp_path / "fresh"), **kw))
    train(TrainConfig(out=str(tmp_path / "init"), init_from=str(exp), **kw))
    fresh, init, trained_last = run_losses(tmp_path / "fresh")[0], run_losses(tmp_path / "init")[0], run_losses(run)[-1]
    assert init < 0.5 * fresh and init < 2 * trained_last + 0.5, (init, fresh, trained_last)
    with pytest.raises(ValueError, match=r"--init-from .*exp.*num_layers 2 vs 1"):
        train(TrainConfig(out=str(tmp_path / "other"), init_from=str(exp), **{**kw, "num_layers": 1}))
    with pytest.raises(ValueError, match="not an exported drafter"):
        train(TrainConfig(out=str(tmp_path / "none"), init_from=str(tmp_path), **kw))
    data = (exp / "model.safetensors").read_bytes()
    (exp / "model.safetensors").write_bytes(data[: len(data) // 3])  # truncated weights
    with pytest.raises(ValueError, match="unreadable export") as e:
        train(TrainConfig(out=str(tmp_path / "cut"), init_from=str(exp), **kw))
    assert "\n" not in str(e.value)


def test_export_refuses_a_non_empty_out_unless_overwrite(trained, tmp_path):
    _, _, run = trained
    out = tmp_path / "exp"
    out.mkdir()
    (out / "stale.safetensors").write_text("another export's file")
    with pytest.raises(ValueError, match="not empty"):
        export_run(run, str(out))
    assert (out / "stale.safetensors").exists() and not (out / "config.json").exists()
    export_run(run, str(out), overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "decoding_state.py", "draft_tree.py",
                                                     "markov_head.py", "model.safetensors", "modeling_dflash.py"]
    export_run(run, str(out), overwrite=True)  # its own earlier export too needs --overwrite
    with pytest.raises(ValueError, match="not empty"):
        export_run(run, str(out))


# A user's load of an export, in a fresh process: AutoModel with trust_remote_code (the export's own
# modeling file, no draftcache import), its bf16 weights, spec_generate against the target in float32.
_SERVE = r"""
import json, sys, torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer
exp, target, n, prompts = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
tok = AutoTokenizer.from_pretrained(target)
tgt = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
drafter = AutoModel.from_pretrained(exp, trust_remote_code=True).eval()
assert "draftcache" not in sys.modules and "train" not in sys.modules
prompts = [json.loads(x)["messages"][0]["content"] for x in open(prompts)] if prompts else ["two plus two", "def f():"]
res = {"dtype": str(next(drafter.parameters()).dtype), "class": type(drafter).__name__, "runs": []}
for p in prompts:
    ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    want = tgt.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=[], pad_token_id=0)[0, ids.shape[1]:]
    got = drafter.spec_generate(tgt, ids, max_new_tokens=n, eos_token_id=[])
    new = got["sequences"][0, ids.shape[1]:]
    res["runs"].append({"same": new.tolist() == want.tolist(), "tau": len(new) / got["target_forwards"]})
print(json.dumps(res))
"""


def _serve(exp, target, n=24, prompts=""):
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": "", "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([sys.executable, "-c", _SERVE, str(exp), target, str(n), prompts], capture_output=True, text=True,
                       env=env, cwd=str(exp), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_export_serves_through_automodel_in_a_fresh_process_losslessly(trained, tmp_path):
    target, prompts, run = trained
    out = export_run(run, str(tmp_path / "exp"))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3]  # vLLM's count: the tap ids + 1
    assert cfg["dflash_config"]["mask_token_id"] == 300 and cfg["dflash_config"]["mask_token"] == ""
    assert cfg["dflash_config"]["tree_budget"] == 512  # spec_generate's default: the served run decodes a tree
    res = _serve(out, target, prompts=prompts)
    assert res["class"] == "DFlashDraftModel" and res["dtype"] == "torch.bfloat16"
    assert all(r["same"] for r in res["runs"]), res
    assert sum(r["tau"] for r in res["runs"]) / len(res["runs"]) > 1.5, res  # the overfit drafter, served in bf16


def test_a_full_disk_keeps_the_previous_export_and_checkpoint(trained, tmp_path):
    # a file-size limit stands in for a full disk: the write fails midway, the old files stay whole
    import resource
    import subprocess
    import sys

    _, _, run = trained
    good = export_run(run, str(tmp_path / "exp"))
    before = (good / "model.safetensors").read_bytes()
    limit = len(before) // 4

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "-m", "train.export", "--run", run, "--out", str(good), "--overwrite"],
                       cwd=root, capture_output=True, text=True, preexec_fn=small_files, timeout=120)
    assert p.returncode != 0 and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert (good / "model.safetensors").read_bytes() == before and (good / "config.json").exists()
    from train.checkpoint import save_checkpoint

    weights, _, state = load_checkpoint(latest_checkpoint(run))
    ck = tmp_path / "r"
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    save_checkpoint(ck, 1, model=model, optimizer=opt, scheduler=sched, state={"step": 1}, keep=3)
    code = (f"import resource, torch; resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)); "
            f"from train.checkpoint import save_checkpoint; m = torch.nn.Linear(64, 64); o = torch.optim.AdamW(m.parameters()); "
            f"s = torch.optim.lr_scheduler.LambdaLR(o, lambda x: 1.0); "
            f"save_checkpoint({str(ck)!r}, 2, model=m, optimizer=o, scheduler=s, state={{'step': 2}}, keep=3)")
    p = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert latest_checkpoint(ck).name == "step-1" and load_checkpoint(latest_checkpoint(ck))[2] == {"step": 1}


def test_an_export_finds_its_target_by_sha256_or_names_it(tmp_path):
    from target.loader import packaged_gguf, target_sha256
    from train.eval import _export_target

    exp = tmp_path / "exp"
    exp.mkdir()
    gguf = packaged_gguf()
    named = {"name": "model.gguf", "sha256": target_sha256(gguf), "path_hint": str(tmp_path / "gone.gguf")}
    (exp / "config.json").write_text(json.dumps({"draftcache_target": named}))
    assert _export_target(str(exp)) == gguf  # the hint is gone: the packaged target has the same sha256
    (exp / "config.json").write_text(json.dumps({"draftcache_target": {**named, "sha256": "ab" * 32}}))
    with pytest.raises(ValueError, match=r"trained for the target model.gguf \(sha256 abababababab.*--target"):
        _export_target(str(exp))


def test_export_of_a_packaged_target_drafter_is_lossless_when_served(tmp_path, packaged_hf_dir):
    """The packaged SmolLM2 as the target (as an HF directory, its GGUF converted): an untrained
    1-layer drafter at its shape, exported and served."""
    from train.export import write_export

    dc = DrafterConfig(hidden_size=576, intermediate_size=1536, num_layers=1, num_heads=9, num_kv_heads=3, head_dim=64,
                       vocab_size=49152, num_taps=2, block_size=8, mask_token_id=16, rope_theta=100000.0, rms_eps=1e-5)
    torch.manual_seed(0)
    weights = DFlashDrafter(dc, torch.zeros(1, 1), torch.zeros(1, 1)).state_dict()
    state = {"drafter": dc.to_dict(), "layer_ids": [1, 14], "mask_token": "<empty_output>", "num_target_layers": 30}
    out = write_export(tmp_path / "exp", state, weights)
    res = _serve(out, packaged_hf_dir, n=12)
    assert all(r["same"] for r in res["runs"]), res
