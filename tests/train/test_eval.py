"""Speculative decoding is lossless; an overfit drafter gets tau > 1; replayed decoding equals real
decoding; multi-turn prompts; the JSON contract (export tests: test_export.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from tests.helpers import run_losses
from train.checkpoint import latest_checkpoint, load_checkpoint
from train.config import TrainConfig
from train.eval import main as eval_main
from train.export import export_run
from train.model import DrafterConfig
from train.trainer import train


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
    from target.loader import load_target
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
    new_total = forwards_total = tree_total = 0
    for sid in ids:
        batch = BatchDataset(store, [[sid]], [0], every, seed=0, epoch=-1)[0]
        with torch.no_grad():
            out = forward_loss(model, batch, loss, replay=True, tree_budgets=(8,))
        tokens, forwards = replay_counts(batch["anchors"], out["accepts"], batch["anchor_span"])
        _, tree_forwards = replay_counts(batch["anchors"], out["tree_accepts"][8], batch["anchor_span"])
        sample = reader.get_batch([sid])[0]
        p = int(sample.loss_mask.nonzero()[0])
        for budget, counted in ((0, forwards), (8, tree_forwards)):  # the chain, then a tree of 8 nodes
            spec = served.spec_generate(tgt, sample.input_ids[None, :p], max_new_tokens=len(sample.input_ids) - p,
                                        eos_token_id=[], tree_budget=budget)
            assert spec["sequences"][0].tolist() == sample.input_ids.tolist()  # the store holds the greedy path
            assert (int(tokens), int(counted)) == (len(sample.input_ids) - p, spec["target_forwards"]), (sid, budget)
        new_total, forwards_total = new_total + int(tokens), forwards_total + int(forwards)
        tree_total += int(tree_forwards)
    assert forwards_total < 0.8 * new_total and tree_total <= forwards_total  # drafts accepted; the tree no fewer
    held = BatchDataset(store, [ids], [0], every, seed=0, epoch=-1)  # all prompts in one padded batch
    row = evaluate_holdout(model, held, torch.device("cpu"), world=1, loss=loss, tree_budgets=(8,))
    assert row["val_decode_tau"] == pytest.approx(new_total / forwards_total, rel=1e-6)
    assert row["val_tree_tau"] == pytest.approx(new_total / tree_total, rel=1e-6) and row["val_tree_budget"] == 8
    from train.replay_score import replay_score  # the command over any store: the same figure

    got = replay_score(store, run=run, checkpoint=str(latest_checkpoint(run)), whole_head=False, tree_budgets=(8,))
    assert got["val_decode_tau"] == pytest.approx(new_total / forwards_total, rel=1e-6) and got["samples"] == len(ids)
    assert got["tree_curve"]["8"]["val_tree_tau"] == pytest.approx(new_total / tree_total, rel=1e-6)
    both = replay_score(store, run=run, checkpoint=str(latest_checkpoint(run)), whole_head=False, tree_budgets=(8, 2))
    assert list(both["tree_curve"]) == ["8", "2"] and both["tree_curve"]["8"] == got["tree_curve"]["8"]
    assert both["val_decode_tau"] == got["val_decode_tau"]  # the chain's figure from the same forwards


def test_a_budget_curve_decodes_every_budget_losslessly_against_one_baseline(trained):
    target, prompts, run = trained
    res = _eval(run, prompts, "--tree-budget", "0,4,16", "--no-prompt-lookup", "--limit", "3")
    curve = res["tree_curve"]
    saved = json.loads((Path(run) / "eval.json").read_text())["tree_curve"]
    assert list(curve) == ["0", "4", "16"] and all(c["lossless"] for c in curve.values()) and res["lossless"]
    assert curve["0"]["tau"] == res["tau"] and res["tree_budget"] == 0
    assert "checkpoint" not in res["tau_by_domain"]  # each row named for its prompt, not its drafter
    assert all(set(c["tau_by_domain"]) == set(res["tau_by_domain"]) for c in curve.values())
    assert curve["16"]["target_forwards"] <= curve["0"]["target_forwards"] + 2  # more nodes, not fewer accepted
    single = _eval(run, prompts, "--tree-budget", "16", "--no-prompt-lookup", "--limit", "3")
    assert single["tau"] == curve["16"]["tau"] and "tree_curve" not in single
    # eval.json keeps each budget's per-prompt counts (a paired comparison needs them); the --json
    # line leaves them out
    assert all("prompts" not in c for c in curve.values())
    for b, c in curve.items():
        rows = saved[b]["prompts"]
        assert len(rows) == 3 and sum(r["target_forwards"] for r in rows) == c["target_forwards"]


@pytest.mark.parametrize("flag,value", [("--limit", "-1"), ("--max-new-tokens", "0")])
def test_a_bad_limit_is_refused_in_one_line_before_anything_is_written(trained, flag, value):
    _, prompts, run = trained
    before = sorted(p.name for p in Path(run).iterdir())
    out = CliRunner().invoke(eval_main, ["--run", run, "--prompts", prompts, flag, value])
    field = flag.lstrip("-").replace("-", "_")  # the config field's name (or its flag's)
    assert out.exit_code == 2 and (flag in out.output or field in out.output), out.output
    assert "Traceback" not in out.output and len(out.output.strip().splitlines()) == 1
    assert sorted(p.name for p in Path(run).iterdir()) == before


@pytest.mark.parametrize("bad", ["-1", "4,4", "x", ""])
def test_a_bad_tree_budget_is_refused_in_one_line(trained, bad):
    _, prompts, run = trained
    out = CliRunner().invoke(eval_main, ["--run", run, "--prompts", prompts, "--tree-budget", bad])
    assert out.exit_code == 2 and "--tree-budget" in out.output and "Traceback" not in out.output


def test_replayed_decoding_tau_equals_real_decoding(trained):
    target, _, run = trained
    _assert_replay_equals_decoding(target, run)


def _assert_vocab_coverage(target: str, prompts: str, run: str, ids: set[int], got: float) -> None:
    """The reported coverage equals the share of the target's own greedy tokens (decoded here again,
    prompt by prompt) that lie in the drafter's vocabulary `ids`."""
    from target.loader import chat_ids, eos_ids, load_target
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
    assert run_losses(tmp_path / "again")[0] < 2 * run_losses(vr)[-1] + 0.5
    with pytest.raises(ValueError, match=f"draft_vocab_size {n} vs 0"):
        train(TrainConfig(out=str(tmp_path / "full"), init_from=str(out), **kw))
    text = CliRunner().invoke(eval_main, ["--run", vr, "--prompts", prompts, "--limit", "2", "--max-new-tokens", "8",
                                          "--no-prompt-lookup"])
    assert text.exit_code == 0 and "tau by domain" in text.output and "prompt lookup" not in text.output, text.output


