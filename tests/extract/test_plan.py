"""Pure plans: partition over world sizes, token-budget batches, the DFlash tap rule."""

from __future__ import annotations

import random

import pytest

from extract.plan import dflash_layer_ids, generation_jobs, partition, token_budget_batches


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 8, 16, 64])
@pytest.mark.parametrize("n", [0, 1, 5, 100, 1001])
def test_partition_every_sample_exactly_once(world, n):
    rng = random.Random(n * 31 + world)
    ids = rng.sample(range(10 * n + 1), n)
    lengths = [rng.randint(1, 4096) for _ in ids]
    parts = [partition(ids, lengths, world, r) for r in range(world)]
    flat = [s for p in parts for s in p]
    assert sorted(flat) == sorted(ids)
    assert parts == [partition(ids, lengths, world, r) for r in range(world)]  # deterministic
    if n >= world:  # balanced in count, and in tokens within one longest sample
        by_id = dict(zip(ids, lengths))
        tokens = [sum(by_id[s] for s in p) for p in parts]
        assert max(len(p) for p in parts) - min(len(p) for p in parts) <= 1
        assert max(tokens) - min(tokens) <= max(lengths)


def test_partition_rejects_bad_rank():
    with pytest.raises(ValueError):
        partition([1], [1], 2, 2)


@pytest.mark.parametrize("budget", [64, 300, 4096])
def test_token_budget_batches(budget):
    rng = random.Random(budget)
    ids = list(range(300))
    lengths = [rng.randint(1, 200) for _ in ids]
    batches = token_budget_batches(ids, lengths, budget)
    assert sorted(s for b in batches for s in b) == ids
    for b in batches:
        longest = max(lengths[s] for s in b)
        assert len(b) == 1 or len(b) * longest <= budget
    # greedy: the next sample would not have fitted
    order = [s for b in batches for s in b]
    assert [lengths[s] for s in order] == sorted(lengths)


def test_dflash_rule():
    assert dflash_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert dflash_layer_ids(64, 5) == [1, 16, 31, 46, 61]  # Qwen3.6-27B
    assert dflash_layer_ids(24, 5) == [1, 6, 11, 16, 21]
    with pytest.raises(ValueError):
        dflash_layer_ids(3, 2)


def test_generation_jobs_shortest_prompts_first_and_padding_falls():
    rng = random.Random(0)
    lengths = [rng.choice([rng.randint(60, 200), rng.randint(400, 900)]) for _ in range(300)]  # short and long mixed
    jobs = generation_jobs(lengths, 3)
    assert sorted(jobs) == [(i, k) for i in range(300) for k in range(3)]  # every job once
    assert all(lengths[a[0]] <= lengths[b[0]] for a, b in zip(jobs, jobs[1:]))
    assert jobs == generation_jobs(lengths, 3)

    def padding(order, batch=64):  # the padded tokens of left-padded batches, naive loop
        total = 0
        for b in range(0, len(order), batch):
            rows = [lengths[i] for i, _ in order[b: b + batch]]
            total += sum(max(rows) - n for n in rows)
        return total

    prompt_order = [(i, k) for i in range(300) for k in range(3)]
    assert padding(jobs) < 0.2 * padding(prompt_order)


def test_tap_counts_the_target_can_hold_are_distinct_and_more_are_refused_in_one_line():
    for n in range(4, 41):
        for k in range(2, n - 2):
            ids = dflash_layer_ids(n, k)
            assert len(set(ids)) == k and min(ids) >= 1 and max(ids) <= n - 3, (n, k)
        with pytest.raises(ValueError, match=f"--num-taps {n - 2}: .* at most {n - 3}"):
            dflash_layer_ids(n, n - 2)
