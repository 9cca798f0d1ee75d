"""Regeneration engines side by side on the same prompts, in one process: new tokens per second.

    python -m bench regen --prompts 1024 --max-new-tokens 256 --json OUT.json
    python -m bench regen --random-weights --prompts 256    # SmolLM2 shape, no GGUF needed

Paths (each over the same prompts, shortest first):
  hf       today's `extract.regenerate --engine hf`: HF `generate`, dynamic cache, padded batches
  static   extract.regenerate.static_engine.StaticEngine (CUDA-graphed decode step, rows refilled from the queue)
           with attention="matmul": every row reads the cache up to the furthest row's span
  static-flash  the same engine with attention="flash" (the engine's default where it runs, "auto"):
           flash attention over each row's own length
  cb       transformers' continuous batching (`generate_batch`) with the given config, if it runs
greedy and sampled (T 0.8, top-k 50, top-p 0.95). For greedy, the static engine's outputs are
compared with the hf path's token for token (bf16 on a GPU: ties can flip with batch shape).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def _prompts(tok, n: int) -> list[list[int]]:
    from chat.prompts import train_prompts
    from target.loader import chat_ids

    convs = train_prompts()
    return [chat_ids(tok, c) for c in (convs * (1 + n // len(convs)))[:n]]


def run_hf(model, tok, prompts, *, max_new: int, batch: int, temperature: float, eos: list[int]) -> list[list[int]]:
    """Today's path: `extract.regenerate --engine hf`'s own generator, over every prompt once."""
    from extract.regenerate.answers import RegenConfig, hf_tokens

    cfg = RegenConfig(out="-", temperature=temperature, max_new_tokens=max_new)
    outs: list[list[int]] = [[] for _ in prompts]
    for (i, _), toks in hf_tokens(cfg, model, tok, prompts, 1, set(), eos, batch, next(model.parameters()).device):
        outs[i] = toks
    return outs


def run_static(model, prompts, *, max_new: int, batch: int, temperature: float, eos: list[int], sync_every: int,
               prefill_tokens: int, attention: str = "matmul") -> list[list[int]]:
    from extract.regenerate.sampling import request_key
    from extract.regenerate.static_engine import Request, StaticEngine

    eng = StaticEngine(model, batch=batch, max_new_tokens=max_new, eos=eos, temperature=temperature,
                       sync_every=sync_every, prefill_tokens=prefill_tokens, attention=attention)
    outs: list[list[int]] = [[] for _ in prompts]
    for i, toks in eng.generate([Request(i, p, request_key(0, i, 0)) for i, p in enumerate(prompts)]):
        outs[i] = toks
    print(f"static engine: {eng.stats}", flush=True)
    return outs


def run_cb(model, prompts, *, max_new: int, temperature: float, eos: list[int], cb: dict) -> list[list[int]]:
    import dataclasses

    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    cfg = ContinuousBatchingConfig(**{k: v for k, v in cb.items() if k in fields})
    kw = dict(do_sample=True, temperature=temperature, top_p=0.95, top_k=50) if temperature > 0 else dict(do_sample=False)
    gc = GenerationConfig(max_new_tokens=max_new, eos_token_id=eos, pad_token_id=0, **kw)
    res = model.generate_batch(inputs=prompts, generation_config=gc, continuous_batching_config=cfg)
    outs: list[list[int]] = [[] for _ in prompts]
    for j, (_, r) in enumerate(sorted(res.items(), key=lambda kv: int(str(kv[0]).rsplit("_", 1)[-1]))):
        outs[j] = list(r.generated_tokens)
    return outs


def _random_smollm2(dev: torch.device):
    """SmolLM2-135M's shape (its GGUF's config) with random weights, bf16 on a GPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True,
                      max_position_embeddings=8192)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    return LlamaForCausalLM(cfg).to(device=dev, dtype=dtype).eval()


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """Share of identical outputs, and of tokens before the first difference."""
    same = sum(x == y for x, y in zip(a, b))
    pref = tot = 0
    for x, y in zip(a, b):
        n = next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        pref, tot = pref + n, tot + max(len(x), len(y))
    return {"identical": same / max(1, len(a)), "common_prefix_tokens": pref / max(1, tot)}


