"""Fixtures of the training-stage tests: a tiny extracted store; a tiny target, its greedy answers as a
store and a drafter overfit to them."""

from __future__ import annotations

import pytest
import torch

from extract.config import ExtractConfig
from extract.run import run as extract
from tests.helpers import tiny_target_dir, write_chats
from train.config import TrainConfig
from train.trainer import train


def _store_of_greedy_outputs(target_dir: str, prompts: str, store: str, new_tokens: int) -> None:
    """A store whose samples are the target's own greedy continuations, built from token ids.

    Going through text (extract.regenerate) does not work for a random target: its garbage
    byte tokens do not survive decode -> re-encode, so the stored sequences would not be what the
    target generates and no drafter could be accepted.
    """
    import cache_format as cf
    from chat.conversations import read_conversations
    from target.loader import capture, frozen_parts, load_target
    from train.spec_decode import target_generate

    t = load_target(target_dir, device=torch.device("cpu"))
    m = cf.Manifest(target=t.info, tokenizer_sha256=t.tokenizer_sha256, layer_ids=(0, 2), mask_token_id=300, last_hidden=True,
                 dataset=cf.DatasetInfo(path=prompts, sha256="-", num_records=6), max_len=256,
                 bucket_bounds=(256,), rows_per_shard=256, rows_per_chunk=32)
    cf.create_store(store, m)
    cf.write_frozen(store, frozen_parts(t.model))
    with cf.ShardWriter(store, writer_id=0) as w, capture(t.model, [0, 2]) as taps, torch.no_grad():
        for sid, msgs in read_conversations(prompts, skip_bad=False):
            msgs = [x for x in msgs if x["role"] != "assistant"]
            ids = list(t.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])
            out = target_generate(t.model, ids, max_new_tokens=new_tokens, eos=set()).tokens
            seq = torch.tensor(ids + out)
            last = t.model.model(seq[None]).last_hidden_state[0]
            mask = torch.tensor([0] * len(ids) + [1] * len(out))
            w.add(sid, input_ids=seq, loss_mask=mask, hidden=torch.cat([taps[0][0], taps[2][0]], -1), last_hidden=last)
    cf.finalize_store(store, m)


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """(tiny target dir, its 6 prompts, a run of a drafter overfit to the target's greedy answers):
    shared by the evaluation and export tests, built once per test process."""
    d = tmp_path_factory.mktemp("ev")
    target = tiny_target_dir(d / "t", "llama", num_layers=4, hidden=64, seed=1)
    prompts = write_chats(d / "p.jsonl", 6)
    store = str(d / "s.zarr")
    _store_of_greedy_outputs(target, prompts, store, new_tokens=40)
    run = str(d / "run")
    train(TrainConfig(store=store, out=run, num_layers=2, block_size=4, num_anchors=64, epochs=1000, max_steps=150,
                      token_budget=2048, lr=3e-3, log_every=50, workers=0))
    return target, prompts, run


@pytest.fixture(scope="session")
def store(tmp_path_factory):
    """A tiny store extracted from a random qwen3-shaped target (24 cyclic chats, taps 0, 2, 4)."""
    d = tmp_path_factory.mktemp("tiny")
    target = tiny_target_dir(d / "t", "qwen3")
    data = write_chats(d / "chats.jsonl", 24, cyclic=True)
    path = d / "s.zarr"
    extract(ExtractConfig(store=str(path), target=target, data=data, layers=(0, 2, 4), max_len=256,
                          min_supervised=4, token_budget=1024, rows_per_shard=256))
    return str(path)