def test_multiturn_held_out_chats_are_measured_on_their_second_turn(trained):
    from chat.prompts import heldout_multiturn

    chats = heldout_multiturn()
    assert len(chats) >= 20 and all([m["role"] for m in c] == ["user", "user"] for _, c in chats)
    _, _, run = trained
    res = _eval(run, "multiturn", "--limit", "2")
    assert res["num_prompts"] == 2 and res["lossless"] is True
    assert list(res["tau_by_domain"]) == ["chat, second turn"]


def test_earlier_turns_are_answered_by_the_target_before_the_last_is_measured(trained):
    from target.loader import chat_ids, load_target
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
    assert res.exit_code == 2 and "unreadable export (JSONDecodeError" in res.output and "Traceback" not in res.output




def test_the_json_line_leaves_every_per_prompt_list_out():
    from train.eval import _without_prompts

    curve = {"0": {"tau": 2.0, "prompts": [{"prompt": "a"}]}}
    res = {"tau": 2.0, "prompts": [{"prompt": "a"}], "tree_curve": curve,
           "export": {"tau": 1.9, "tree_curve": curve}}
    line = _without_prompts(res)
    assert line == {"tau": 2.0, "tree_curve": {"0": {"tau": 2.0}},
                    "export": {"tau": 1.9, "tree_curve": {"0": {"tau": 2.0}}}}
    assert res["tree_curve"]["0"]["prompts"]  # eval.json's report is left whole
