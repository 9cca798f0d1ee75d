"""A DFlash draft model for transformers, shipped inside every draftcache export as
modeling_dflash.py.

    from transformers import AutoModel, AutoModelForCausalLM
    target = AutoModelForCausalLM.from_pretrained(TARGET)
    drafter = AutoModel.from_pretrained(EXPORT, trust_remote_code=True)
    out = drafter.spec_generate(target, input_ids, max_new_tokens=256)   # greedy, lossless

This file stands alone (torch and transformers only): it is copied next to config.json and
model.safetensors, so a served export needs no draftcache install. The drafter reads the hidden
states of the target's layers `dflash_config.target_layer_ids` (id i = output of decoder layer i),
fuses them (fc + hidden_norm), and injects them as extra keys and values into every layer; a
block is [last verified token, MASK x (block_size - 1)], drafted in one forward and verified by
the target in one forward. Embedding and lm_head are the target's, taken at decode time.

Shapes: B batch, T context tokens, Q block tokens, H hidden, K taps, nh/nkv heads, hd head dim.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config

from .decoding_state import DecodingState, PhaseClock
from .markov_head import MarkovHead, markov_chain, tree_inputs

__all__ = ["DFlashDraftModel", "RMSNorm", "apply_rope", "cache_of", "cache_kwarg",
           "keep_cache_rows", "rope_cos_sin"]


def cache_kwarg(model) -> str:
    """The name `model.forward` takes its KV cache by: transformers 5.25 renamed `past_key_values`
    to `cache` (the old name is accepted with a warning until 5.40); earlier versions know only the
    old."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_of(out):
    """The KV cache a forward returned, under either name (see cache_kwarg)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def keep_cache_rows(cache, start: int, rows: list[int]) -> None:
    """Keep, of the cache's entries from position `start` on, those at start + rows (in that order)
    as positions start, start + 1, ...; drop the rest. A tree verify appends every node's keys; the
    committed path's become the cache."""
    if any(r != i for i, r in enumerate(rows)):
        layers = ([(x.keys, x.values) for x in cache.layers] if hasattr(cache, "layers")
                  else list(zip(cache.key_cache, cache.value_cache)))  # transformers 4.x
        src = torch.tensor(rows, device=layers[0][0].device) + start
        for k, v in layers:  # [B, nkv, S, hd]
            k[:, :, start: start + len(rows)] = k.index_select(2, src)
            v[:, :, start: start + len(rows)] = v.index_select(2, src)
    drop = cache.get_seq_length() - (start + len(rows))
    if drop > 0:
        cache.crop(-drop)  # "remove this many"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in float32, return the input dtype (keeps q, k, v one dtype under autocast)
        xf = x.float()
        scale = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * scale * self.weight.float()).to(x.dtype)


def rope_cos_sin(pos: torch.Tensor, head_dim: int,
                 theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """pos [B, S] -> cos, sin [B, 1, S, hd] (neox / HF "rotate half" layout)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=pos.device,
                                        dtype=torch.float32) / head_dim))
    ang = pos.float()[..., None] * inv  # [B, S, hd/2]
    emb = torch.cat([ang, ang], dim=-1)[:, None]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, c: Qwen3Config) -> None:
        super().__init__()
        h, hd = c.hidden_size, c.head_dim
        self.q_proj = nn.Linear(h, c.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, c.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, c.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(hd, c.rms_norm_eps)
        self.hd, self.rep = hd, c.num_attention_heads // c.num_key_value_heads

    def kv(self, x: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, H] -> roped k, v [B, nkv, S, hd]."""
        b, s, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, s, -1, self.hd)).transpose(1, 2)
        return apply_rope(k, cos, sin), self.v_proj(x).view(b, s, -1, self.hd).transpose(1, 2)

    def forward(self, x, ctx_k, ctx_v, cos, sin, ctx_valid=None) -> torch.Tensor:
        """ctx_valid [T] bool (None: all valid): which context rows count; a static decoding buffer
        holds rows not yet (or no longer) verified beyond its length."""
        b, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, q_len, -1, self.hd)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k, v = self.kv(x, cos, sin)
        k, v = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)  # [B, nkv, T+Q, hd]
        # the block sees the whole (valid) context, all before its first token, and itself
        # [1, T+Q]
        mask = None if ctx_valid is None else torch.cat([ctx_valid,
                                                         ctx_valid.new_ones(q_len)])[None]
        o = F.scaled_dot_product_attention(q, k.repeat_interleave(self.rep, 1),
                                           v.repeat_interleave(self.rep, 1), attn_mask=mask)
        return self.o_proj(o.transpose(1, 2).reshape(b, q_len, -1))


