"""Speculative decoding is lossless; an overfit drafter gets tau > 1; export round trip; JSON contract."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from tests.helpers import tiny_target_dir, write_chats
from train.checkpoint import latest_checkpoint, load_checkpoint
from train.config import TrainConfig
from train.eval import main as eval_main
from train.export import export_run, load_export
from train.model import DFlashDrafter, DrafterConfig
from train.trainer import train


def _store_of_greedy_outputs(target_dir: str, prompts: str, store: str, new_tokens: int) -> None:
    """A store whose samples are the target's own greedy continuations, built from token ids.

    Going through text (extract.regenerate) does not work for a random target: its garbage
    byte tokens do not survive decode -> re-encode, so the stored sequences would not be what the
    target generates and no drafter could be accepted.
    """
    from cache_format import DatasetInfo, Manifest, ShardWriter, create_store, finalize_store, write_frozen
    from cache_format.conversations import read_conversations
    from cache_format.target import capture, frozen_parts, load_target
    from train.spec_decode import target_generate

    t = load_target(target_dir, device=torch.device("cpu"))
    m = Manifest(target=t.info, tokenizer_sha256=t.tokenizer_sha256, layer_ids=(0, 2), mask_token_id=300, last_hidden=True,
                 dataset=DatasetInfo(path=prompts, sha256="-", num_records=6), max_len=256,
                 bucket_bounds=(256,), rows_per_shard=256, rows_per_chunk=32)
    create_store(store, m)
    write_frozen(store, frozen_parts(t.model))
    with ShardWriter(store, writer_id=0) as w, capture(t.model, [0, 2]) as taps, torch.no_grad():
        for sid, msgs in read_conversations(prompts, skip_bad=False):
            msgs = [x for x in msgs if x["role"] != "assistant"]
            ids = list(t.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])
            out = target_generate(t.model, ids, max_new_tokens=new_tokens, eos=set()).tokens
            seq = torch.tensor(ids + out)
            last = t.model.model(seq[None]).last_hidden_state[0]
            mask = torch.tensor([0] * len(ids) + [1] * len(out))
            w.add(sid, input_ids=seq, loss_mask=mask, hidden=torch.cat([taps[0][0], taps[2][0]], -1), last_hidden=last)
    finalize_store(store, m)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("ev")
    target = tiny_target_dir(d / "t", "llama", num_layers=4, hidden=64, seed=1)
    prompts = write_chats(d / "p.jsonl", 6)
    store = str(d / "s.zarr")
    _store_of_greedy_outputs(target, prompts, store, new_tokens=40)
    run = str(d / "run")
    train(TrainConfig(store=store, out=run, num_layers=2, block_size=4, num_anchors=64, epochs=1000, max_steps=150,
                      token_budget=2048, lr=3e-3, log_every=50, workers=0))
    return target, prompts, run


def _eval(run, prompts, *extra):
    out = CliRunner().invoke(eval_main, ["--run", run, "--prompts", prompts, "--max-new-tokens", "24", "--json", *extra])
    assert out.exit_code == 0, out.output
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    assert lines, out.output[-2000:]
    return json.loads(lines[-1])


def test_overfit_drafter_tau_above_one_and_lossless(trained):
    _, prompts, run = trained
    res = _eval(run, prompts, "--teacher-forced")
    for key in ("tau", "lossless", "num_prompts", "new_tokens", "speedup", "baseline_prompt_lookup_tau",
                "acceptance_histogram"):
        assert key in res
    assert res["lossless"] is True and res["num_prompts"] == 6
    assert res["tau"] > 1.5, res
    assert sum(int(k) * v for k, v in res["acceptance_histogram"].items()) == res["new_tokens"]
    assert res["draft_vocab_coverage"] == 1.0  # the whole vocabulary: no greedy token lies outside
    assert res["rejections_outside_vocab"] == 0.0
    rows = json.loads((Path(run) / "eval.json").read_text())["prompts"]
    # per answer: the tokens after the prefill's first over the forwards after the prefill
    per = [(r["new_tokens"] - 1) / (r["target_forwards"] - 1) for r in rows if r["target_forwards"] > 1]
    assert abs(res["tau_per_response"] - sum(per) / len(per)) < 1e-9, res
    assert list(res["tau_by_source"]) == [prompts] and abs(res["tau_by_source"][prompts] - res["tau"]) < 1e-9
    # drafting at every anchor of the greedy output, then walking those acceptances as decoding
    # does, takes decoding's own steps (float32: the context computed at once equals it built up)
    tf = res["teacher_forced"]
    assert tf["chain_equals_decode"] == 1.0 and abs(tf["tau_chain"] - res["tau"]) < 1e-9, tf
    assert tf["anchors"] == 6 * (24 - 4 + 1) and 1.0 <= tf["tau_all_anchors"] <= 4.0, tf
    assert abs(res["prompt_lookup_tau_by_source"][prompts] - res["baseline_prompt_lookup_tau"]) < 1e-9


def _assert_replay_equals_decoding(target: str, run: str) -> None:
    """val_decode_tau of the run's latest checkpoint (one batched training forward with an anchor at
    every response position, decoding replayed along the stored greedy answer) equals speculative
    decoding with the same weights against the real target, prompt by prompt and over the held-out pass."""
    from cache_format import StoreReader
    from cache_format.target import load_target
    from train.data import BatchDataset, CollateSettings
    from train.export import hf_drafter
    from train.losses import default_gamma
    from train.replay import replay_counts
    from train.start import build_drafter
    from train.step import LossSettings, evaluate_holdout, forward_loss

    weights, _, state = load_checkpoint(latest_checkpoint(run))
    store = state["store"]
    reader = StoreReader(store)
    dc = DrafterConfig(**state["drafter"])
    model = build_drafter(dc, reader.frozen(), weights.get("draft_ids"))
    model.load_state_dict(weights, strict=False)
    every = CollateSettings(tap_index=(0, 1), num_stored_taps=2, num_anchors=10_000, block_size=dc.block_size,
                            mask_token_id=dc.mask_token_id, with_last_hidden=False)
    loss = LossSettings(block_size=dc.block_size, gamma=default_gamma(dc.block_size))
    tgt = load_target(target, device=torch.device("cpu")).model
    served = hf_drafter(state, weights).eval()
    ids = [int(x) for x in reader.sample_ids]
    new_total = forwards_total = 0
    for sid in ids:
        batch = BatchDataset(store, [[sid]], [0], every, seed=0, epoch=-1)[0]
        with torch.no_grad():
            out = forward_loss(model, batch, loss, replay=True)
        tokens, forwards = replay_counts(batch["anchors"], out["accepts"], batch["anchor_span"])
        sample = reader.get_batch([sid])[0]
        p = int(sample.loss_mask.nonzero()[0])
        spec = served.spec_generate(tgt, sample.input_ids[None, :p], max_new_tokens=len(sample.input_ids) - p,
                                    eos_token_id=[])
        assert spec["sequences"][0].tolist() == sample.input_ids.tolist()  # the store holds the greedy path
        assert (int(tokens), int(forwards)) == (len(sample.input_ids) - p, spec["target_forwards"]), sid
        new_total, forwards_total = new_total + int(tokens), forwards_total + spec["target_forwards"]
    assert forwards_total < 0.8 * new_total  # the drafter is accepted: the check is not 1 == 1
    held = BatchDataset(store, [ids], [0], every, seed=0, epoch=-1)  # all prompts in one padded batch
    row = evaluate_holdout(model, held, torch.device("cpu"), world=1, loss=loss)
    assert row["val_decode_tau"] == pytest.approx(new_total / forwards_total, rel=1e-6)


def test_replayed_decoding_tau_equals_real_decoding(trained):
    target, _, run = trained
    _assert_replay_equals_decoding(target, run)


def _assert_vocab_coverage(target: str, prompts: str, run: str, ids: set[int], got: float) -> None:
    """The reported coverage equals the share of the target's own greedy tokens (decoded here again,
    prompt by prompt) that lie in the drafter's vocabulary `ids`."""
    from cache_format.target import chat_ids, eos_ids, load_target
    from train.eval import _answer_earlier_turns, _prompts
    from train.spec_decode import target_generate

    tgt = load_target(target, device=torch.device("cpu"), dtype=torch.float32)  # as train.eval decodes
    eos = set(eos_ids(tgt.tokenizer, tgt.model))
    inside = total = 0
    for _, msgs in _prompts(prompts, 0):
        msgs = _answer_earlier_turns(tgt.model, tgt.tokenizer, msgs, max_new_tokens=24, eos=eos)  # as train.eval
        toks = target_generate(tgt.model, chat_ids(tgt.tokenizer, msgs), max_new_tokens=24, eos=eos).tokens
        inside, total = inside + sum(t in ids for t in toks), total + len(toks)
    assert total and abs(got - inside / total) < 1e-12, (got, inside, total)
    rows = json.loads((Path(run) / "eval.json").read_text())["prompts"]
    assert sum(r["greedy_tokens"] for r in rows) == total


