"""The drafter's side of greedy speculative decoding in fixed-size tensors (DecodingState), and the
clock that times a decode's phases. Shipped beside modeling_dflash.py in every export (torch only).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from .draft_tree import DraftTree, ancestor_mask, build_tree, walk_tree

__all__ = ["DecodingState", "PhaseClock"]


class PhaseClock:
    """Adds the seconds since the last lap to timings[name], the device synchronized first; does
    nothing where timings is None (an untimed decode pays no synchronization)."""

    def __init__(self, timings: dict[str, float] | None, device: torch.device) -> None:
        self.timings, self.device = timings, device
        self.sync()
        self.t = time.perf_counter()

    def sync(self) -> None:
        if self.timings is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def lap(self, name: str) -> None:
        if self.timings is None:
            return
        self.sync()
        now = time.perf_counter()
        self.timings[name] = self.timings.get(name, 0.0) + now - self.t
        self.t = now


class DecodingState:
    """The drafter's side of greedy speculative decoding in fixed-size tensors.

    The context keys and values live in buffers of `rows` rows, of which the first `n` are verified
    (n, a device scalar, is the position of block[0], the last token not yet verified); rows past n
    hold stale or unverified states and are masked out. With every shape fixed, a step (accept the
    verified block, append its states to the context, draft the next block) is one function of
    these tensors; on CUDA it is captured once as a graph and replayed, one launch instead of ~200:
    at batch 1 a few-layer drafter is bound by launches, not arithmetic. With a tree budget N the
    target verifies the N + 1 nodes of `tree` (the root is block[0]) instead of the block.
    """

    def __init__(self, drafter, embed: torch.Tensor, head: torch.Tensor, rows: int,
                 graph: bool, key: tuple, budget: int = 0, width: int = 0,
                 target_dtype: torch.dtype = torch.float32) -> None:
        c, dev, dt = drafter.config, embed.device, drafter.fc.weight.dtype
        bs, self.d, self.embed, self.rows, self.key = drafter.block_size, drafter, embed, rows, key
        self.budget, self.width, self.target_dtype = budget, width, target_dtype
        # a Markov head's tree: each parent's best children kept (config dflash_config
        # tree_child_cap; 0: exact)
        self.child_cap = int(c.dflash_config.get("tree_child_cap", 0))
        # [V or N, H], a copy of its own (a later copy_ must not write into the target's weights),
        # kept in the weight's own layout: a bf16 matmul against the transposed copy ran ~50x slower
        # on a CPU
        self.head = head.to(dt, copy=True).contiguous()
        shape = (1, c.num_key_value_heads, rows, c.head_dim)
        self.k = [torch.zeros(shape, dtype=dt, device=dev) for _ in drafter.layers]
        self.v = [torch.zeros(shape, dtype=dt, device=dev) for _ in drafter.layers]
        self.n = torch.zeros((), dtype=torch.long, device=dev)
        # [Q] ids
        self.block = torch.full((bs,), drafter.mask_token_id, dtype=torch.long, device=dev)
        m = budget + 1 if budget else bs  # tokens one verify sees
        # the target's argmax after each verified token
        self.want = torch.zeros(m, dtype=torch.long, device=dev)
        # the verify's taps
        self.taps = torch.zeros(1, m, drafter.fc.in_features, dtype=embed.dtype, device=dev)
        self.row_ids, self.offsets = torch.arange(rows, device=dev), torch.arange(bs, device=dev)
        # accepted drafts, then the path's node indices, then the tokens emitted [Q] (-1 past
        # them)
        self.out = torch.zeros(2 * bs, dtype=torch.long, device=dev)
        z = torch.zeros(m, dtype=torch.long, device=dev)
        self.tree = DraftTree(z.clone(), z.clone(), z.clone(),
                              torch.ones(m, dtype=torch.bool, device=dev),
                              torch.zeros(m, device=dev))
        self.anc = torch.ones(m, m, dtype=torch.bool, device=dev)  # [N+1, N+1] ancestor-or-self
        self.use_graph, self.graph = graph, None

    def _write(self, taps: torch.Tensor, pos: torch.Tensor) -> None:
        """taps [1, S, K*H] of positions pos [S] -> their keys and values into rows pos."""
        for k, v, (k2, v2) in zip(self.k, self.v, self.d.context_kv(taps, pos[None])):
            k.index_copy_(2, pos, k2)
            v.index_copy_(2, pos, v2)

    def _draft(self) -> None:
        """From block[0] and context rows < n: block[1:] <- the drafter's argmax at the masked slots
        (chain), or the tree of the slots' N best prefixes (tree budget N)."""
        if self.budget:
            self.block[1:].fill_(self.d.mask_token_id)
        hid = self.d(F.embedding(self.block[None], self.embed), (self.n + self.offsets)[None],
                     list(zip(self.k, self.v)), self.row_ids < self.n)  # [1, Q, H]
        logits = F.linear(hid[0, 1:], self.head)  # [Q-1, V or N]
        if not self.budget:
            self.block[1:].copy_(self.d.draft_tokens(logits, self.block[0]))
            return
        logp, bias = self.d.tree_logp(logits, self.block[0])  # [Q-1, V or N]; a Markov head's bias
        tree = build_tree(logp, self.budget, self.block[0], self.width, bias, self.child_cap)
        ids = tree.tokens
        if self.d.draft_ids is not None:  # draft rows -> target ids, the root already one
            ids = torch.cat([tree.tokens[:1], self.d.draft_ids[tree.tokens[1:]]])
        for mine, new in zip(self.tree, (ids, *tree[1:])):
            mine.copy_(new)
        self.anc.copy_(ancestor_mask(tree.parents, self.block.shape[0] - 1))

    def _accept(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(accepted drafts, verified rows to keep [Q]: the root's and the path's, the target's next
        token) from want; fills `out`."""
        q = self.block.shape[0]
        if self.budget:
            a, path, last = walk_tree(self.tree, self.want, q - 1)
            keep = torch.cat([path.new_zeros(1), path])  # [Q] node indices
            bonus = self.want.index_select(0, last[None])
            drafted = self.tree.tokens.index_select(0, path)
        else:
            a = (self.block[1:] == self.want[:-1]).long().cumprod(0).sum()
            keep, bonus, path = self.offsets, self.want.index_select(0, a[None]), self.offsets[1:]
            drafted = self.block[1:]
        emitted = torch.where(self.offsets < a, torch.cat([drafted, bonus]), -1)  # [Q]
        emitted = torch.where(self.offsets == a, bonus, emitted)
        self.out.copy_(torch.cat([a[None], path, emitted]))
        return a, keep, bonus

    def _step(self) -> None:
        a, keep, bonus = self._accept()
        # rows n.. of the root and the accepted path; those past n + a stay masked
        self._write(self.taps.index_select(1, keep), self.n + self.offsets)
        self.n.add_(a + 1)
        self.block[:1].copy_(bonus)  # the target's own token after the accepted ones
        self.block[1:].fill_(self.d.mask_token_id)
        self._draft()

    def verify_inputs(self, n: int) -> dict:
        """The target's inputs for verifying the drafted block or tree whose root is at position
        n."""
        if not self.budget:
            return {"input_ids": self.block[None]}
        m = self.budget + 1
        # the cache holds positions < n, all visible; the tree's nodes see their ancestors and
        # themselves
        see = torch.cat([self.anc.new_ones(m, n), self.anc], 1)  # [N+1, n+N+1]
        mask = torch.zeros(see.shape, dtype=self.target_dtype, device=see.device)
        mask.masked_fill_(~see, torch.finfo(self.target_dtype).min)
        return {"input_ids": self.tree.tokens[None], "position_ids": (n + self.tree.depths)[None],
                "attention_mask": mask[None, None]}

    def result(self) -> tuple[int, list[int], list[int]]:
        """(accepted drafts, the path's node indices, the tokens the step emits) on the host."""
        got = self.out.tolist()
        q = self.block.shape[0]
        a = got[0]
        return a, got[1: q], got[q: q + a + 1]

    def start(self, taps: torch.Tensor, first: torch.Tensor) -> None:
        """taps [1, P, K*H] of the prompt, first (0-d) the target's first token: context and first
        draft."""
        p = taps.shape[1]
        self._write(taps, self.row_ids[:p])
        self.n.fill_(p)
        self.block.fill_(self.d.mask_token_id)
        self.block[:1].copy_(first.view(1))
        self._draft()

    def step(self) -> None:
        """After want and taps hold the verify's results: accept, extend the context, draft the next
        block."""
        if not self.use_graph:
            return self._step()
        # warm up on a side stream, capture, and undo what the warm-up changed
        if self.graph is None:
            saved = (self.n.clone(), self.block.clone(), [x.clone() for x in self.tree],
                     self.anc.clone())
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._step()
                    self._restore(saved)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._step()
            self._restore(saved)
        self.graph.replay()

    def _restore(self, saved: tuple) -> None:
        self.n.copy_(saved[0]), self.block.copy_(saved[1]), self.anc.copy_(saved[3])
        for mine, old in zip(self.tree, saved[2]):
            mine.copy_(old)