class _MLP(nn.Module):
    def __init__(self, c: Qwen3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, c: Qwen3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = _MLP(c)

    def forward(self, x, ctx_k, ctx_v, cos, sin, ctx_valid=None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx_k, ctx_v, cos, sin, ctx_valid)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(PreTrainedModel):
    """fc, hidden_norm, layers, norm; the target's embedding and lm_head are passed in at decode
    time."""

    config_class = Qwen3Config
    base_model_prefix = "dflash"
    _no_split_modules = ["_Layer"]

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        d = config.dflash_config
        self.target_layer_ids = [int(i) for i in d["target_layer_ids"]]
        self.mask_token_id = int(d["mask_token_id"])
        self.block_size = int(config.block_size)
        # transformers 5 keeps rope_theta in rope_parameters, 4.x as an attribute
        self.rope_theta = float((getattr(config, "rope_parameters", None) or {}).get("rope_theta")
                                or getattr(config, "rope_theta", None) or 10000.0)
        h = config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(_Layer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        # a draft vocabulary (config draft_vocab_size > 0): draft index -> target id, in the weights
        # file
        n = int(getattr(config, "draft_vocab_size", 0) or 0)
        self.register_buffer("draft_ids", torch.zeros(n, dtype=torch.long) if n else None)
        # a dependence head (markov_head.py): config markov_rank > 0; any other head type is
        # refused, not ignored
        rank = int(getattr(config, "markov_rank", 0) or 0)
        kind = getattr(config, "markov_head_type", "vanilla")
        if rank and kind != "vanilla":
            raise ValueError(f"markov_head_type {kind!r}: this modeling file drafts with the "
                             "'vanilla' head only")
        self.markov_head = MarkovHead(config.vocab_size, n or config.vocab_size,
                                      rank) if rank else None
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=getattr(self.config, "initializer_range", 0.02))
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)

    def _rope(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope_cos_sin(pos, self.config.head_dim, self.rope_theta)
        return cos.to(dtype), sin.to(dtype)

    def context_kv(self, taps: torch.Tensor,
                   pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """taps [B, T, K*H] (tapped target states, in target_layer_ids order), pos [B, T] -> per
        layer (k, v) [B, nkv, T, hd]: computed once per verified token, then only appended to."""
        w = self.fc.weight
        ctx = self.hidden_norm(self.fc(taps.to(w.dtype)))
        cos, sin = self._rope(pos, w.dtype)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def forward(self, block_embeds: torch.Tensor, block_pos: torch.Tensor,
                ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],
                ctx_valid: torch.Tensor | None = None) -> torch.Tensor:
        """block_embeds [B, Q, H] (the target's embedding of the block), block_pos [B, Q], ctx_valid
        [T] bool or None -> hidden [B, Q, H] (apply the target's lm_head for draft logits)."""
        x = block_embeds.to(self.fc.weight.dtype)
        cos, sin = self._rope(block_pos, x.dtype)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, k, v, cos, sin, ctx_valid)
        return self.norm(x)

    def draft_head(self, head: torch.Tensor) -> torch.Tensor:
        """The rows of the target's lm_head [V, H] this drafter proposes from ([N, H] with a draft
        vocabulary)."""
        return head if self.draft_ids is None else head[self.draft_ids]

    def draft_tokens(self, logits: torch.Tensor, root: torch.Tensor) -> torch.Tensor:
        """Target ids [D] of the chain drafted from logits [D, V or N] after the block's first token
        root (0-d): each slot's argmax, or with a Markov head each slot's after the token drafted
        before it."""
        if self.markov_head is not None:
            return markov_chain(logits, root, self.markov_head, self.draft_ids)
        idx = logits.argmax(-1)
        return idx if self.draft_ids is None else self.draft_ids[idx]

    def tree_logp(self, logits: torch.Tensor, root: torch.Tensor):
        """(log-probs [D, V or N] of the block's slots, the head's bias for build_tree or None):
        with a Markov head, slot 1's log-probs are those after the root (0-d, a target id)."""
        if self.markov_head is None:
            return torch.log_softmax(logits.float(), -1), None
        return tree_inputs(logits, root, self.markov_head, self.draft_ids)

    @torch.inference_mode()
    def spec_generate(self, target, input_ids: torch.Tensor, *, max_new_tokens: int = 256,
                      eos_token_id: int | list[int] | None = None, cuda_graph: bool = True,
                      tree_budget: int | None = None, tree_width: int | None = None,
                      timings: dict[str, float] | None = None) -> dict:
        """Greedy speculative decoding of one prompt (input_ids [1, P]) with `target`, an HF causal
        LM.

        Returns {"sequences": [1, P + new] ids, "accepted": tokens emitted per target forward (the
        target's own next token included), "target_forwards": int}. The new tokens equal the
        target's own greedy decoding (up to float ties), whatever the drafter proposes. On CUDA the
        drafter's side of a step (acceptance, context update, next draft) replays as one CUDA graph
        unless `cuda_graph` is False; the target runs as it is.

        tree_budget N > 0: each step drafts a tree of the block's N best prefixes (draft_tree.py;
        tree_width caps the nodes at each depth) and the target verifies all of them in one forward
        with an ancestor-only mask; its greedy token is walked down the tree and the matched path
        is kept. 0: the chain of each slot's argmax (with a Markov head, each after the token
        drafted before it). None: the export's default (config.json
        dflash_config tree_budget and tree_width; the chain where it names none).

        timings: a dict each phase's seconds are added to (prefill, mask: the verify's inputs,
        verify: the target's forward, step: acceptance, context update and the next draft or tree,
        sync: the step's result to the host, compact: the target's cache cut to the committed path).
        Timing synchronizes the device between phases, so a timed decode runs slower than an untimed
        one.
        """
        d = self.config.dflash_config
        tree_budget = int(d.get("tree_budget", 0)) if tree_budget is None else tree_budget
        tree_width = int(d.get("tree_width", 0)) if tree_width is None else tree_width
        if input_ids.shape[0] != 1:
            raise ValueError("spec_generate decodes one prompt at a time, got a batch of "
                             f"{input_ids.shape[0]}")
        if tree_budget < 0 or tree_width < 0:
            raise ValueError(f"tree_budget {tree_budget} and tree_width {tree_width}: must be >= 0")
        eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or [])
        prompt_len = input_ids.shape[1]
        dec = self._decoding_for(target, prompt_len + max_new_tokens + 2 * self.block_size,
                                 input_ids.device,
                                 cuda_graph and input_ids.is_cuda, tree_budget, tree_width)
        taps: dict[int, torch.Tensor] = {}
        decoder = target.get_decoder() if hasattr(target, "get_decoder") else target.model
        hooks = [decoder.layers[i].register_forward_hook(
            lambda _m, _a, o, i=i: taps.__setitem__(i, o[0] if isinstance(o, tuple) else o))
            for i in self.target_layer_ids]
        # [1, S, K*H]
        tapped = lambda: torch.cat([taps[i] for i in self.target_layer_ids], dim=-1)
        clock = PhaseClock(timings, input_ids.device)
        try:
            tokens, accepted = self._decode(target, input_ids, dec, tapped, clock, max_new_tokens,
                                            eos)
        finally:
            for h in hooks:
                h.remove()
        seq = torch.cat([input_ids[0], torch.tensor(tokens, device=input_ids.device)])[None]
        return {"sequences": seq, "accepted": accepted, "target_forwards": len(accepted)}

    def _decode(self, target, input_ids: torch.Tensor, dec: DecodingState, tapped,
                clock: PhaseClock,
                max_new_tokens: int, eos: set[int]) -> tuple[list[int], list[int]]:
        """The prefill, then steps of verify, accept and draft until max_new_tokens or an eos token:
        (the new tokens, the tokens each target forward emitted)."""
        prompt_len = input_ids.shape[1]
        out, kw = target(input_ids, use_cache=True), cache_kwarg(target)
        cache, first = cache_of(out), out.logits[0, -1].argmax()
        dec.start(tapped(), first)  # context = states of positions 0..P-1, first block drafted
        tokens, accepted = [int(first)], [1]
        clock.lap("prefill")
        while tokens[-1] not in eos and len(tokens) < max_new_tokens:
            # position of the last (not yet verified) token: block[0]
            n = prompt_len + len(tokens) - 1
            inputs = dec.verify_inputs(n)
            clock.lap("mask")
            out = target(**inputs, use_cache=True, **{kw: cache})
            cache = cache_of(out)
            # the target's choice after each verified token
            dec.want.copy_(out.logits[0].argmax(-1))
            dec.taps.copy_(tapped())
            clock.lap("verify")
            dec.step()
            clock.lap("step")
            a, path, emitted = dec.result()  # the step's one host sync
            clock.lap("sync")
            new = emitted[: max_new_tokens - len(tokens)]
            for t in new:
                tokens.append(t)
                if t in eos:
                    break
            accepted.append(len(new))
            keep_cache_rows(cache, n, [0, *path[:a]])  # the target's cache for verified tokens only
            clock.lap("compact")
        return tokens, accepted

    def _decoding_for(self, target, rows: int, device: torch.device, graph: bool, budget: int = 0,
                      width: int = 0) -> DecodingState:
        """A decoding state with at least `rows` context rows for this target, kept for the next
        prompt (a CUDA graph is captured once per state, not per prompt)."""
        head, embed = target.get_output_embeddings().weight, target.get_input_embeddings().weight
        # a drafter or target moved or cast since (new tensors) gets a new state: the graph reads
        # these addresses
        key = (head.data_ptr(), embed.data_ptr(), self.fc.weight.data_ptr(), self.fc.weight.dtype,
               str(device), graph, budget, width, target.dtype)
        # one state per tree budget and width, so that decoding alternately with several captures
        # each once; states for other tensors (a drafter or target moved or cast since) are dropped
        states = {k: v for k, v in getattr(self, "_decodings", {}).items() if k[:6] == key[:6]}
        old = states.get(key)
        if old is None or old.rows < rows:
            states[key] = DecodingState(self, embed, self.draft_head(head),
                                        -(-rows // 1024) * 1024, graph, key,
                                    budget, width, target.dtype)
        # weights loaded in place since (a draft vocabulary, the target's head): the graph reads
        # this copy
        else:
            old.head.copy_(self.draft_head(head))
        self._decodings, self._decoding = states, states[key]
        return self._decoding
