"""Tree verification in the served spec_generate: lossless against the float32 target's greedy
decoding, the chain when the tree is one node wide, the cache compacted along non-contiguous paths."""

from __future__ import annotations

import pytest
import torch

import train.modeling_dflash as served_module
from chat.conversations import read_conversations
from target.loader import chat_ids, load_target
from train.checkpoint import latest_checkpoint, load_checkpoint
from train.export import hf_drafter
from train.spec_decode import target_generate


@pytest.fixture(scope="module")
def pair(trained):
    target, prompts, run = trained
    weights, _, state = load_checkpoint(latest_checkpoint(run))
    tgt = load_target(target, device=torch.device("cpu"))
    ids = [chat_ids(tgt.tokenizer, [m for m in msgs if m["role"] != "assistant"])
           for _, msgs in read_conversations(prompts, skip_bad=False)]
    return hf_drafter(state, weights).eval(), tgt.model, ids


@pytest.fixture(scope="module")
def unsure(pair):
    """The overfit drafter made unsure (noise on its weights): its accepted paths leave the first nodes."""
    drafter, tgt, ids = pair
    g = torch.Generator().manual_seed(0)
    other = type(drafter)(drafter.config).eval()
    other.load_state_dict(drafter.state_dict())
    with torch.no_grad():
        for p in other.parameters():
            if p.dim() > 1:
                p.add_(torch.randn(p.shape, generator=g) * p.std() * NOISE)
    return other, tgt, ids


def _decode(drafter, tgt, ids, n=40, **kw):
    out = drafter.spec_generate(tgt, torch.tensor([ids]), max_new_tokens=n, eos_token_id=[], **kw)
    return out["sequences"][0, len(ids):].tolist(), out["accepted"]


NOISE = 0.5


@pytest.mark.parametrize("budget,width,which", [(1, 0, "pair"), (4, 0, "pair"), (16, 2, "pair"), (48, 0, "pair"),
                                                (16, 0, "unsure"), (48, 0, "unsure")])
def test_tree_decoding_equals_the_targets_greedy_decoding(request, monkeypatch, budget, width, which):
    drafter, tgt, prompts = request.getfixturevalue(which)
    moved = []
    real = served_module.keep_cache_rows

    def spy(cache, start, rows):
        moved.append(rows != list(range(len(rows))))
        real(cache, start, rows)

    monkeypatch.setattr(served_module, "keep_cache_rows", spy)
    new_tokens = forwards = 0
    for ids in prompts:
        greedy = target_generate(tgt, ids, max_new_tokens=40, eos=set()).tokens
        got, accepted = _decode(drafter, tgt, ids, tree_budget=budget, tree_width=width)
        assert got == greedy, ids
        new_tokens, forwards = new_tokens + len(got), forwards + len(accepted)
    assert new_tokens / forwards > 1.3  # the tree is accepted: not a check of 1 == 1
    if which == "unsure":  # a committed path that is not the first nodes: rows moved in the cache
        assert any(moved)


def test_a_tree_one_node_wide_and_block_deep_decodes_as_the_chain(pair):
    drafter, tgt, prompts = pair
    depth = drafter.block_size - 1
    for ids in prompts:
        assert _decode(drafter, tgt, ids, tree_budget=depth, tree_width=1) == _decode(drafter, tgt, ids)


def test_a_negative_budget_is_refused(pair):
    drafter, tgt, prompts = pair
    with pytest.raises(ValueError, match="tree_budget"):
        _decode(drafter, tgt, prompts[0], tree_budget=-1)


def test_timed_decoding_adds_every_phase_and_decodes_the_same(pair):
    drafter, tgt, prompts = pair
    timings: dict[str, float] = {}
    for budget in (0, 8):
        assert _decode(drafter, tgt, prompts[0], tree_budget=budget, timings=timings) == \
            _decode(drafter, tgt, prompts[0], tree_budget=budget)
    assert set(timings) == {"prefill", "mask", "verify", "step", "sync", "compact"}
    assert all(v >= 0 for v in timings.values()) and timings["verify"] > 0


def test_the_tree_step_bench_splits_a_step_by_phase(trained, tmp_path):
    """python -m bench tree-step on a tiny export: a row per budget, every phase timed."""
    import json
    import subprocess
    import sys

    from train.export import export_run

    target, _, run = trained
    export_run(run, str(tmp_path / "e"))
    p = subprocess.run([sys.executable, "-m", "bench", "tree-step", "--export", str(tmp_path / "e"), "--target", target,
                        "--budgets", "0,8", "--limit", "2", "--max-new-tokens", "12", "--json", str(tmp_path / "t.json")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = json.loads((tmp_path / "t.json").read_text())
    assert [r["budget"] for r in rows] == [0, 8] and all(r["steps"] > 0 and r["tau"] >= 1 for r in rows)
    assert rows[1]["tree_build_ms"] > 0 and all(r["ms_per_step"]["verify"] > 0 for r in rows)
