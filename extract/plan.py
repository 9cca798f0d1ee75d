"""Pure plans for stage one: which rank extracts which samples, and in which batches."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["dflash_layer_ids", "generation_jobs", "partition", "token_budget_batches"]


def dflash_layer_ids(num_layers: int, num_taps: int) -> list[int]:
    """DFlash default taps: round(1 + i*(N-4)/(K-1)), K evenly spaced layers from 1 to N-3.

    Qwen3-8B (N=36, K=5) -> [1, 9, 17, 25, 33] (z-lab dflash `build_target_layer_ids`).
    """
    if num_taps == 1:
        return [num_layers // 2]
    if num_layers < 4:
        raise ValueError(f"the DFlash tap rule needs >= 4 layers, target has {num_layers}; pass "
                         "--layers")
    # the taps span layers 1..N-3: more taps than that would repeat one
    if num_taps > num_layers - 3:
        raise ValueError(f"--num-taps {num_taps}: the DFlash tap rule spreads taps over layers "
                         f"1..{num_layers - 3} of this {num_layers}-layer target, so at most "
                         f"{num_layers - 3}; pass fewer or --layers")
    return [int(round(1 + i * (num_layers - 4) / (num_taps - 1))) for i in range(num_taps)]


def partition(sample_ids: Sequence[int], lengths: Sequence[int], world_size: int,
              rank: int) -> list[int]:
    """The samples rank `rank` of `world_size` extracts: every sample exactly once over all ranks.

    Samples are dealt round-robin in order of decreasing length (ties by id), so every rank gets
    nearly the same number of tokens and the same mix of lengths. Deterministic in its inputs.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world size {world_size}")
    order = sorted(range(len(sample_ids)), key=lambda i: (-lengths[i], sample_ids[i]))
    return [sample_ids[i] for i in order[rank::world_size]]


def token_budget_batches(sample_ids: Sequence[int], lengths: Sequence[int],
                         budget: int) -> list[list[int]]:
    """Group samples (sorted by length) so that batch size x longest length <= budget.

    Sorting keeps padding small; a sample longer than the budget gets a batch of its own.
    """
    by_id = dict(zip(sample_ids, lengths))
    order = sorted(sample_ids, key=lambda s: (by_id[s], s))
    batches: list[list[int]] = []
    cur: list[int] = []
    for s in order:
        if cur and (len(cur) + 1) * by_id[s] > budget:
            batches.append(cur)
            cur = []
        cur.append(s)
    if cur:
        batches.append(cur)
    return batches


def generation_jobs(prompt_lengths: Sequence[int], num_samples: int) -> list[tuple[int, int]]:
    """(prompt index, sample) pairs to generate, shortest prompts first (ties by index, then
    sample).

    A left-padded generation batch pads every row to its longest prompt, and each decode step reads
    the whole padded KV cache: in prompt order, a batch mixing short GSM8K and long GPQA prompts
    pays for the longest. The order is a pure function of the lengths, so shards and resumed runs
    see the same batches.
    """
    order = sorted(range(len(prompt_lengths)), key=lambda i: (prompt_lengths[i], i))
    return [(i, k) for i in order for k in range(num_samples)]
