"""The static engine against HF generate (float32, CPU), and its sampling against loop oracles."""

from __future__ import annotations

import pytest
import torch

from extract.regenerate.sampling import choose_next, hash_u32, request_key, top_p_mask, uniform_noise
from extract.regenerate.static_engine import Request, StaticEngine, supports
from tests.helpers import tiny_target_dir


def _model(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    d = tiny_target_dir(tmp_path / arch, arch)
    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


def _prompts(n: int, seed: int = 0, lo: int = 2, hi: int = 30) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 320, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_equals_generate_token_for_token(tmp_path, arch):
    """Every request's tokens equal HF generate's on that prompt alone (batch 1, no padding), while
    the engine refills rows, grows its cache for long prompts and compacts its draining batch."""
    model = _model(tmp_path, arch)
    assert supports(model) == ""
    # 14 long prompts need a bigger cache; 2 of them wait for a free row, so the batch drains to 2 live rows
    prompts = _prompts(14) + _prompts(14, seed=1, lo=60, hi=90)
    eos = [2]
    eng = StaticEngine(model, batch=12, max_new_tokens=20, eos=eos, sync_every=3, prefill_tokens=40)
    got = dict(eng.generate([Request(i, p, i) for i, p in enumerate(prompts)]))
    assert eng.stats["allocations"] >= 2 and eng.stats["compactions"] >= 1 and eng.stats["prefills"] > 2
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=eos,
                                 pad_token_id=0)[0, len(p):].tolist()
        assert got[i] == ref, f"request {i}"


def test_attention_spans_grow_with_the_furthest_row_and_equal_generate(tmp_path):
    """A step attends over the first `span` cache positions only; spans grow (64, then 128) as the
    furthest row advances, and the tokens still equal generate's."""
    model = _model(tmp_path, "llama")
    prompts = _prompts(3, seed=6, lo=5, hi=40)  # the longest (35) starts a window at 63: writes 63-66
    eng = StaticEngine(model, batch=3, max_new_tokens=70, eos=[], sync_every=4, prefill_tokens=256)
    spans, step = [], eng._decode_step
    eng._decode_step = lambda span: (spans.append(span), step(span))[1]
    got = dict(eng.generate([Request(i, p, i) for i, p in enumerate(prompts)]))
    assert eng.capacity == 128 and spans[0] == 64 and spans[-1] == 128 and spans == sorted(spans)
    longest = max(len(p) for p in prompts)  # no eos: every row lives to the end, one position a step
    assert all(span > longest + k for k, span in enumerate(spans))  # step k writes position longest + k
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=70, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, len(p):].tolist()
        assert got[i] == ref, f"request {i}"


def test_sampled_tokens_depend_on_the_request_not_the_batch(tmp_path):
    model = _model(tmp_path, "llama")
    prompts = _prompts(11)
    kw = dict(max_new_tokens=16, eos=[2], temperature=0.9)
    a = dict(StaticEngine(model, batch=3, sync_every=2, **kw).generate(
        [Request(i, p, request_key(5, i, 0)) for i, p in enumerate(prompts)]))
    b = dict(StaticEngine(model, batch=8, sync_every=5, **kw).generate(
        [Request(i, p, request_key(5, i, 0)) for i, p in reversed(list(enumerate(prompts)))]))
    c = dict(StaticEngine(model, batch=8, sync_every=5, **kw).generate(
        [Request(i, p, request_key(6, i, 0)) for i, p in enumerate(prompts)]))
    greedy = dict(StaticEngine(model, batch=8, max_new_tokens=16, eos=[2]).generate(
        [Request(i, p, 0) for i, p in enumerate(prompts)]))
    assert a == b  # same keys: same tokens, whatever the batch size, order and refills
    assert sum(a[i] != c[i] for i in a) >= 8  # another seed: other draws
    assert sum(a[i] != greedy[i] for i in a) >= 8


def test_max_new_tokens_one_and_eos_first(tmp_path):
    model = _model(tmp_path, "llama")
    prompts = _prompts(5)
    one = dict(StaticEngine(model, batch=4, max_new_tokens=1, eos=[]).generate(
        [Request(i, p, 0) for i, p in enumerate(prompts)]))
    assert all(len(v) == 1 for v in one.values())
    first = {i: v[0] for i, v in one.items()}  # a request ending on its first token yields that token only
    eos_first = dict(StaticEngine(model, batch=4, max_new_tokens=9, eos=[first[0]]).generate(
        [Request(0, prompts[0], 0)]))
    assert eos_first[0] == [first[0]]


