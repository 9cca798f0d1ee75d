"""The DFlash drafter: fc + norm over the tapped target states, Qwen3-style layers with KV
injection.

Shapes: B batch, T context tokens, Q block query tokens (num_anchors x block_size), H hidden,
K tapped layers, nh/nkv query/kv heads, hd head dim.

KV injection (as in the DFlash paper and its reference drafter): every layer projects the fused
context through its own k/v projections and prepends it to the block's keys and values; queries come
from block tokens only, so the context bypasses each layer's q, o, residual and MLP paths. Embedding
and lm_head are the target's, frozen; they are buffers here and never saved with the drafter.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from train.attention import SplitMask, split_attention
from train.markov_head import MarkovHead
from train.masks import FlexMask
from train.modeling_dflash import RMSNorm, apply_rope, rope_cos_sin
from train.vocab import draft_labels, target_to_draft

__all__ = ["DrafterConfig", "DFlashDrafter", "apply_rope", "compile_options", "rope_cos_sin"]


@dataclass(frozen=True, kw_only=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_taps: int
    block_size: int = 16
    mask_token_id: int = 0
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    draft_vocab_size: int = 0
    """Tokens the drafter may propose (its `draft_ids`); 0 = the target's whole vocabulary
    (train.vocab)."""
    markov_rank: int = 0
    """Rank of the Markov dependence head (train.markov_head) over the block's slots; 0 = none."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    """flex_attention compiled once per process (uncompiled it runs a slow dense fallback)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


def compile_options(mode: str) -> dict[str, Any]:
    """torch.compile's inductor options for the drafter in `mode` (train.config.COMPILE_MODES).

    Besides the mode's own, the mix-order reduction's non-strict mode where this torch has it: its
    strict checks (a fused norm backward only above 5 Mi elements and 4,096 rows) become guards on
    the micro-batch's size, so micro-batches on either side of them each compiled a graph of their
    own mid-run. Inductor's own note on the option: it skips non-critical checks "to avoid
    recompilations". The large micro-batches that hold most steps pass those checks anyway, so
    their kernels stay the same."""
    import torch._inductor.config as inductor_config

    options = dict(torch._inductor.list_mode_options(mode))
    if hasattr(inductor_config.triton, "mix_order_reduction_non_strict_mode"):
        options["triton.mix_order_reduction_non_strict_mode"] = True
    return options


def _flex():
    """flex_attention as a layer calls it: inside a compiled layer the plain function is traced;
    eager needs the compiled one."""
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention if torch.compiler.is_compiling() else _compiled_flex()