def test_a_draft_vocabulary_drafter_decodes_losslessly_as_trained_and_as_served(trained, tmp_path):
    """--draft-vocab N: the drafter proposes only the N most frequent answer tokens (here fewer than
    the answers use, so some labels lie outside); its replayed τ equals real decoding, and the export
    (draft_ids in its weights) decodes losslessly through AutoModel."""
    import numpy as np

    from cache_format import StoreReader

    target, prompts, run = trained
    store = str(Path(run).parent / "s.zarr")
    reader = StoreReader(store)
    answers = np.concatenate([s.input_ids[s.loss_mask.bool()].numpy() for s in reader.get_batch(reader.sample_ids)])
    n = len(set(answers.tolist())) - 3  # three answer tokens can never be drafted
    vr = str(tmp_path / "vocab-run")
    train(TrainConfig(store=store, out=vr, num_layers=2, block_size=4, num_anchors=64, epochs=1000, max_steps=150,
                      token_budget=2048, lr=3e-3, log_every=50, workers=0, draft_vocab=n))
    weights, _, state = load_checkpoint(latest_checkpoint(vr))
    assert weights["draft_ids"].shape == (n,) and state["drafter"]["draft_vocab_size"] == n
    assert 0.9 < state["draft_vocab_coverage"] < 1.0 and len(answers) > 100
    _assert_replay_equals_decoding(target, vr)
    out = export_run(vr, str(tmp_path / "exp"), whole_head=False)
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == n
    res = _eval(vr, prompts, "--export", str(out), "--no-prompt-lookup", "--draft-head")
    assert res["lossless"] is True and res["export"]["lossless"] is True and res["export"]["tau"] > 1.3, res
    assert res["whole_head"] is False and res["export"]["draft_vocab_coverage"] == res["draft_vocab_coverage"]
    assert res["baseline_prompt_lookup_tau"] is None and res["prompt_lookup_tau_by_domain"] is None
    _assert_vocab_coverage(target, prompts, vr, set(weights["draft_ids"].tolist()), res["draft_vocab_coverage"])
    rows = json.loads((Path(vr) / "eval.json").read_text())["prompts"]
    assert 0 <= sum(r["rejections_outside_vocab"] for r in rows) <= sum(r["rejections"] for r in rows)
    assert res["rejections_outside_vocab"] == sum(r["rejections_outside_vocab"] for r in rows) / max(
        1, sum(r["rejections"] for r in rows))
    # served from the target's whole lm_head (the default export): no draft_ids, still lossless
    whole = export_run(vr, str(tmp_path / "whole"))
    assert json.loads((whole / "config.json").read_text())["draft_vocab_size"] == 0
    from safetensors import safe_open

    with safe_open(str(whole / "model.safetensors"), "pt") as f:
        assert "draft_ids" not in set(f.keys())
    res = _eval(vr, prompts, "--export", str(whole), "--no-prompt-lookup")  # the checkpoint: whole head too
    assert res["export"]["lossless"] is True and res["export"]["draft_vocab_coverage"] == 1.0, res["export"]
    assert res["whole_head"] is True and res["draft_vocab_coverage"] == 1.0 and res["lossless"] is True
    # it starts a run on a draft vocabulary again (--init-from); the draft-head export a whole-vocabulary run not
    kw = dict(store=store, num_layers=2, block_size=4, num_anchors=64, epochs=10, max_steps=1, token_budget=2048,
              lr=3e-3, log_every=1, workers=0)
    train(TrainConfig(out=str(tmp_path / "again"), init_from=str(whole), draft_vocab=n, **kw))
    assert _losses(tmp_path / "again")[0] < 2 * _losses(vr)[-1] + 0.5
    with pytest.raises(ValueError, match=f"draft_vocab_size {n} vs 0"):
        train(TrainConfig(out=str(tmp_path / "full"), init_from=str(out), **kw))
    text = CliRunner().invoke(eval_main, ["--run", vr, "--prompts", prompts, "--limit", "2", "--max-new-tokens", "8",
                                          "--no-prompt-lookup"])
    assert text.exit_code == 0 and "tau by domain" in text.output and "prompt lookup" not in text.output, text.output


