"""A DFlash draft model for transformers, shipped inside every draftcache export as modeling_dflash.py.

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

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config

__all__ = ["DFlashDraftModel", "RMSNorm", "apply_rope", "rope_cos_sin"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # normalise in float32, return the input dtype (keeps q, k, v one dtype under autocast)
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


def rope_cos_sin(pos: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """pos [B, S] -> cos, sin [B, 1, S, hd] (neox / HF "rotate half" layout)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float32) / head_dim))
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

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, H] -> roped k, v [B, nkv, S, hd]."""
        b, s, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, s, -1, self.hd)).transpose(1, 2)
        return apply_rope(k, cos, sin), self.v_proj(x).view(b, s, -1, self.hd).transpose(1, 2)

    def forward(self, x, ctx_k, ctx_v, cos, sin) -> torch.Tensor:
        b, q_len, _ = x.shape
        q = apply_rope(self.q_norm(self.q_proj(x).view(b, q_len, -1, self.hd)).transpose(1, 2), cos, sin)
        k, v = self.kv(x, cos, sin)
        k, v = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)  # [B, nkv, T+Q, hd]
        # no mask: the block sees the whole context (all before its first token) and itself
        o = F.scaled_dot_product_attention(q, k.repeat_interleave(self.rep, 1), v.repeat_interleave(self.rep, 1))
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

    def forward(self, x, ctx_k, ctx_v, cos, sin) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx_k, ctx_v, cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(PreTrainedModel):
    """fc, hidden_norm, layers, norm; the target's embedding and lm_head are passed in at decode time."""

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
        # a draft vocabulary (config draft_vocab_size > 0): draft index -> target id, in the weights file
        n = int(getattr(config, "draft_vocab_size", 0) or 0)
        self.register_buffer("draft_ids", torch.zeros(n, dtype=torch.long) if n else None)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=getattr(self.config, "initializer_range", 0.02))
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)

    def _rope(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope_cos_sin(pos, self.config.head_dim, self.rope_theta)
        return cos.to(dtype), sin.to(dtype)

    def context_kv(self, taps: torch.Tensor, pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """taps [B, T, K*H] (tapped target states, in target_layer_ids order), pos [B, T] -> per layer
        (k, v) [B, nkv, T, hd]: computed once per verified token, then only appended to."""
        w = self.fc.weight
        ctx = self.hidden_norm(self.fc(taps.to(w.dtype)))
        cos, sin = self._rope(pos, w.dtype)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def forward(self, block_embeds: torch.Tensor, block_pos: torch.Tensor,
                ctx_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """block_embeds [B, Q, H] (the target's embedding of the block), block_pos [B, Q] -> hidden [B, Q, H]
        (apply the target's lm_head for draft logits)."""
        x = block_embeds.to(self.fc.weight.dtype)
        cos, sin = self._rope(block_pos, x.dtype)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, k, v, cos, sin)
        return self.norm(x)

    def draft_head(self, head: torch.Tensor) -> torch.Tensor:
        """The rows of the target's lm_head [V, H] this drafter proposes from ([N, H] with a draft vocabulary)."""
        return head if self.draft_ids is None else head[self.draft_ids]

    def draft_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        """Target ids of the argmax of draft logits [..., V or N]."""
        idx = logits.argmax(-1)
        return idx if self.draft_ids is None else self.draft_ids[idx]

    @torch.inference_mode()
    def spec_generate(self, target, input_ids: torch.Tensor, *, max_new_tokens: int = 256,
                      eos_token_id: int | list[int] | None = None) -> dict:
        """Greedy speculative decoding of one prompt (input_ids [1, P]) with `target`, an HF causal LM.

        Returns {"sequences": [1, P + new] ids, "accepted": tokens emitted per target forward (the
        target's own next token included), "target_forwards": int}. The new tokens equal the
        target's own greedy decoding (up to float ties), whatever the drafter proposes.
        """
        if input_ids.shape[0] != 1:
            raise ValueError(f"spec_generate decodes one prompt at a time, got a batch of {input_ids.shape[0]}")
        eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or [])
        dev, bs = input_ids.device, self.block_size
        embed, head = target.get_input_embeddings().weight, self.draft_head(target.get_output_embeddings().weight)
        taps: dict[int, torch.Tensor] = {}
        decoder = target.get_decoder() if hasattr(target, "get_decoder") else target.model
        hooks = [decoder.layers[i].register_forward_hook(
            lambda _m, _a, o, i=i: taps.__setitem__(i, o[0] if isinstance(o, tuple) else o))
            for i in self.target_layer_ids]
        prompt_len = input_ids.shape[1]
        try:
            out = target(input_ids, use_cache=True)
            cache, tokens, accepted = out.past_key_values, [int(out.logits[0, -1].argmax())], [1]
            ctx = self._context(taps, 0, prompt_len)  # states of positions 0..P-1
            while tokens[-1] not in eos and len(tokens) < max_new_tokens:
                n = prompt_len + len(tokens) - 1  # position of the last (not yet verified) token
                block = torch.full((1, bs), self.mask_token_id, device=dev)
                block[0, 0] = tokens[-1]
                hid = self(F.embedding(block, embed), torch.arange(n, n + bs, device=dev)[None], ctx)
                draft = self.draft_tokens(hid[0, 1:] @ head.to(hid.dtype).T)  # [bs-1] target ids
                out = target(torch.cat([block[0, :1], draft])[None], past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                want = out.logits[0].argmax(-1)  # the target's choice after each block token
                a = int((draft == want[:-1]).long().cumprod(0).sum())
                new = (draft[:a].tolist() + [int(want[a])])[: max_new_tokens - len(tokens)]
                for t in new:
                    tokens.append(t)
                    if t in eos:
                        break
                accepted.append(len(new))
                # keep the target's cache and the drafter's context for the verified tokens only
                drop = cache.get_seq_length() - (n + a + 1)
                if drop > 0:
                    cache.crop(-drop)  # "remove this many"
                more = self._context({i: taps[i][:, : a + 1] for i in self.target_layer_ids}, n, n + a + 1)
                ctx = [(torch.cat([k, k2], 2), torch.cat([v, v2], 2)) for (k, v), (k2, v2) in zip(ctx, more)]
        finally:
            for h in hooks:
                h.remove()
        seq = torch.cat([input_ids[0], torch.tensor(tokens, device=dev)])[None]
        return {"sequences": seq, "accepted": accepted, "target_forwards": len(accepted)}

    def _context(self, taps: dict[int, torch.Tensor], start: int, end: int):
        x = torch.cat([taps[i] for i in self.target_layer_ids], dim=-1)  # [1, end-start, K*H]
        return self.context_kv(x, torch.arange(start, end, device=x.device)[None])
