"""The static engine against HF generate (float32, CPU), and its sampling against loop oracles."""

from __future__ import annotations

import copy

import pytest
import torch

from extract.regenerate.sampling import (
    choose_next,
    hash_u32,
    request_key,
    top_p_mask,
    uniform_noise,
)
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


def test_flash_attention_is_refused_where_it_cannot_run(tmp_path):
    """attention='flash' on the CPU (or in float32) stops in one line; 'auto' falls back to matmuls,
    the default."""
    from extract.regenerate.static_engine import flash_unsupported

    model = _model(tmp_path, "llama")
    assert "CUDA" in flash_unsupported(torch.device("cpu"), torch.bfloat16, 64)
    assert "float32" in flash_unsupported(torch.device("cuda"), torch.float32, 64)
    with pytest.raises(ValueError, match="attention='flash': flash attention runs on CUDA"):
        StaticEngine(model, batch=2, max_new_tokens=4, eos=[], attention="flash")
    with pytest.raises(ValueError, match="attention must be"):
        StaticEngine(model, batch=2, max_new_tokens=4, eos=[], attention="sdpa")
    assert not StaticEngine(model, batch=2, max_new_tokens=4, eos=[], attention="auto").flash
    assert not StaticEngine(model, batch=2, max_new_tokens=4, eos=[]).flash


def _packed_attention_loop(q, kc, vc, cu_q, cu_k, used, span, scale):
    """flash_decode's contract by a loop: row b's query against keys [cu_k[b], cu_k[b] + used[b]) of
    the packed [B * S, Hkv, D] cache, each kv head shared by its group of query heads."""
    B, S, Hkv, D = kc.shape
    kf, vf, G = kc.reshape(B * S, Hkv, D), vc.reshape(B * S, Hkv, D), q.shape[1] // Hkv
    assert int(used.max()) <= span and cu_q.tolist() == list(range(B + 1))
    out = torch.empty_like(q)
    for b in range(B):
        keys = slice(int(cu_k[b]), int(cu_k[b]) + int(used[b]))
        for h in range(q.shape[1]):
            w = torch.softmax((kf[keys, h // G] @ q[b, h]).float() * scale, dim=0).to(q.dtype)
            out[b, h] = w @ vf[keys, h // G]
    return out


def test_flash_path_plumbing_equals_generate(tmp_path, monkeypatch):
    """The flash path's packed offsets, used lengths and token-major cache, with the kernel replaced
    by a loop of the same contract (the kernel itself runs on CUDA only): float32 tokens equal
    generate's while rows are refilled, spans grow and the batch compacts."""
    import extract.regenerate.static_engine as se

    model = _model(tmp_path, "llama")
    monkeypatch.setattr(se, "flash_decode", _packed_attention_loop)
    prompts = _prompts(14) + _prompts(14, seed=1, lo=60, hi=90)  # as the first test: the same three paths
    eng = StaticEngine(model, batch=12, max_new_tokens=24, eos=[2], sync_every=3, prefill_tokens=40)
    eng.flash = True
    got = dict(eng.generate([Request(i, p, i) for i, p in enumerate(prompts)]))
    assert eng.stats["allocations"] >= 2 and eng.stats["compactions"] >= 1 and eng.stats["prefills"] > 2
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=[2],
                                 pad_token_id=0)[0, len(p):].tolist()
        assert got[i] == ref, f"request {i}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_flash_decode_equals_a_dense_loop():
    """Each row's query against its own first used[b] cache positions only (GQA: 3 query heads per
    kv head), against the loop of the same contract in float32."""
    from extract.regenerate.static_engine import flash_decode

    g = torch.Generator().manual_seed(0)
    B, S, Hkv, G, D = 5, 256, 3, 3, 64
    q = torch.randn(B, Hkv * G, D, generator=g)
    kc, vc = torch.randn(B, S, Hkv, D, generator=g), torch.randn(B, S, Hkv, D, generator=g)
    used = torch.tensor([1, 17, 64, 130, 200], dtype=torch.int32)
    cu_q = torch.arange(B + 1, dtype=torch.int32)
    ref = _packed_attention_loop(q, kc, vc, cu_q, cu_q * S, used, 256, D ** -0.5)
    dev = lambda t: t.to("cuda", torch.bfloat16)  # noqa: E731
    got = flash_decode(dev(q), dev(kc), dev(vc), cu_q.cuda(), (cu_q * S).cuda(), used.cuda(), 256, D ** -0.5)
    torch.testing.assert_close(got.float().cpu(), ref, atol=3e-2, rtol=3e-2)


def _argmax_gaps(model32, prompts, outs) -> torch.Tensor:
    """How far below the float32 model's best logit each emitted token lies, in units of that
    position's logit spread (std), the float32 model reading the emitted history: 0 where the token
    is its argmax. Half-precision rounding flips near ties (measured on the CPU in bf16: 35 of 700
    tokens, at most 0.11); a wrong attention emits tokens whole spreads below."""
    gaps = []
    for i, p in enumerate(prompts):
        with torch.no_grad():
            lg = model32(torch.tensor([p + outs[i][:-1]], device="cuda")).logits[0, len(p) - 1:].float()  # [n, V]
        chosen = lg.gather(-1, torch.tensor(outs[i], device="cuda")[:, None])[:, 0]
        gaps.append((lg.max(-1).values - chosen) / lg.std(-1))
    return torch.cat(gaps).cpu()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_flash_engine_emits_the_float32_models_choices(tmp_path):
    """bf16 on CUDA, rows refilled and spans grown: the flash engine's tokens are the float32 model's
    argmax up to half-precision near ties, as the matmul engine's are."""
    model32 = _model(tmp_path, "llama").cuda()
    model = copy.deepcopy(model32).to(torch.bfloat16)
    prompts = _prompts(10, seed=6, lo=5, hi=40)
    kw = dict(batch=4, max_new_tokens=70, eos=[], sync_every=4, prefill_tokens=256)
    for attention in ("flash", "matmul"):
        eng = StaticEngine(model, attention=attention, **kw)
        assert eng.flash == (attention == "flash") and eng.graphed
        outs = dict(eng.generate([Request(i, p, i) for i, p in enumerate(prompts)]))
        assert all(len(outs[i]) == 70 for i in range(10))
        gaps = _argmax_gaps(model32, prompts, outs)
        assert gaps.max() < 0.3 and (gaps > 0).float().mean() < 0.15, (attention, gaps.max(), (gaps > 0).sum())