def test_multiturn_held_out_chats_are_measured_on_their_second_turn(trained):
    from cache_format.prompts import heldout_multiturn

    chats = heldout_multiturn()
    assert len(chats) >= 20 and all([m["role"] for m in c] == ["user", "user"] for _, c in chats)
    _, _, run = trained
    res = _eval(run, "multiturn", "--limit", "2")
    assert res["num_prompts"] == 2 and res["lossless"] is True
    assert list(res["tau_by_domain"]) == ["chat, second turn"]


def test_earlier_turns_are_answered_by_the_target_before_the_last_is_measured(trained):
    from cache_format.target import chat_ids, load_target
    from train.eval import _answer_earlier_turns
    from train.spec_decode import target_generate

    target, _, _ = trained
    t = load_target(target, device=torch.device("cpu"))
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "one"},
            {"role": "assistant", "content": "stale"}, {"role": "user", "content": "two"}]
    got = _answer_earlier_turns(t.model, t.tokenizer, msgs, max_new_tokens=5, eos=set())
    reply = target_generate(t.model, chat_ids(t.tokenizer, msgs[:2]), max_new_tokens=5, eos=set()).tokens
    assert [m["role"] for m in got] == ["system", "user", "assistant", "user"]
    assert got[2]["content"] == t.tokenizer.decode(reply, skip_special_tokens=True).strip() != "stale"


