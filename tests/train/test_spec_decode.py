"""train.spec_decode's greedy baseline, and the KV-cache argument under either transformers name."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from train.modeling_dflash import cache_kwarg, cache_of
from train.spec_decode import target_generate


class _Old:
    def forward(self, input_ids, past_key_values=None, use_cache=False):
        pass


class _New:
    def forward(self, input_ids, cache=None, use_cache=False):
        pass


def test_the_cache_goes_by_the_name_the_forward_takes_and_comes_back_under_either():
    assert cache_kwarg(_Old()) == "past_key_values" and cache_kwarg(_New()) == "cache"
    assert cache_of(SimpleNamespace(past_key_values="old")) == "old"
    assert cache_of(SimpleNamespace(cache="new", past_key_values=None)) == "new"


def test_greedy_with_the_cache_equals_recomputing_the_whole_sequence_and_warns_nothing():
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=97, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    prompt = [5, 17, 3, 88, 41]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # transformers >= 5.25 warns on the old cache name
        got = target_generate(model, prompt, max_new_tokens=12, eos=set())
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):  # the oracle: no cache, the whole sequence every step
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert got.tokens == ids[len(prompt):] and got.target_forwards == 12
