"""The static engine: many generation requests through one fixed-shape decode batch.

HF `generate` pads a batch to its longest prompt, runs until its longest answer ends, and spends
each decode step of a small model launching kernels from Python (docs/REGENERATION.md). This
engine keeps `batch` rows busy instead:

- a static KV cache [batch, capacity, kv heads, head dim] per layer; row b holds one request and
  its own position, so rows of different lengths decode side by side;
- the decode step (embed, every layer, lm_head, next-token choice, bookkeeping) has fixed shapes
  and no host synchronisation, so on a GPU it is captured once in a CUDA graph and replayed;
- every `sync_every` steps the host reads which rows finished, hands their tokens out and refills
  those rows from the queue with one batched prefill (prompts right-padded, causal attention);
- a decode step attends over the first `span` cache positions only, the power of two that covers
  the furthest row's position through the next window (one graph per span): the cache is sized
  for the longest prompt plus max_new_tokens, and reading all of it every step made long answers
  pay for the positions no row had reached yet (4,096-token answers: docs/BENCHMARKS.md);
- `attention="auto"` (the default: flash where it runs, else matmuls): on a GPU in half precision
  the decode step's attention is flash attention over variable lengths, each row reading its own
  written positions only, where the plain matmuls read `span` positions for every row. With the
  queue refilling rows, one long row set the span for all 512 and the step cost ~31 ms against
  ~12 ms with most rows idle; flash made 4,096-token answers 1.21x faster on the H200
  (docs/BENCHMARKS.md).

It runs the HF model's own modules (norms, projections, MLP, rotary tables), so the numerics are
the model's; only the attention over the cache is ours. Supported: decoder-only models built
like Llama (llama, mistral, qwen2, qwen3); `supports()` says whether a model qualifies.
Requests are served shortest prompt first; the cache capacity grows (the cache is rebuilt and the
graph recaptured) when the next prompt would not fit.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from extract.plan import token_budget_batches
from extract.regenerate.sampling import choose_next
from target.loader import decoder_parts

__all__ = ["Request", "StaticEngine", "flash_decode", "flash_unsupported", "supports"]

_ARCHS = ("llama", "mistral", "qwen2", "qwen3")


def supports(model: torch.nn.Module) -> str:
    """'' if the static engine can run `model`, else why not (one line)."""
    cfg = model.config
    if getattr(cfg, "model_type", "") not in _ARCHS:
        return f"model type {getattr(cfg, 'model_type', '?')!r} is not one of {', '.join(_ARCHS)}"
    rope = getattr(cfg, "rope_scaling", None) or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) == "dynamic":
        return "dynamic RoPE scaling changes the rotary table with the length"
    return ""


@dataclass(frozen=True)
class Request:
    job: object
    """The caller's handle, returned with the tokens."""
    prompt: Sequence[int]
    key: int
    """32-bit sampling-noise key (extract.regenerate.sampling.request_key)."""