def test_wrong_drafter_is_still_lossless(trained, tmp_path):
    _, prompts, run = trained
    weights, _, state = load_checkpoint(latest_checkpoint(run))
    bad = {k: torch.randn_like(v) for k, v in weights.items()}
    from safetensors.torch import save_file

    ck = tmp_path / "bad"
    ck.mkdir()
    save_file(bad, str(ck / "model.safetensors"))
    (ck / "state.json").write_text(json.dumps(state))
    res = _eval(run, prompts, "--checkpoint", str(ck))
    assert res["lossless"] is True and res["tau"] < 1.2


def test_a_diverged_drafter_is_neither_evaluated_nor_exported(trained, tmp_path):
    from safetensors.torch import save_file

    _, prompts, run = trained
    weights, _, state = load_checkpoint(latest_checkpoint(run))
    ck = tmp_path / "runs" / "nan" / "checkpoints" / "step-1"
    ck.mkdir(parents=True)
    save_file({k: torch.full_like(v, float("nan")) for k, v in weights.items()}, str(ck / "model.safetensors"))
    (ck / "state.json").write_text(json.dumps(state))
    out = CliRunner().invoke(eval_main, ["--run", str(tmp_path / "runs" / "nan"), "--prompts", prompts, "--limit", "1"])
    assert out.exit_code == 2 and "NaN or inf" in out.output and "Traceback" not in out.output
    with pytest.raises(ValueError, match="NaN or inf"):
        export_run(str(tmp_path / "runs" / "nan"), str(tmp_path / "exp"))
    assert not (tmp_path / "exp").exists()


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


def _losses(run) -> list[float]:
    """The training rows' losses of a run, in order (held-out rows have val_loss only)."""
    with open(Path(run) / "metrics.jsonl") as f:
        return [r["loss"] for r in map(json.loads, f) if "loss" in r]


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
    fresh, init, trained_last = _losses(tmp_path / "fresh")[0], _losses(tmp_path / "init")[0], _losses(run)[-1]
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


def test_tau_by_source_is_token_weighted():
    from train.eval_report import by_source

    rows = [{"prompt": "gsm8k/0", "new_tokens": 30, "target_forwards": 10, "prompt_lookup_new_tokens": 30,
             "prompt_lookup_target_forwards": 20},
            {"prompt": "gsm8k/1", "new_tokens": 10, "target_forwards": 10, "prompt_lookup_new_tokens": 10,
             "prompt_lookup_target_forwards": 10},
            {"prompt": "HumanEval/0", "new_tokens": 12, "target_forwards": 12, "prompt_lookup_new_tokens": 12,
             "prompt_lookup_target_forwards": 6}]
    got = by_source(rows)
    assert got["tau_by_source"] == {"gsm8k": 2.0, "HumanEval": 1.0}  # 40/20, not the mean of 3.0 and 1.0
    assert got["prompt_lookup_tau_by_source"] == {"gsm8k": 40 / 30, "HumanEval": 2.0}