def _timed(a: argparse.Namespace, path: str, mode: str, model, tok, prompts: list, eos: list[int],
           dev: torch.device) -> tuple[dict, list | None]:
    """One path in one mode over every prompt: (its row, its outputs or None where it failed)."""
    temp = 0.0 if mode == "greedy" else 0.8
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    try:
        if path == "hf":
            o = run_hf(model, tok, prompts, max_new=a.max_new_tokens, batch=a.hf_batch, temperature=temp, eos=eos)
        elif path in ("static", "static-flash"):
            o = run_static(model, prompts, max_new=a.max_new_tokens, batch=a.batch, temperature=temp, eos=eos,
                           sync_every=a.sync_every, prefill_tokens=a.prefill_tokens,
                           attention="flash" if path == "static-flash" else "matmul")
        else:
            o = run_cb(model, prompts, max_new=a.max_new_tokens, temperature=temp, eos=eos, cb=json.loads(a.cb))
    except Exception as e:  # noqa: BLE001 - a path that does not run on this version is reported, not fatal
        return {"path": path, "mode": mode, "error": f"{type(e).__name__}: {str(e)[:300]}"}, None
    if dev.type == "cuda":
        torch.cuda.synchronize()
    s, n = time.perf_counter() - t0, sum(map(len, o))
    return {"path": path, "mode": mode, "seconds": round(s, 2), "new_tokens": n, "tok_per_s": round(n / s, 1),
            "ended_on_eos": sum(1 for x in o if x and x[-1] in eos)}, o


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--hf-batch", type=int, default=512)
    ap.add_argument("--batch", type=int, default=512, help="static engine rows")
    ap.add_argument("--sync-every", type=int, default=8)
    ap.add_argument("--prefill-tokens", type=int, default=32768)
    ap.add_argument("--paths", default="hf,static,cb", help="comma list of hf, static, static-flash, cb")
    ap.add_argument("--modes", default="greedy,sampled")
    ap.add_argument("--cb", default='{"max_batch_tokens": 8192, "use_cuda_graph": true, "num_blocks": 1024, '
                    '"max_requests_per_batch": 512}', help="ContinuousBatchingConfig fields (JSON)")
    ap.add_argument("--random-weights", action="store_true", help="SmolLM2-135M shape, random weights")
    ap.add_argument("--json", default="")
    a = ap.parse_args()

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if a.random_weights:  # no GGUF, no tokenizer: random prompts, no eos (every request runs max_new_tokens)
        model, tok, eos = _random_smollm2(dev), None, []
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(10, 49152, (int(n),), generator=g).tolist()
                   for n in torch.randint(40, 320, (a.prompts,), generator=g)]
        a.paths = ",".join(p for p in a.paths.split(",") if p != "hf")
    else:
        from target.loader import load_target

        t = load_target("", device=dev)
        model, tok = t.model, t.tokenizer
        from target.loader import eos_ids

        eos, prompts = eos_ids(tok, model), _prompts(tok, a.prompts)
    print(f"{len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, device {dev}, dtype {model.dtype}", flush=True)
    rows, outs = [], {}
    for mode in a.modes.split(","):
        for path in a.paths.split(","):
            row, o = _timed(a, path, mode, model, tok, prompts, eos, dev)
            rows.append(row)
            if o is not None:
                outs[(path, mode)] = o
            print(json.dumps(row), flush=True)
    for row in rows:  # after all runs: the paths may come in any order
        if row["mode"] == "greedy" and row["path"] != "hf" and "error" not in row and ("hf", "greedy") in outs:
            row["agreement_with_hf"] = agreement(outs[(row["path"], "greedy")], outs[("hf", "greedy")])
        if row["mode"] == "greedy" and row["path"] == "static-flash" and ("static", "greedy") in outs \
                and ("static-flash", "greedy") in outs:
            row["agreement_with_static"] = agreement(outs[("static-flash", "greedy")], outs[("static", "greedy")])
    res = {"prompts": len(prompts), "max_new_tokens": a.max_new_tokens, "device": torch.cuda.get_device_name()
           if dev.type == "cuda" else "cpu", "dtype": str(model.dtype), "random_weights": a.random_weights,
           "args": vars(a), "rows": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    print(f"{'path':8} {'mode':8} {'seconds':>8} {'tok/s':>10}  agreement")
    for r in rows:
        print(f"{r['path']:8} {r['mode']:8} {r.get('seconds', 0):8} {r.get('tok_per_s', 0):10}  "
              f"{r.get('agreement_with_hf', r.get('agreement_with_static', r.get('error', '')))}")


if __name__ == "__main__":
    main()