def flash_unsupported(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """'' if flash_decode can run here, else why not (one line)."""
    if device.type != "cuda":
        return "flash attention runs on CUDA devices only"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"flash attention needs float16 or bfloat16, the model is {dtype}"
    if "seqused_k" not in str(torch.ops.aten._flash_attention_forward.default._schema):
        return (f"this torch ({torch.__version__}) has no flash attention over used lengths "
                "(seqused_k)")
    if head_dim % 8 or head_dim > 256:
        return f"flash attention needs a head dim that is a multiple of 8 up to 256, got {head_dim}"
    return ""


def flash_decode(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, cu_q: torch.Tensor,
                 cu_k: torch.Tensor, used: torch.Tensor, span: int, scale: float) -> torch.Tensor:
    """One query per row against the first used[b] positions of row b's cache: q [B, Hq, D], caches
    [B, S, Hkv, D] -> [B, Hq, D]. Flash attention over variable lengths (seqused_k: only the written
    positions are read); graph-safe, since `span` (>= every used[b]) is the only host number."""
    B, S, Hkv, D = kc.shape
    out = torch.ops.aten._flash_attention_forward(
        q, kc.view(B * S, Hkv, D), vc.view(B * S, Hkv, D), cu_q, cu_k, 1, span, 0.0, False, False,
        scale=scale, seqused_k=used)
    return out[0]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class StaticEngine:
    """Greedy or sampled generation of many requests; see the module doc."""

    def __init__(self, model: torch.nn.Module, *, batch: int, max_new_tokens: int,
                 eos: Sequence[int], temperature: float = 0.0, top_k: int = 50, top_p: float = 0.95,
                 sync_every: int = 8, prefill_tokens: int = 16384, cuda_graph: bool | None = None,
                 attention: str = "auto"):
        if batch < 1 or max_new_tokens < 1 or sync_every < 1:
            raise ValueError("batch, max_new_tokens and sync_every must be >= 1")
        if attention not in ("auto", "flash", "matmul"):
            raise ValueError(f"attention must be auto, flash or matmul, got {attention!r}")
        self.model, self.batch, self.max_new = model, batch, max_new_tokens
        self.sample = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        self.sync_every, self.prefill_tokens = sync_every, prefill_tokens
        base, self.layers, self.norm = decoder_parts(model)
        self.embed = base.embed_tokens
        self.rotary, self.head = base.rotary_emb, model.get_output_embeddings()
        attn = self.layers[0].self_attn
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        self.kv_heads = model.config.num_key_value_heads
        self.groups = model.config.num_attention_heads // self.kv_heads
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.graphed = (self.device.type == "cuda") if cuda_graph is None else cuda_graph
        why_not = flash_unsupported(self.device, self.dtype, self.head_dim)
        if attention == "flash" and why_not:
            raise ValueError(f"attention='flash': {why_not}")
        self.flash = attention != "matmul" and not why_not
        """Decode attention by flash attention over each row's own length (else plain matmuls)."""
        self.eos = torch.tensor(sorted(set(eos)) or [-1], device=self.device)
        self.capacity, self.rows_n = 0, 0
        self.stats = {"allocations": 0, "compactions": 0, "prefills": 0, "steps": 0}
        """What the driver did (the bench reports it; tests check that each path ran)."""

    # ------------------------------------------------------------------ state
    def _allocate(self, capacity: int, rows: int) -> None:
        """Cache and per-row state for `rows` rows of `capacity` positions; drops any captured
        graph."""
        B, dev = rows, self.device
        self.rows_n, self.capacity, self.graphs = rows, capacity, {}
        self.stats["allocations"] += 1
        # flash: [B, S, Hkv, D], token-major, so the flattened [B * S, Hkv, D] is its packed layout
        # (row b from b * S); matmuls: [B, Hkv, S, D], contiguous along S, so the span's keys of a
        # (row, head) are one sweep (the token-major views would make each step copy the span for
        # its matmul)
        if self.flash:
            shape = (B, capacity, self.kv_heads, self.head_dim)
        else:
            shape = (B, self.kv_heads, capacity, self.head_dim)
        self.caches = [(torch.zeros(shape, device=dev, dtype=self.dtype),
                        torch.zeros(shape, device=dev, dtype=self.dtype))
                       for _ in self.layers]
        pos = torch.arange(capacity, device=dev)[None]
        cos, sin = self.rotary(torch.zeros(1, device=dev, dtype=self.dtype), position_ids=pos)
        # [capacity, head_dim]: the model's own tables, by position
        self.cos, self.sin = cos[0], sin[0]
        z = lambda dtype=torch.int64: torch.zeros(B, device=dev, dtype=dtype)
        self.tok, self.pos, self.ngen, self.keys = z(), z(), z(), z()
        self.live = z(torch.bool)  # a request is in the row and has not finished
        # last column: scratch
        self.out = torch.zeros(B, self.max_new + 1, device=dev, dtype=torch.int64)
        self._index_rows(B)
        self.slots = torch.arange(capacity, device=dev)

    def _index_rows(self, B: int) -> None:
        self.rows = torch.arange(B, device=self.device)
        # flash attention's offsets: row b's query at b, its keys from b * capacity (int32, as it
        # asks)
        self.cu_q = torch.arange(B + 1, device=self.device, dtype=torch.int32)
        self.cu_k = self.cu_q * self.capacity

    # ------------------------------------------------------------------ model
    def _attend(self, layer, x: torch.Tensor, attend_fn: Callable) -> torch.Tensor:
        """x [N, T, H] -> attention output [N, T, H]; attend_fn(q, k, v) does cache and
        attention."""
        a = layer.self_attn
        shape = (*x.shape[:-1], -1, self.head_dim)
        # [N, T, heads, D]
        q, k, v = a.q_proj(x).view(shape), a.k_proj(x).view(shape), a.v_proj(x).view(shape)
        if hasattr(a, "q_norm"):  # qwen3: RMSNorm over each head
            q, k = a.q_norm(q), a.k_norm(k)
        o = attend_fn(q, k, v)  # [N, T, heads, D]
        return a.o_proj(o.reshape(*x.shape[:-1], -1))

    def _layers(self, h: torch.Tensor,
                attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]):
        for i, layer in enumerate(self.layers):
            h = h + self._attend(layer, layer.input_layernorm(h), lambda q, k, v,
                                 i=i: attend(i, q, k, v))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x * cos + _rotate_half(x) * sin

    def _decode_step(self, span: int) -> None:
        """One token for every row, in place on the state tensors (graph-safe: no host sync).
        Attention reads cache positions [0, span) only: every live row's position must lie below
        it."""
        B = self.rows_n
        # [B, 1, 1, D]
        cos, sin = self.cos[self.pos][:, None, None], self.sin[self.pos][:, None, None]
        heads = torch.arange(self.kv_heads, device=self.device)
        # flat [B * Hkv]: the cache slot of (row b, position pos[b], kv head h) in the flattened
        # cache
        if self.flash:
            slot = self.rows[:, None] * self.capacity + self.pos[:, None]
            flat = (slot * self.kv_heads + heads[None]).reshape(-1)
            # [B]: positions each live row has written, this step's included; a finished row waiting
            # for a refill or a compaction reads one position instead of its whole answer
            used = torch.where(self.live, self.pos + 1, 1).to(torch.int32)
        else:
            head_row = self.rows[:, None] * self.kv_heads + heads[None]
            flat = (head_row * self.capacity + self.pos[:, None]).reshape(-1)
            # [B, 1, 1, span]: not yet written
            hidden = (self.slots[None, :span] > self.pos[:, None])[:, None, None, :]

        def attend(i, q, k, v):  # q [B, 1, Hq, D], k/v [B, 1, Hkv, D]
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            kc, vc = self.caches[i]  # [B, S, Hkv, D] (flash) or [B, Hkv, S, D]
            kc.view(-1, self.head_dim).index_copy_(0, flat, k.reshape(-1, self.head_dim))
            vc.view(-1, self.head_dim).index_copy_(0, flat, v.reshape(-1, self.head_dim))
            if self.flash:
                # [B, Hq, D]
                o = flash_decode(q[:, 0].contiguous(), kc, vc, self.cu_q, self.cu_k, used, span,
                                 self.scaling)
                return o[:, None]
            kc, vc = kc[:, :, :span], vc[:, :, :span]  # [B, Hkv, span, D]: views, strided along B
            # the query heads of one kv head share its keys: [B, Hkv, G, D] against [B, Hkv, S, D].
            # Plain matmuls (as HF's eager attention: scores in the model dtype, softmax in
            # float32): each reads the cache once, whatever the attention backends accept.
            qg = q[:, 0].reshape(B, self.kv_heads, self.groups, self.head_dim)
            scores = torch.matmul(qg, kc.transpose(-1, -2)) * self.scaling  # [B, Hkv, G, span]
            probs = torch.softmax(scores.float().masked_fill(hidden, float("-inf")),
                                  dim=-1).to(qg.dtype)
            return torch.matmul(probs, vc).reshape(B, 1, -1, self.head_dim)  # [B, 1, Hq, D]

        h = self._layers(self.embed(self.tok)[:, None], attend)  # [B, 1, H]
        nxt = choose_next(self.head(h[:, 0]), self.keys, self.ngen, **self.sample)  # [B]
        live = self.live
        self.out[self.rows, torch.where(live, self.ngen, self.max_new)] = nxt
        stop = (nxt[:, None] == self.eos[None]).any(-1) | (self.ngen + 1 >= self.max_new)
        step = live.long()
        self.tok.copy_(torch.where(live, nxt, self.tok))
        self.pos.add_(step)
        self.ngen.add_(step)
        self.live.copy_(live & ~stop)

    def _prefill(self, rows: list[int], reqs: list[Request]) -> None:
        """Prompts of `reqs` into cache rows `rows`; their first new token chosen; the rows made
        live."""
        dev, T = self.device, max(len(r.prompt) for r in reqs)
        ids = torch.zeros(len(reqs), T, device=dev, dtype=torch.int64)
        for j, r in enumerate(reqs):
            ids[j, : len(r.prompt)] = torch.as_tensor(list(r.prompt), device=dev)
        lens = torch.tensor([len(r.prompt) for r in reqs], device=dev)
        rows_t = torch.tensor(rows, device=dev)
        cos, sin = self.cos[:T][None, :, None], self.sin[:T][None, :, None]  # [1, T, 1, D]

        def attend(i, q, k, v):  # [n, T, heads, D], right-padded: pads sit after every real token
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            kc, vc = self.caches[i]
            if self.flash:
                kc[rows_t, :T], vc[rows_t, :T] = k, v
            else:
                kc[rows_t, :, :T], vc[rows_t, :, :T] = k.transpose(1, 2), v.transpose(1, 2)
            kk = k.repeat_interleave(self.groups, dim=2).transpose(1, 2)
            vv = v.repeat_interleave(self.groups, dim=2).transpose(1, 2)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, is_causal=True,
                                               scale=self.scaling)
            return o.transpose(1, 2)

        h = self._layers(self.embed(ids), attend)  # [n, T, H]
        last = h[torch.arange(len(reqs), device=dev), lens - 1]  # [n, H]
        keys = torch.tensor([r.key for r in reqs], device=dev)
        first = choose_next(self.head(last), keys, torch.zeros_like(keys), **self.sample)  # [n]
        self.out[rows_t, 0] = first
        self.tok[rows_t], self.pos[rows_t], self.keys[rows_t] = first, lens, keys
        self.ngen[rows_t] = 1
        stop = ((first[:, None] == self.eos[None]).any(-1)
                | torch.tensor(self.max_new <= 1, device=dev))
        self.live[rows_t] = ~stop

    def _step(self, span: int) -> None:
        if not self.graphed:
            self._decode_step(span)
            return
        graph = self.graphs.get(span)
        if graph is None:  # capture after warm-up on a side stream (CUDA graph rules)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                saved = [t.clone() for t in (self.tok, self.pos, self.ngen, self.live, self.out)]
                for _ in range(2):
                    self._decode_step(span)
                for t, v in zip((self.tok, self.pos, self.ngen, self.live, self.out), saved):
                    t.copy_(v)  # the warm-up steps must not count: put the rows back
            torch.cuda.current_stream().wait_stream(s)
            graph = self.graphs[span] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):  # capturing does not run the step: the replay below does
                self._decode_step(span)
        graph.replay()

    def _span(self, furthest: int) -> int:
        """Cache positions a window must attend over when the furthest row writes position
        `furthest` first: a power of two (few graphs), at least 64, at most the capacity."""
        # the window's last write lands at furthest + sync_every - 1
        need = furthest + self.sync_every
        return min(self.capacity, 1 << max(6, (need - 1).bit_length()))

    def _compact(self, keep: list[int]) -> None:
        """Shrink the batch to rows `keep` (in that order), their caches and state copied over:
        a draining batch should not pay for its finished rows. Drops the captured graph."""
        idx = torch.tensor(keep, device=self.device)
        self.caches = [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in self.caches]
        for name in ("tok", "pos", "ngen", "keys", "live", "out"):
            setattr(self, name, getattr(self, name).index_select(0, idx))
        self.rows_n, self.graphs = len(keep), {}
        self.stats["compactions"] += 1
        self._index_rows(len(keep))

    # ------------------------------------------------------------------ driver
    def generate(self, requests: Sequence[Request]) -> Iterator[tuple[object, list[int]]]:
        """Yield (job, new token ids) per request as each finishes (eos kept, if it ended on one).

        Requests are served shortest prompt first. The cache is sized for the next `batch`
        requests (rows: at most as many as are left; positions: the longest of them +
        max_new_tokens, rounded up to a power of two); a request that does not fit waits until the
        batch drains, then the cache is rebuilt for the requests left. Once the queue is empty and
        at most half of the rows are live, the live rows are compacted into a smaller batch.
        """
        queue = deque(sorted(requests, key=lambda r: len(r.prompt)))
        owner: dict[int, Request] = {}
        made: dict[int, int] = {}  # row -> tokens made by the last sync (host copy)
        with torch.no_grad():
            while queue or owner:
                if queue and not owner and len(queue[0].prompt) + self.max_new > self.capacity:
                    rows = min(self.batch, len(queue))
                    need = len(queue[rows - 1].prompt) + self.max_new
                    self._allocate(1 << max(6, (need - 1).bit_length()), rows)
                free = [b for b in range(self.rows_n) if b not in owner]
                take: list[Request] = []
                fits = lambda r: len(r.prompt) + self.max_new <= self.capacity
                while queue and len(take) < len(free) and fits(queue[0]):
                    take.append(queue.popleft())
                # prefill groups within the token budget (take is sorted by length: little padding)
                for idx in token_budget_batches(range(len(take)), [len(r.prompt) for r in take],
                                                self.prefill_tokens):
                    group, rows_g = [take[k] for k in idx], [free[k] for k in idx]
                    self._prefill(rows_g, group)
                    self.stats["prefills"] += 1
                    owner.update(zip(rows_g, group))
                    made.update((b, 1) for b in rows_g)
                # a row's next write position is its prompt length + tokens made - 1 (the prefill
                # made the first)
                furthest = max(len(r.prompt) + made[b] - 1 for b, r in owner.items())
                span = self._span(furthest)
                for _ in range(self.sync_every):
                    self._step(span)
                self.stats["steps"] += self.sync_every
                state = torch.stack([self.live.long(), self.ngen]).cpu()  # the only sync per window
                made = {b: int(state[1, b]) for b in owner}
                ended = [b for b in owner if not state[0, b]]
                if ended:
                    outs = self.out[torch.tensor(ended, device=self.device)].cpu()
                    for b, row in zip(ended, outs):
                        yield owner.pop(b).job, row[: int(state[1, b])].tolist()
                # a draining batch (nothing left to refill it) shrinks once half its rows are idle
                if not queue and owner and self.rows_n > 8 and len(owner) <= self.rows_n // 2:
                    keep = sorted(owner)
                    self._compact(keep)
                    owner = {new: owner[old] for new, old in enumerate(keep)}
                    made = {new: made[old] for new, old in enumerate(keep)}