def test_vocab_coverage_is_token_weighted_per_domain():
    from train.eval_report import vocab_coverage

    rows = [{"prompt": "gsm8k/0", "in_draft_vocab": 90, "greedy_tokens": 100, "rejections": 30, "rejections_outside_vocab": 3},
            {"prompt": "gsm8k/1", "in_draft_vocab": 10, "greedy_tokens": 10, "rejections": 10, "rejections_outside_vocab": 0},
            {"prompt": "chat/0", "in_draft_vocab": 0, "greedy_tokens": 10, "rejections": 5, "rejections_outside_vocab": 5}]
    got = vocab_coverage(rows)
    assert got["draft_vocab_coverage"] == 100 / 120
    assert got["draft_vocab_coverage_by_domain"] == {"math": 100 / 110, "chat": 0.0}
    assert got["rejections_outside_vocab"] == 8 / 45
    assert got["rejections_outside_vocab_by_domain"] == {"math": 3 / 40, "chat": 1.0}


def test_export_refuses_a_non_empty_out_unless_overwrite(trained, tmp_path):
    _, _, run = trained
    out = tmp_path / "exp"
    out.mkdir()
    (out / "stale.safetensors").write_text("another export's file")
    with pytest.raises(ValueError, match="not empty"):
        export_run(run, str(out))
    assert (out / "stale.safetensors").exists() and not (out / "config.json").exists()
    export_run(run, str(out), overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "modeling_dflash.py"]
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
    res = _serve(out, target, prompts=prompts)
    assert res["class"] == "DFlashDraftModel" and res["dtype"] == "torch.bfloat16"
    assert all(r["same"] for r in res["runs"]), res
    assert sum(r["tau"] for r in res["runs"]) / len(res["runs"]) > 1.5, res  # the overfit drafter, served in bf16


def test_eval_reports_the_export_beside_the_checkpoint(trained, tmp_path):
    _, prompts, run = trained
    out = export_run(run, str(tmp_path / "exp"))
    res = _eval(run, prompts, "--export", str(out))
    e = res["export"]
    assert res["drafter_dtype"] == "float32" and e["drafter_dtype"] == "bfloat16" and e["path"] == str(out)
    assert res["lossless"] is True and e["lossless"] is True and e["num_prompts"] == res["num_prompts"] == 6
    assert e["tau"] > 1.5 and abs(e["tau"] - res["tau"]) < 0.5, (res["tau"], e["tau"])
    # the export alone: it names its target (sha256 and a path hint), so no --target is needed
    alone = CliRunner().invoke(eval_main, ["--export", str(out), "--prompts", prompts, "--max-new-tokens", "24",
                                           "--json"])
    assert alone.exit_code == 0, alone.output[-2000:]
    got = json.loads([x for x in alone.stdout.splitlines() if x.startswith("{")][-1])
    assert got["tau"] == e["tau"] and got["lossless"] is True
    assert "6/6" in alone.stderr and "tau=" in alone.stderr  # the progress bar: prompts done, τ so far


def test_an_export_that_does_not_match_its_config_is_refused(trained, tmp_path):
    _, prompts, run = trained
    out = export_run(run, str(tmp_path / "exp"))
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": cfg["num_hidden_layers"] + 1,
                                                 "layer_types": ["full_attention"] * (cfg["num_hidden_layers"] + 1)}))
    res = CliRunner().invoke(eval_main, ["--export", str(out), "--prompts", prompts, "--limit", "1"])
    assert res.exit_code == 2 and "does not hold what config.json describes" in res.output, res.output[-2000:]
    (out / "config.json").write_text("{not json")
    res = CliRunner().invoke(eval_main, ["--export", str(out), "--prompts", prompts, "--limit", "1"])
    assert res.exit_code == 2 and "cannot be loaded as an export" in res.output and "Traceback" not in res.output


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
    from cache_format.target import packaged_gguf, target_sha256
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