# ------------------------------------------------------------------ sampling maths
def test_top_p_mask_matches_a_loop():
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(50, 20, generator=g) * 2, -1).sort(-1, descending=True).values
    for top_p in (0.1, 0.5, 0.9, 0.999, 1.0):
        got = top_p_mask(probs, top_p)
        for r in range(probs.shape[0]):
            mass, want = 0.0, []
            for p in probs[r].tolist():
                want.append(mass < top_p)  # keep while the mass before it is short of top_p
                mass += p
            assert got[r].tolist() == want
    # the mass before the third token is exactly top_p: it is not needed, so it is dropped
    assert top_p_mask(torch.tensor([[0.5, 0.25, 0.25]]), 0.75).tolist() == [[True, True, False]]


def test_hash_noise_is_uniform_deterministic_and_in_range():
    keys = torch.tensor([request_key(0, i, 0) for i in range(400)])
    u = uniform_noise(keys, torch.arange(400) % 7, 64)
    assert u.shape == (400, 64) and float(u.min()) > 0 and float(u.max()) < 1
    assert torch.equal(u, uniform_noise(keys, torch.arange(400) % 7, 64))
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005
    x = torch.tensor([0, 1, 2**32 - 1, 123456789])
    assert bool((hash_u32(x) >= 0).all()) and bool((hash_u32(x) < 2**32).all())


def test_sampled_frequencies_follow_the_filtered_distribution():
    """Many independent requests on one logit row: frequencies ~ softmax(logits / T) restricted to
    top-k then top-p and renormalized (computed here by a plain loop)."""
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    T, k, top_p, n = 0.8, 6, 0.9, 20000
    rows = logits.repeat(n, 1)
    keys = torch.tensor([request_key(1, i, 0) for i in range(n)])
    picks = choose_next(rows, keys, torch.zeros(n, dtype=torch.int64), temperature=T, top_k=k, top_p=top_p)
    order = sorted(range(8), key=lambda i: -logits[i])[:k]
    w = [float(torch.exp(logits[i] / T)) for i in order]
    p = [x / sum(w) for x in w]
    kept, mass = [], 0.0
    for i, q in zip(order, p):
        if mass < top_p:
            kept.append((i, q))
        mass += q
    z = sum(q for _, q in kept)
    freq = torch.bincount(picks, minlength=8).float() / n
    for i in range(8):
        want = dict(kept).get(i, 0.0) / z
        assert abs(float(freq[i]) - want) < 0.015, (i, float(freq[i]), want)


def test_greedy_choice_is_argmax():
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(3))
    got = choose_next(logits, torch.zeros(6, dtype=torch.int64), torch.zeros(6, dtype=torch.int64),
                      temperature=0.0, top_k=50, top_p=0.95)
    assert got.tolist() == [max(range(30), key=lambda j: logits[r, j]) for r in range(6)]


@pytest.mark.slow
def test_long_answers_and_prompts_up_to_the_context_equal_generate(tmp_path):
    """Answers most of the context long and a prompt filling most of it (the tiny target's context is
    512 positions; the packaged one's 8,192 holds 4,096-token answers the same way)."""
    model = _model(tmp_path, "llama")
    assert model.config.max_position_embeddings == 512
    prompts = _prompts(1, seed=2, lo=50, hi=60) + _prompts(1, seed=3, lo=440, hi=450)
    caps = {0: 440, 1: 60}  # each request ends within 512 positions
    for i, p in enumerate(prompts):
        eng = StaticEngine(model, batch=2, max_new_tokens=caps[i], eos=[], sync_every=16, prefill_tokens=512)
        ((_, got),) = eng.generate([Request(i, p, i)])
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=caps[i], do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, len(p):].tolist()
        assert len(got) == caps[i] and got == ref, f"request {i}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_graphs_per_span_equal_generate(tmp_path):
    """On CUDA every span's step is its own captured graph; rows refilled and spans grown, the
    tokens still equal generate's (float32)."""
    model = _model(tmp_path, "llama").cuda()
    prompts = _prompts(10, seed=6, lo=5, hi=40)
    eng = StaticEngine(model, batch=4, max_new_tokens=70, eos=[2], sync_every=4, prefill_tokens=256)
    assert eng.graphed
    got = dict(eng.generate([Request(i, p, i) for i, p in enumerate(prompts)]))
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=70, do_sample=False,
                                 eos_token_id=[2], pad_token_id=0)[0, len(p):].tolist()
        assert got[i] == ref, f"request {i}"
