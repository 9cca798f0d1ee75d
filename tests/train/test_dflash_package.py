"""An export decodes in the DFlash authors' reference package (PyPI `dflash` 0.1.0, installed
--no-deps by `make install`): its DFlashDraftModel loads our config.json and weights, and its greedy
dflash_generate equals the target's own greedy decoding with drafts accepted, as our spec_generate
does with the same export."""

from __future__ import annotations

import pytest
import torch

from chat.conversations import read_conversations
from target.loader import chat_ids, load_target
from train.export import export_run
from train.spec_decode import target_generate

dflash_model = pytest.importorskip("dflash.model", reason="the reference package: make install puts it in")


def test_the_reference_package_decodes_an_export_losslessly_with_drafts_accepted(trained, tmp_path):
    target, prompts, run = trained
    out = export_run(run, str(tmp_path / "e"))
    tgt = load_target(target, device=torch.device("cpu"))
    ref = dflash_model.DFlashDraftModel.from_pretrained(str(out), dtype=torch.float32).eval()
    calls = []
    hook = tgt.model.register_forward_pre_hook(lambda *_: calls.append(1))  # its stats need CUDA: count here
    ours = ref_tokens = forwards = 0
    for _, msgs in read_conversations(prompts, skip_bad=False):
        ids = chat_ids(tgt.tokenizer, [m for m in msgs if m["role"] != "assistant"])
        greedy = target_generate(tgt.model, ids, max_new_tokens=24, eos=set()).tokens
        calls.clear()
        with torch.no_grad():
            res = dflash_model.dflash_generate(ref, tgt.model, torch.tensor([ids]), max_new_tokens=24,
                                               stop_token_ids=None)
        got = res[0, len(ids):].tolist()
        assert got == greedy[: len(got)] and len(got) >= 23, (got, greedy)
        ref_tokens, forwards = ref_tokens + len(got), forwards + len(calls)
        ours += 1
    hook.remove()
    assert ours and ref_tokens / forwards > 1.5  # drafts accepted: the weights were read, not random
