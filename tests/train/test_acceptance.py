"""The decode implied by per-anchor acceptances, against a loop that decodes as spec_generate does."""

from __future__ import annotations

import random

from train.acceptance import (
    decode_chain,
    draft_checks,
    leading_matches,
    per_response_tau,
    vocab_rejections,
)


def _decode_like_spec_generate(accepts: list[int], new_tokens: int) -> list[int]:
    """spec_generate's loop with the drafter replaced by its known acceptance at each anchor."""
    tokens, accepted = [0], [1]  # the prefill emits the first token
    while len(tokens) < new_tokens:
        j = len(tokens) - 1  # the anchor: the last emitted token
        new = list(range(accepts[j] + 1))[: new_tokens - len(tokens)]  # accepted drafts + the bonus
        tokens += new
        accepted.append(len(new))
    return accepted


def test_decode_chain_equals_the_decoding_loop():
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(1, 60)
        bs = rng.choice([2, 4, 8, 16])
        # an acceptance never runs past the known output: at most bs-1, at most what follows the anchor
        accepts = [min(rng.randint(0, bs - 1), n - 1 - j) for j in range(n)]
        steps = decode_chain(accepts, n)
        assert steps == _decode_like_spec_generate(accepts, n)
        assert sum(steps) == n
    assert decode_chain([], 0) == []


def test_leading_matches():
    assert leading_matches([1, 2, 3], [1, 2, 4]) == 2
    assert leading_matches([5, 2], [1, 2]) == 0
    assert leading_matches([1, 2, 3], [1, 2]) == 2  # the known output ends
    assert leading_matches([], [1]) == 0


def test_per_response_tau_counts_drafting_steps_per_response():
    rng = random.Random(1)
    for _ in range(100):
        responses = []
        for _ in range(rng.randint(1, 6)):
            n = rng.randint(1, 40)
            responses.append(_decode_like_spec_generate([rng.randint(0, 7) for _ in range(n)], n))
        means = []
        for accepted in responses:  # the reference benchmark's loop: one entry per drafting step
            steps = [a for i, a in enumerate(accepted) if i > 0]
            if steps:
                means.append(sum(steps) / len(steps))
        got = per_response_tau(responses)
        assert (got is None) if not means else abs(got - sum(means) / len(means)) < 1e-12
    # a long response does not outweigh a short one, and the prefill's single token is not a step
    assert per_response_tau([[1, 4, 4, 4, 4], [1, 2]]) == 3.0
    assert per_response_tau([[1], [1]]) is None


def test_vocab_rejections_counts_the_steps_that_stop_on_a_token_outside():
    rng = random.Random(2)
    for _ in range(300):
        n, bs = rng.randint(1, 50), rng.choice([2, 4, 8])
        accepted = _decode_like_spec_generate([min(rng.randint(0, bs - 1), n - 1 - j) for j in range(n)], n)
        new = [rng.randrange(20) for _ in range(n)]
        vocab = set(rng.sample(range(20), 12))
        ends = [sum(accepted[: i + 1]) for i in range(len(accepted))]  # tokens emitted through step i
        want = [0, 0]
        for i in range(1, len(accepted) - 1):  # drafting steps, the last one left out
            if accepted[i] < bs:  # fewer than bs - 1 drafts accepted: its last token is the target's own
                want[0] += 1
                want[1] += new[ends[i] - 1] not in vocab
        assert vocab_rejections(accepted, new, vocab, bs) == tuple(want)
        assert vocab_rejections(accepted, new, None, bs) == (want[0], 0)
    assert vocab_rejections([1, 2, 4, 1], [5, 6, 7, 8, 9, 10, 11, 12], {5}, 4) == (1, 1)  # step [6, 7] stops on 7


def test_draft_checks_are_the_anchors_drafts_as_decoding_walks_them():
    """Oracle: walk the anchors (each step drafts after anchor j, accepts k drafts at j+1..j+k and, when
    k < block_size - 1, is rejected at j+k+1), the prefill and the last step left out."""
    rng = random.Random(3)
    for _ in range(300):
        n, bs = rng.randint(1, 60), rng.choice([2, 4, 8])
        accepts = [rng.randint(0, bs - 1) for _ in range(n)]
        accepted = decode_chain(accepts, n)
        steps, j = [], 0
        while j < n - 1:
            k = min(accepts[j], n - 2 - j)  # the cap: no draft past the response's last token
            steps.append([(j + 1 + i, False) for i in range(k)] + ([(j + k + 1, True)] if k < bs - 1 else []))
            j += k + 1
        want = [c for step in steps[:-1] for c in step]
        assert draft_checks(accepted, bs) == want, (accepts, accepted)
    assert draft_checks([1, 3, 4, 2], 4) == [(1, False), (2, False), (3, True), (4, False), (5, False), (6, False)]