class DraftLayer(nn.Module):
    def __init__(self, c: DrafterConfig) -> None:
        super().__init__()
        self.c = c
        h, hd = c.hidden_size, c.head_dim
        self.input_layernorm = RMSNorm(h, c.rms_eps)
        self.q_proj = nn.Linear(h, c.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, c.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, c.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(c.num_heads * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, c.rms_eps)
        self.k_norm = RMSNorm(hd, c.rms_eps)
        self.post_attention_layernorm = RMSNorm(h, c.rms_eps)
        self.gate_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, h, bias=False)

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ctx [B, T, H] -> roped k, v [B, nkv, T, hd] (cacheable: they never change)."""
        b, t, _ = ctx.shape
        k = self.k_norm(self.k_proj(ctx).view(b, t, -1, self.c.head_dim)).transpose(1, 2)
        v = self.v_proj(ctx).view(b, t, -1, self.c.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, mask: torch.Tensor | object | None) -> torch.Tensor:
        b, q_len, _ = x.shape
        hd = self.c.head_dim
        h = self.input_layernorm(x)
        q = apply_rope(self.q_norm(self.q_proj(h).view(b, q_len, -1, hd)).transpose(1, 2), cos, sin)
        k = apply_rope(self.k_norm(self.k_proj(h).view(b, q_len, -1, hd)).transpose(1, 2), cos, sin)
        v = self.v_proj(h).view(b, q_len, -1, hd).transpose(1, 2)
        if isinstance(mask, SplitMask):  # context and own block attended apart (train.attention)
            o = split_attention(q, k, v, ctx_k, ctx_v, mask, flex=_flex())
        else:
            k, v = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)  # [B, nkv, T+Q, hd]
            if mask is not None and not isinstance(mask, torch.Tensor):  # a FlexAttention BlockMask
                # bare, or with its kernel options (None: inductor's own)
                block, options = mask if isinstance(mask, FlexMask) else (mask, None)
                o = _flex()(q, k.to(q.dtype), v.to(q.dtype), block_mask=block, enable_gqa=True,
                            kernel_options=options)
            else:
                rep = self.c.num_heads // self.c.num_kv_heads
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
                heads_mask = mask[:, None] if mask is not None else None
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=heads_mask)
        x = x + self.o_proj(o.transpose(1, 2).reshape(b, q_len, -1))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class DFlashDrafter(nn.Module):
    """Trainable: fc, hidden_norm, layers, norm. Frozen buffers: embed_tokens, lm_head (its rows of
    the draft vocabulary only, when there is one). With a draft vocabulary, `draft_ids` [N] (saved
    with the weights: the export needs it) maps a draft index to its target id and `t2d` [V]
    back."""

    def __init__(self, c: DrafterConfig, embed: torch.Tensor, lm_head: torch.Tensor,
                 draft_ids: torch.Tensor | None = None) -> None:
        super().__init__()
        self.c = c
        self.fc = nn.Linear(c.num_taps * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.layers = nn.ModuleList(DraftLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.register_buffer("embed_tokens", embed.detach().clone(), persistent=False)  # [V, H]
        if c.draft_vocab_size:
            if draft_ids is None or draft_ids.shape != (c.draft_vocab_size,):
                raise ValueError(f"a drafter with a draft vocabulary of {c.draft_vocab_size} needs "
                                 "as many draft_ids")
            self.register_buffer("draft_ids", draft_ids.detach().clone().long())  # [N]
            # [V]
            self.register_buffer("t2d", target_to_draft(self.draft_ids, c.vocab_size),
                                 persistent=False)
            lm_head = lm_head[self.draft_ids]
        self.register_buffer("lm_head", lm_head.detach().clone(), persistent=False)  # [V or N, H]
        self.markov_head = None
        if c.markov_rank:
            # W2 starts at zero: the head adds nothing until it learns to, so a run with it starts
            # as the plain drafter (and --init-from a drafter without one begins where that drafter
            # ended)
            self.markov_head = MarkovHead(c.vocab_size, c.draft_vocab_size or c.vocab_size,
                                          c.markov_rank)
            nn.init.normal_(self.markov_head.markov_w1.weight, std=0.02)
            nn.init.zeros_(self.markov_head.markov_w2.weight)

    def compile_layers(self, mode: str = "default", scope: str = "layers") -> None:
        """torch.compile in place: fuses the norms, RoPE and SwiGLU around the matmuls.

        Shapes vary per batch (context length, anchors), hence dynamic shapes. `mode`: a
        torch.compile mode (train.config.COMPILE_MODES). `scope`: "layers" compiles each layer,
        "model" the whole training forward as one graph (the context's fc, norms and keys, the
        block embeddings and RoPE, the final norm too, which the layers leave eager).
        """
        options = compile_options(mode)
        if scope == "model":
            self.compile(dynamic=True, options=options)
            return
        for layer in self.layers:
            layer.compile(dynamic=True, options=options)

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [B, T, K*H] -> fused context [B, T, H]."""
        if not torch.is_autocast_enabled(taps.device.type):  # else autocast casts them for fc
            taps = taps.to(self.fc.weight.dtype)
        return self.hidden_norm(self.fc(taps))

    def context_kv(self, taps: torch.Tensor,
                   ctx_pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k, v) of the context: computed once per new context token at inference."""
        ctx = self.fuse(taps)
        cos, sin = rope_cos_sin(ctx_pos, self.c.head_dim, self.c.rope_theta)
        return [layer.context_kv(ctx, cos.to(ctx.dtype), sin.to(ctx.dtype))
                for layer in self.layers]

    def forward(self, taps: torch.Tensor, ctx_pos: torch.Tensor, block_ids: torch.Tensor,
                block_pos: torch.Tensor, mask: torch.Tensor | object | None,
                residual: torch.dtype | None = None) -> torch.Tensor:
        """Training: taps [B, T, K*H], ctx_pos [B, T], blocks [B, Q], mask [B, Q, T+Q] -> hidden [B,
        Q, H]. residual: the blocks' residual stream's dtype under autocast (None: the weights')."""
        return self.draft(block_ids, block_pos, self.context_kv(taps, ctx_pos), mask, residual)

    def draft(self, block_ids: torch.Tensor, block_pos: torch.Tensor,
              ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],
              mask: torch.Tensor | object | None, residual: torch.dtype | None = None
              ) -> torch.Tensor:
        """block_ids, block_pos [B, Q]; mask [B, Q, T+Q] bool (True = may attend) -> hidden [B, Q,
        H]. residual: as in forward; without autocast the stream stays in the weights' dtype (the
        layers' matmuls need it)."""
        if residual is None or not torch.is_autocast_enabled(block_ids.device.type):
            residual = self.fc.weight.dtype
        x = F.embedding(block_ids, self.embed_tokens).to(residual)
        cos, sin = rope_cos_sin(block_pos, self.c.head_dim, self.c.rope_theta)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, k, v, cos, sin, mask)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> [..., V] logits, or [..., N] over the draft vocabulary."""
        return hidden @ self.lm_head.to(hidden.dtype).T

    def labels(self, labels: torch.Tensor, ignore: int) -> torch.Tensor:
        """Target-id labels as the loss sees them: draft indices (OUT_OF_VOCAB where the draft
        vocabulary lacks the token) with a draft vocabulary, else unchanged."""
        if not self.c.draft_vocab_size:
            return labels
        return draft_labels(labels, self.t2d, ignore)
