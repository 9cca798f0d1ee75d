"""A drafter in the checkpoint layout of vLLM's `speculators` (0.9.0): `python -m train.export
--layout speculators`.

Engines and tools that serve speculators' DFlash and DSpark drafters read this layout: a config.json
with `speculators_model_type` ("dflash", or "dspark" for a drafter with a Markov head), the
drafter's decoder as `transformer_layer_config`, `aux_hidden_state_layer_ids` (the target's layer
ids + 1: they count the embedding as hidden state 0) and `sample_from_anchor` false (the anchor slot
holds the verified token, as ours); and a model.safetensors with the DFlash authors' weight names,
as our own export, where a DSpark head keeps speculators' names (`markov_head.markov_w1` /
`markov_w2`, the same vanilla head: bias = W2 W1[previous token]). The target's embedding and
lm_head are not written: the loader takes them from the verifier, as speculators' own checkpoints do
when the drafter drafts over the target's whole vocabulary. No confidence head is trained, so the
config says none.

Facts of the format are from speculators 0.9.0's config classes and its saved checkpoints (field
names, the layer-id convention, which tensors a checkpoint holds).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from train.model import DrafterConfig

__all__ = ["SPECULATORS_VERSION", "speculators_config", "write_speculators"]

SPECULATORS_VERSION = "0.9.0"  # the schema version these configs follow


def speculators_config(state: dict) -> dict:
    """config.json in speculators' layout for a checkpoint's state (drafter, layer ids, target); one
    ValueError where the drafter is not one speculators describes."""
    dc = DrafterConfig(**state["drafter"])
    if dc.draft_vocab_size:
        # a draft-vocabulary drafter would need the target's lm_head rows in the file; ours drafts
        # from the target's whole head once exported (train.export's default), which speculators
        # loads itself
        raise ValueError("the speculators layout is written for a drafter over the target's whole "
                         "vocabulary: export without --draft-head")
    kind = "dspark" if dc.markov_rank else "dflash"
    tc = state.get("target_config") or {}
    layer = {"model_type": "qwen3", "hidden_size": dc.hidden_size,
             "intermediate_size": dc.intermediate_size,
             "num_hidden_layers": dc.num_layers, "num_attention_heads": dc.num_heads,
             "num_key_value_heads": dc.num_kv_heads, "head_dim": dc.head_dim,
             "vocab_size": dc.vocab_size, "rms_norm_eps": dc.rms_eps,
             "rope_parameters": {"rope_type": "default", "rope_theta": dc.rope_theta},
             "max_position_embeddings": tc.get("max_position_embeddings") or 32768,
             "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
             "layer_types": ["full_attention"] * dc.num_layers, "use_sliding_window": False}
    cfg = {
        "architectures": ["DSparkDraftModel" if dc.markov_rank else "DFlashDraftModel"],
        "speculators_model_type": kind,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": dc.vocab_size,
        "block_size": dc.block_size,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [i + 1 for i in state["layer_ids"]],
        "mask_token_id": dc.mask_token_id,
        "sliding_window_non_causal": False,
        "sample_from_anchor": False,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "speculators_config": {
            "algorithm": kind,
            "default_proposal_method": "greedy", "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": dc.block_size - 1,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": state.get("target", "") or None,
                         "architectures": list(tc.get("architectures") or [])},
        },
    }
    if dc.markov_rank:
        cfg.update(markov_rank=dc.markov_rank, markov_head_type="vanilla",
                   enable_confidence_head=False, confidence_head_with_markov=False)
    return cfg


def write_speculators(dst: Path, state: dict, weights: dict[str, torch.Tensor]) -> Path:
    """config.json and bf16 model.safetensors of a drafter (its export names: `to_export_names`) in
    speculators' layout, into `dst`."""
    # refuses a draft-vocabulary drafter (the one that holds draft_ids)
    cfg = speculators_config(state)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()},
              str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst
